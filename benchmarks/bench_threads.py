"""Family 18: threads training one model concurrently, each calling one traced step.

The model is an MLP 64-256-256-1 (6 variables), batch 128, trained with Adam by a
``tf.function`` step (forward, backward, ``apply_gradients``) that every thread calls; a
call of a variant releases ``threads`` persistent workers (:class:`Crew`, started on a
barrier) that make :data:`STEPS` steps each, and waits for them. Variants, each on a
model of its own built from the same seed:

* ``racy``: the plain model and Adam, no lock: fast and wrong. Its *lost updates* are
  counted: Keras' ``iterations.assign_add(1)`` is a read then a write, so a step that
  overlaps another's loses its count; ``lost_updates`` is ``threads x STEPS`` minus how
  far ``iterations`` moved (the weights' and slots' updates race the same way);
* ``threading.Lock``: the same step called under one ``threading.Lock`` (steps never
  overlap: the reference a hand-written fix gives);
* ``lock_span="step"``: the model built in ``safevars.scope()``, ``SafeOptimizer(Adam)``
  with the default span, the step one critical section from the forward pass's reads
  (steps are serializable; their Python calls and TensorFlow's dispatch still overlap);
* ``lock_span="update"``: the same with only the update locked (Hogwild-style: forward and
  backward passes of several threads overlap, every update is whole and none is lost);
* ``tf.CriticalSection``: the plain model and Adam, the step's update (in ``update``
  cases) or the whole step (in ``step`` cases) run by ``tf.CriticalSection.execute``
  inside the traced step: TensorFlow's own graph lock, without safevars. It shows what
  any lock taken in the graph costs on the machine: every ``MutexLock`` goes through the
  mutex's own thread, and the update waits for every gradient. Not in ``--quick`` runs.

Two cases per thread count (``--threads``, default 1, 2, 4 and 8), each timing three
variants (``--quick``: two, and 4 steps per thread per call instead of 8):

* ``update/<n> threads``: ``racy`` (the baseline) against ``lock_span="update"``. Goal
  (issue 46): at least 0.95x the racy throughput at 2 threads or more, that is a time per
  call at most 1/0.95 = 1.053x the racy one's, with no update lost;
* ``step/<n> threads``: ``threading.Lock`` (the baseline) against ``lock_span="step"``.
  Goal: at least 1.3x the locked throughput, a time per call at most 1/1.3 = 0.769x.

The figures are seconds per call (``ops_per_call`` steps); a ratio of times is the inverse
of the ratio of throughputs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import safevars
from benchmarks.bench_contention import Crew
from benchmarks.case import Case, Context
from benchmarks.tf_functions import critical_section_step, training_step

FAMILY = "threads"
DESCRIPTION = (
    "1-8 threads training one MLP with a traced step: racy Adam (its lost updates), a "
    "threading.Lock around the step, SafeOptimizer with lock_span step and update"
)
ORDER = 18
SECONDS = {"full": 22, "quick": 8}  # measured on a quiet 2-core CPU: 78 s for --repeat 3

FEATURES = 64
WIDTH = 256
BATCH = 128
STEPS = {True: 4, False: 8}  # steps per thread per call
UPDATE_GOAL = round(1 / 0.95, 4)  # time per call: at least 0.95x the racy throughput
STEP_GOAL = round(1 / 1.3, 4)  # time per call: at least 1.3x the locked throughput

RACY = "racy"
LOCKED = "threading.Lock"
SPAN_STEP = 'lock_span="step"'
SPAN_UPDATE = 'lock_span="update"'
TF_SECTION = "tf.CriticalSection"


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


class Trainer:
    """One model, its optimizer and its traced step; ``step()`` runs one step."""

    def __init__(
        self, lock_span: str | None, locked: bool = False, tf_section: str | None = None
    ) -> None:
        if lock_span is None:
            self.model, optimizer = _model(), keras.optimizers.Adam(1e-3)
        else:
            with safevars.scope():
                self.model = _model()
                optimizer = safevars.SafeOptimizer(
                    keras.optimizers.Adam(1e-3), lock_span=lock_span
                )
        self.optimizer = optimizer
        optimizer.build(self.model.trainable_variables)
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=(BATCH, FEATURES)).astype("float32"))
        y = tf.constant(np.tanh(x.numpy()[:, :1]))
        if tf_section is None:
            self._traced = training_step(self.model, optimizer, x, y)
        else:
            self._traced = critical_section_step(self.model, optimizer, x, y, tf_section)
        self._lock = threading.Lock() if locked else None
        self._traced()  # traced once, before any thread calls it

    def step(self) -> None:
        if self._lock is None:
            self._traced()
        else:
            with self._lock:
                self._traced()

    def iterations(self) -> int:
        return int(self.optimizer.iterations.numpy())


def _variant(trainer: Trainer, threads: int, steps: int, crews: list[Crew]) -> Callable[[], Any]:
    crew = Crew(threads, steps, trainer.step)
    crews.append(crew)
    expected = threads * steps

    def call() -> dict[str, int]:
        before = trainer.iterations()
        crew.run()
        return {"lost_updates": expected - (trainer.iterations() - before), "updates": expected}

    return call


def _close(crews: list[Crew]) -> None:
    for crew in crews:
        crew.close()


def cases(ctx: Context) -> list[Case]:
    steps = STEPS[ctx.quick]
    with tf.device(ctx.device):
        trainers = {
            RACY: Trainer(None),
            LOCKED: Trainer(None, locked=True),
            SPAN_STEP: Trainer("step"),
            SPAN_UPDATE: Trainer("update"),
        }
        if not ctx.quick:
            for span in ("update", "step"):
                trainers[f"{TF_SECTION}/{span}"] = Trainer(None, tf_section=span)
    out = []
    for threads in ctx.threads:
        label = f"{threads} thread{'' if threads == 1 else 's'}"
        for kind, (baseline, variant, bound) in {
            "update": (RACY, SPAN_UPDATE, UPDATE_GOAL),
            "step": (LOCKED, SPAN_STEP, STEP_GOAL),
        }.items():
            crews: list[Crew] = []
            names = [baseline, variant]
            if not ctx.quick:
                names.append(TF_SECTION)
            variants = {
                name: _variant(
                    trainers[f"{TF_SECTION}/{kind}" if name == TF_SECTION else name],
                    threads,
                    steps,
                    crews,
                )
                for name in names
            }

            out.append(
                Case(
                    family=FAMILY,
                    name=f"{kind}/{label}",
                    variants=variants,
                    ops_per_call=threads * steps,
                    params={
                        "threads": threads,
                        "steps_per_thread": steps,
                        "model": f"mlp {FEATURES}-{WIDTH}-{WIDTH}-1",
                        "batch": BATCH,
                    },
                    goal=(variant, "<=", bound) if threads > 1 else None,
                    teardown=functools.partial(_close, crews),
                )
            )
    return out
