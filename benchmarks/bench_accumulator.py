"""Family "accumulator": gradient accumulation against Keras 3 ``gradient_accumulation_steps``.

Two cases, ``micro_steps/<model>/b32/k4``: K = 4 micro-steps of an MLP (batch 32), each
micro-step a ``tf.function`` call (forward, backward, accumulate), the K-th one also
applying the mean gradient with SGD. Every variant starts from the same weights and data;
the time is per micro-step (``ops_per_call=K``). The models:

* ``mlp2x128``: 64 inputs, 2 × 128 ``Dense`` ReLU, 10 outputs: 26,122 parameters. The
  accumulator's fixed costs (its lock, the launch of take's compiled reduction) weigh
  most here.
* ``mlp2x1024``: 256 inputs, 2 × 1024, 10 outputs: 1,323,018 parameters. The gradient
  computation grows with the parameters as the accumulator's work does, and its fixed
  costs are shared by 50 times more elements, so the ratio should approach 1.
  ``--quick`` takes ``mlp2x192`` instead (88,330 parameters).

Variants:

* ``keras gradient_accumulation_steps`` (baseline): ``keras.optimizers.SGD(...,
  gradient_accumulation_steps=4)`` and ``optimizer.apply(grads)`` every micro-step (its
  accumulators are plain variables, updated with a separate read and assign).
* ``GradientAccumulator``: ``acc.add(grads)`` at micro-steps 1 to K - 1 and
  ``acc.add_and_take(grads)`` then ``SGD.apply`` at the K-th, with
  ``deterministic=True`` (order-independent result) and ``max_pending=4``: like Keras'
  ``gradient_accumulation_steps=4``, it declares how many contributions accumulate, so
  the storage is made up front, a traced ``add`` has no growth check, and
  ``add_and_take`` reads the K-th contribution where it is: on mlp2x1024 (every pending
  computed, beside the rest of the backward pass; on mlp2x128 (one buffer row per
  contribution) one compiled call reduces it with the stored rows. Goals (issue 35): on
  mlp2x1024 at most 1.10× the baseline per micro-step; on mlp2x128 at most 1.10× the
  ``+ one tf mutex`` reference below, measured in the same run: taking TensorFlow's
  mutex once per micro-step is the floor of any locked accumulator there.
* ``GradientAccumulator(add, take)``: the same accumulator (``max_pending=4``), with
  ``acc.add(grads)`` then ``acc.take()`` at the K-th micro-step: two sections, the
  contribution stored, one reduction after the last gradient.
* ``GradientAccumulator(max_pending=None)``: ``add`` then ``take`` with the default,
  unbounded storage, whose traced ``add`` checks for room and grows it if needed (one
  ``If`` kernel per ``add``).
* ``GradientAccumulator(deterministic=False)``: a float32 running sum, ``add`` then
  ``take``, ``max_pending`` not set.
* ``keras gradient_accumulation_steps + one tf mutex`` (mlp2x128 only; a reference, not
  a safevars variant): the baseline's micro-step with one TensorFlow ``MutexLock`` taken
  at its start and released after its update, as a traced ``add`` takes its lock: the
  least that taking TensorFlow's mutex once per micro-step costs on the small model
  (its kernel hands every acquisition to the mutex's own thread), which Keras'
  accumulation, not thread-safe, does not pay.

Where the extra time of ``deterministic=True`` goes (measured on one core with other
processes running, per K = 4 micro-steps, after the block layout of
:mod:`safevars.accumulator.state`): each ``add`` copies the gradients into the
contribution's block of the buffer, gradients of at least 65,536 elements straight
from the gradient tensor with a scatter of their own (mlp2x1024: about 0.16-0.23 ms
for the 1M-element layer, as much as an ``assign_add`` of it; mlp2x128 has no such
gradient and packs its 26K elements into one row, as before). Since 2026-11-27 a
model with such a gradient keeps its first 4 pending contributions by reference
instead (no copy; profiled on 2 cores before that, the scatters took 1.5 ms per K
micro-steps of mlp2x1024, about 12% of Keras' time, and the variant read 1.44-1.50x
Keras; after it, 1.17-1.18x in one process); each ``take`` runs one
XLA-compiled pass over the K pending blocks, in place (the reproducible summation of
:mod:`safevars.accumulator.reproducible_sum`: about 1.1-1.5 ms for mlp2x1024, 60 µs
for mlp2x128, with the two-level grid; since 2026-11-27 K <= 4 contributions are
summed by sorting them instead, about 0.8 ms per take for mlp2x1024 under the
profiler, as long as a plain compiled sum of the same rows: memory-bound), and cuts the
flat result into the variables' tensors outside it, as views. Since 2026-11-27 (later)
the goal variant's K-th micro-step is one ``add_and_take``: on mlp2x1024 each large
gradient's reduction is its own compiled call, started as soon as that gradient is
computed (beside the rest of the backward pass) and reading the K-th contribution where
it is, and the sorted sum lost its TwoSum error terms (one float64 sum in a fixed order).
Against Keras, three processes of 30 rotated rounds: ``add`` then ``take`` 1.124x,
``add_and_take`` 1.100x; ``add_and_take`` 1.107x, and 1.031x with no reproducible
arithmetic at all (a plain sum: measurement only); with the TwoSum terms 1.081x,
without them 1.048x. The reductions run beside the backward pass, where every operation
competes with it for the two cores. Both accumulator variants also pay for one critical section per call and
mlp2x128's concatenation of its small gradients.

Measured by ablation after round 2 (one core, other processes running, per micro-step;
the growth check of ``add`` is now one ``If`` kernel, ~14 µs less for mlp2x128):
mlp2x128, Keras 268 µs, of which 55 µs its accumulation; ``add`` costs 13 µs more
with ``deterministic=True`` than with the running sum, ``take`` 29 µs more (one XLA
launch and pass per take: ~58 µs for 26K elements, of which ~21 µs the launch alone and
~10 µs the reproducible arithmetic beyond a plain sum). mlp2x1024: ``take``'s pass is
~1.5 ms per take (~375 µs per micro-step), about 0.45 ms of it arithmetic beyond a plain
float64 sum of the same rows; each ``add``'s scatter copies the gradients (~110 µs per
1M elements beyond an assignment that takes over the gradient's buffer, measured with
``AssignVariableOp``). The running sum (``deterministic=False``) concatenates each
contribution, then adds it with ``assign_add``. An XLA-compiled add reading the gradients where
they are was 0.5 ms faster per add on one core, but 26 ms per add (75x slower) with two
cores, so it was reverted.

What one TensorFlow mutex per ``add`` costs (docs/history.md, measured 2026-11-26):
Keras' own micro-step of mlp2x128 with only a ``MutexLock`` / ``ConsumeMutexLock`` pair
added around its update read 1.18x: ``MutexLock`` hands every acquisition to the mutex's
own thread, and the update waited for that after the last gradient. A traced ``add``
now takes its lock at the start of the micro-step (``lock_span="step"``,
:func:`safevars.sections.step_span.opening`), so the acquisition overlaps the forward and backward
passes: in one process the deterministic variant read 1.146x with it and 1.281x with
``lock_span="add"`` (the old behaviour) on mlp2x128.

``params`` records the memory cost of ``deterministic=True``: bytes of accumulation state
for each variant; the deterministic buffer holds one float32 block per pending
contribution (here K = 4 blocks, 16 bytes per gradient element, plus under 4 KiB of
padding per block for mlp2x1024, against 4 bytes per element for the float32 running
sum and for Keras' accumulators).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from benchmarks.case import Case, Context, LazyCase
from benchmarks.tf_functions import variant_function
from safevars import _tf_internal as tfi
from safevars.accumulator import GradientAccumulator

FAMILY = "accumulator"
DESCRIPTION = "gradient accumulation micro-steps: GradientAccumulator vs Keras accumulation"
ORDER = 6
SECONDS = {"full": 15, "quick": 6}  # on a quiet 2-core CPU, estimated: see the guide

CLASSES = 10
BATCH = 32
MICRO_STEPS = 4
GOAL = 1.10
MUTEX_REFERENCE = "keras gradient_accumulation_steps + one tf mutex"


@dataclasses.dataclass(frozen=True)
class Model:
    """An MLP: ``features`` inputs, two ReLU layers of ``width``, ``CLASSES`` outputs."""

    features: int
    width: int
    goal: float | None = None
    mutex_reference: bool = False

    @property
    def name(self) -> str:
        return f"mlp2x{self.width}"

    @property
    def case_name(self) -> str:
        return f"micro_steps/{self.name}/b{BATCH}/k{MICRO_STEPS}"

    @property
    def parameters(self) -> int:
        w = self.width
        return (self.features + 1) * w + (w + 1) * w + (w + 1) * CLASSES


SMALL = Model(features=64, width=128, goal=GOAL, mutex_reference=True)
LARGE = Model(features=256, width=1024, goal=GOAL)
MODELS = (SMALL, LARGE)
# --quick, a smoke test: the large model at 192 wide, its gradients under 65,536 elements
# (the size from which each is reduced in a compiled call of its own, which the full run
# and the accumulator's tests cover): its five accumulators' traces and compilations
# were a fifth of the quick run.
QUICK_MODELS = (SMALL, Model(features=256, width=192, goal=GOAL))


def models(ctx: Context) -> tuple[Model, ...]:
    """The models of the run: :data:`MODELS`, or :data:`QUICK_MODELS` with ``--quick``."""
    return QUICK_MODELS if ctx.quick else MODELS


def _model(spec: Model) -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((spec.features,)),
            keras.layers.Dense(spec.width, activation="relu"),
            keras.layers.Dense(spec.width, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


def _batches(spec: Model) -> list[tuple[tf.Tensor, tf.Tensor]]:
    rng = np.random.default_rng(0)
    return [
        (
            tf.constant(rng.normal(size=(BATCH, spec.features)).astype("float32")),
            tf.constant(rng.integers(0, CLASSES, size=(BATCH,)).astype("int32")),
        )
        for _ in range(MICRO_STEPS)
    ]


def _gradients(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _keras_variant(spec: Model, batches: list) -> Callable[[], None]:
    model = _model(spec)
    optimizer = keras.optimizers.SGD(0.01, gradient_accumulation_steps=MICRO_STEPS)
    optimizer.build(model.trainable_variables)

    @variant_function(autograph=False)
    def micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        optimizer.apply(_gradients(model, x, y), model.trainable_variables)
        return optimizer.iterations

    def call() -> None:
        for x, y in batches:
            done = micro_step(x, y)
        done.numpy()

    return call


def _keras_mutex_variant(spec: Model, batches: list) -> Callable[[], None]:
    """The baseline with one TensorFlow mutex per micro-step, placed as a traced ``add``
    places its own (``lock_span="step"``): ``MutexLock`` at the start of the step, the
    update waiting for it, ``ConsumeMutexLock`` after the update. Nothing else changes:
    what any accumulator that takes TensorFlow's mutex once per micro-step pays at least.
    """
    model = _model(spec)
    optimizer = keras.optimizers.SGD(0.01, gradient_accumulation_steps=MICRO_STEPS)
    optimizer.build(model.trainable_variables)
    mutex = tf.CriticalSection(shared_name=f"bench_keras_mutex_{spec.name}")

    @variant_function(autograph=False)
    def micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        lock = tfi.mutex_lock(mutex._handle)
        grads = _gradients(model, x, y)
        with tf.control_dependencies([lock]):
            grads = [tf.identity(g) for g in grads]
        optimizer.apply(grads, model.trainable_variables)
        with tf.control_dependencies([tf.identity(optimizer.iterations)]):
            released = tfi.consume_mutex_lock(lock)
        with tf.control_dependencies([released]):
            return tf.identity(optimizer.iterations)

    def call() -> None:
        for x, y in batches:
            done = micro_step(x, y)
        done.numpy()

    return call


def _accumulator_variant(
    spec: Model,
    batches: list,
    deterministic: bool,
    max_pending: int | None = None,
    fused: bool = False,
) -> tuple[Callable[[], None], int]:
    model = _model(spec)
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    acc = GradientAccumulator(
        model.trainable_variables, deterministic=deterministic, max_pending=max_pending
    )

    @variant_function(autograph=False)
    def micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return acc.add(_gradients(model, x, y))

    @variant_function(autograph=False)
    def last_micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        if fused:
            grads = acc.add_and_take(_gradients(model, x, y))
        else:
            added = acc.add(_gradients(model, x, y))
            with tf.control_dependencies([added]):
                grads = acc.take()
        optimizer.apply(grads, model.trainable_variables)
        return optimizer.iterations

    def call() -> None:
        for x, y in batches[:-1]:
            micro_step(x, y)
        last_micro_step(*batches[-1]).numpy()

    return call, acc.state_bytes


def _case(ctx: Context, spec: Model) -> Case:
    with tf.device(ctx.device):
        batches = _batches(spec)
        keras_call = _keras_variant(spec, batches)
        mutex_call = _keras_mutex_variant(spec, batches) if spec.mutex_reference else None
        exact_call, exact_bytes = _accumulator_variant(
            spec, batches, deterministic=True, max_pending=MICRO_STEPS, fused=True
        )
        separate_call, _ = _accumulator_variant(
            spec, batches, deterministic=True, max_pending=MICRO_STEPS
        )
        growing_call, _ = _accumulator_variant(spec, batches, deterministic=True)
        float_call, float_bytes = _accumulator_variant(spec, batches, deterministic=False)
    parameters = spec.parameters
    variants = {
        "keras gradient_accumulation_steps": keras_call,
        "GradientAccumulator": exact_call,
        "GradientAccumulator(add, take)": separate_call,
        "GradientAccumulator(max_pending=None)": growing_call,
        "GradientAccumulator(deterministic=False)": float_call,
    }
    if mutex_call is not None:
        variants[MUTEX_REFERENCE] = mutex_call
    return Case(
        family=FAMILY,
        name=spec.case_name,
        variants=variants,
        ops_per_call=MICRO_STEPS,
        params={
            "parameters": parameters,
            "batch": BATCH,
            "micro_steps": MICRO_STEPS,
            "state_bytes_keras": parameters * 4,
            "state_bytes_deterministic": exact_bytes,
            "state_bytes_float": float_bytes,
            "bytes_per_element_deterministic": round(exact_bytes / parameters, 3),
            "bytes_per_element_float": float_bytes // parameters,
        },
        goal=None if spec.goal is None else ("GradientAccumulator", spec.goal),
        goal_reference=MUTEX_REFERENCE if spec.mutex_reference else None,
    )


def cases(ctx: Context) -> list[LazyCase]:
    return [
        LazyCase(FAMILY, spec.case_name, functools.partial(_case, ctx, spec))
        for spec in models(ctx)
    ]
