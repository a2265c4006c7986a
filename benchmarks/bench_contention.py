"""Family 4: contention, 1 to 8 threads doing read-modify-write on one variable.

Every call releases ``threads`` persistent worker threads (started on a
``threading.Barrier``) that each do ``iterations`` increments of one shared variable,
then waits for all of them. The figures are increments per second, and the *lost
updates* of the call: how far the final value is below ``threads x iterations``.

Variants, each on its own variable:

* ``tf.Variable (racy)``: ``v.assign(v.read_value() + 1)``, unprotected: the baseline,
  fast and wrong (its lost updates are the point of the table);
* ``SafeVariable.update``: ``v.update(lambda x: x + 1)``;
* ``safevars.locked``: ``with safevars.locked(v): v.assign(v.read_value() + 1)``;
* ``threading.Lock``: the racy code inside a hand-written ``with lock:``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

import safevars
from benchmarks.case import Case, Context

FAMILY = "contention"
DESCRIPTION = (
    "1-8 threads doing read-modify-write: throughput and lost updates, plain vs "
    "SafeVariable.update vs safevars.locked vs threading.Lock"
)
ORDER = 4
SECONDS = {"full": 12, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide

#: Increments per thread per call (quick, full). Full runs took 200 until issue 44: a call
#: of 8 threads then took about 50 ms on 2 cores, one batch each round, and the family
#: about a minute; the ratios do not depend on it (every call is the same work).
ITERATIONS = {True: 25, False: 50}
#: Seconds any worker or the caller waits on a barrier before giving up (a hang guard).
BARRIER_TIMEOUT = 120.0


class Crew:
    """``threads`` persistent workers; :meth:`run` makes each do ``iterations`` steps.

    Ownership: the crew owns its threads; :meth:`close` stops and joins them.

    Thread safety: :meth:`run` and :meth:`close` are for one controlling thread. A step
    that raises makes :meth:`run` raise it once every worker has finished the call.
    """

    def __init__(self, threads: int, iterations: int, step: Callable[[], Any]) -> None:
        self.threads = threads
        self.iterations = iterations
        self._step = step
        self._start = threading.Barrier(threads + 1)
        self._done = threading.Barrier(threads + 1)
        self._stopping = False
        self._errors: list[BaseException] = []
        self._workers = [
            threading.Thread(target=self._work, name=f"bench-contention-{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    def _work(self) -> None:
        while True:
            try:
                self._start.wait(BARRIER_TIMEOUT)
            except threading.BrokenBarrierError:
                return
            if self._stopping:
                return
            try:
                for _ in range(self.iterations):
                    self._step()
            except BaseException as e:  # noqa: BLE001 - handed to run()
                self._errors.append(e)
            try:
                self._done.wait(BARRIER_TIMEOUT)
            except threading.BrokenBarrierError:
                return

    def run(self) -> None:
        """Runs one round of ``iterations`` steps on every worker and waits for them."""
        self._start.wait(BARRIER_TIMEOUT)
        self._done.wait(BARRIER_TIMEOUT)
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error

    def close(self) -> None:
        """Stops the workers and joins them (each join with a timeout).

        Breaks both barriers, so a worker waiting on either returns at once, whether
        the crew is idle or :meth:`run` was interrupted (Ctrl-C) in the middle of a call.
        """
        self._stopping = True
        self._start.abort()
        self._done.abort()
        for worker in self._workers:
            worker.join(BARRIER_TIMEOUT)


def _reset(variable: Any) -> None:
    variable.assign(0.0, read_value=False)


def _value(variable: Any) -> float:
    return float(variable.read_value().numpy())


def _variant(
    threads: int,
    iterations: int,
    step: Callable[[], Any],
    reset: Callable[[], Any],
    value: Callable[[], float],
    crews: list[Crew],
) -> Callable[[], dict[str, int]]:
    crew = Crew(threads, iterations, step)
    crews.append(crew)
    expected = threads * iterations

    def call() -> dict[str, int]:
        reset()
        crew.run()
        return {"lost_updates": expected - int(round(value())), "updates": expected}

    return call


def cases(ctx: Context) -> list[Case]:
    iterations = ITERATIONS[ctx.quick]
    out = []
    for threads in ctx.threads:
        with tf.device(ctx.device):
            plain = tf.Variable(0.0, name="racy")
            safe = safevars.SafeVariable(0.0, name="safe_update")
            safe_locked = safevars.SafeVariable(0.0, name="safe_locked")
            locked = tf.Variable(0.0, name="hand_locked")
            one = tf.constant(1.0)
        lock = threading.Lock()

        def racy(v: tf.Variable = plain) -> None:
            v.assign(v.read_value() + one, read_value=False)

        def update(v: safevars.SafeVariable = safe) -> None:
            v.update(lambda x: x + one)

        def with_locked(v: safevars.SafeVariable = safe_locked) -> None:
            with safevars.locked(v):
                v.assign(v.read_value() + one, read_value=False)

        def with_lock(v: tf.Variable = locked, lock: threading.Lock = lock) -> None:
            with lock:
                v.assign(v.read_value() + one, read_value=False)

        crews: list[Crew] = []
        variants = {}
        for name, step, variable in (
            ("tf.Variable (racy)", racy, plain),
            ("SafeVariable.update", update, safe),
            ("safevars.locked", with_locked, safe_locked),
            ("threading.Lock", with_lock, locked),
        ):
            variants[name] = _variant(
                threads,
                iterations,
                step,
                reset=functools.partial(_reset, variable),
                value=functools.partial(_value, variable),
                crews=crews,
            )

        def teardown(crews: list[Crew] = crews) -> None:
            for crew in crews:
                crew.close()

        out.append(
            Case(
                family=FAMILY,
                name=f"read-modify-write/{threads} thread{'' if threads == 1 else 's'}",
                variants=variants,
                ops_per_call=threads * iterations,
                params={"threads": threads, "iterations": iterations},
                teardown=teardown,
            )
        )
    return out
