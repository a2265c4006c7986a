"""Family "accumulator": gradient accumulation against Keras 3 ``gradient_accumulation_steps``.

One case, ``micro_steps/...``: K = 4 micro-steps of one small MLP (64 inputs,
2 × 128 ``Dense`` ReLU, 10 outputs, 26,122 parameters, batch 32), each micro-step a
``tf.function`` call (forward, backward, accumulate), the K-th one also applying the
mean gradient with SGD. Every variant starts from the same weights and data; the time
is per micro-step (``ops_per_call=K``).

* ``keras gradient_accumulation_steps`` (baseline): ``keras.optimizers.SGD(...,
  gradient_accumulation_steps=4)`` and ``optimizer.apply(grads)`` every micro-step (its
  accumulators are plain variables, updated with a separate read and assign).
* ``GradientAccumulator``: ``acc.add(grads)`` every micro-step and ``acc.take()`` then
  ``SGD.apply`` at the K-th, with ``deterministic=True`` (order-independent result;
  goal: at most 1.10× the baseline per micro-step).
* ``GradientAccumulator(deterministic=False)``: the same with a float32 running sum.

Where the extra time of ``deterministic=True`` goes: each ``add`` copies the gradients
into a buffer row (as cheap as the running sum's ``assign_add``); each ``take`` copies
the K pending rows out under the lock and runs the XLA-compiled reproducible summation
over them (a few passes over K × 26 K float64 values, plus the XLA launch). Both
accumulator variants also pay for flattening the gradients and one
``tf.CriticalSection`` per call.

``params`` records the memory cost of ``deterministic=True``: bytes of accumulation state
for each variant; the deterministic buffer holds one float32 row per pending
contribution (here K = 4 rows, 16 bytes per gradient element, against 4 for the float32
running sum and for Keras' accumulators).
"""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from benchmarks.case import Case, Context
from safevars.accumulator import GradientAccumulator

FAMILY = "accumulator"
DESCRIPTION = "gradient accumulation micro-steps: GradientAccumulator vs Keras accumulation"
ORDER = 6

FEATURES = 64
WIDTH = 128
CLASSES = 10
BATCH = 32
MICRO_STEPS = 4
GOAL = 1.10


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((FEATURES,)),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(WIDTH, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])


def _batches() -> list[tuple[tf.Tensor, tf.Tensor]]:
    rng = np.random.default_rng(0)
    return [
        (
            tf.constant(rng.normal(size=(BATCH, FEATURES)).astype("float32")),
            tf.constant(rng.integers(0, CLASSES, size=(BATCH,)).astype("int32")),
        )
        for _ in range(MICRO_STEPS)
    ]


def _gradients(model: keras.Model, x: tf.Tensor, y: tf.Tensor) -> list[tf.Tensor]:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return tape.gradient(loss, model.trainable_variables)


def _keras_variant(batches: list) -> Callable[[], None]:
    model = _model()
    optimizer = keras.optimizers.SGD(0.01, gradient_accumulation_steps=MICRO_STEPS)
    optimizer.build(model.trainable_variables)

    @tf.function(autograph=False)
    def micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        optimizer.apply(_gradients(model, x, y), model.trainable_variables)
        return optimizer.iterations

    def call() -> None:
        for x, y in batches:
            done = micro_step(x, y)
        done.numpy()

    return call


def _accumulator_variant(batches: list, deterministic: bool) -> tuple[Callable, int]:
    model = _model()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    acc = GradientAccumulator(model.trainable_variables, deterministic=deterministic)

    @tf.function(autograph=False)
    def micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return acc.add(_gradients(model, x, y))

    @tf.function(autograph=False)
    def last_micro_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
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


def cases(ctx: Context) -> list[Case]:
    with tf.device(ctx.device):
        batches = _batches()
        keras_call = _keras_variant(batches)
        exact_call, exact_bytes = _accumulator_variant(batches, deterministic=True)
        float_call, float_bytes = _accumulator_variant(batches, deterministic=False)
    parameters = sum(int(np.prod(v.shape)) for v in _model().trainable_variables)
    return [
        Case(
            family=FAMILY,
            name=f"micro_steps/mlp2x{WIDTH}/b{BATCH}/k{MICRO_STEPS}",
            variants={
                "keras gradient_accumulation_steps": keras_call,
                "GradientAccumulator": exact_call,
                "GradientAccumulator(deterministic=False)": float_call,
            },
            ops_per_call=MICRO_STEPS,
            params={
                "parameters": parameters,
                "batch": BATCH,
                "micro_steps": MICRO_STEPS,
                "state_bytes_keras": parameters * 4,
                "state_bytes_deterministic": exact_bytes,
                "state_bytes_float": float_bytes,
                "bytes_per_element_deterministic": exact_bytes // parameters,
                "bytes_per_element_float": float_bytes // parameters,
            },
            goal=("GradientAccumulator", GOAL),
        )
    ]
