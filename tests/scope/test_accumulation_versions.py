"""Versions under Keras' ``gradient_accumulation_steps``: one per applied update.

With ``gradient_accumulation_steps=k`` Keras adds each call's gradients to its
accumulators and changes the weights on every k-th call only. A version counts a change
of a weight's value, so the weights (and their optimizer slots, the accumulators
included) gain one version per applied update and none on the calls that only
accumulate: the same whether the step runs eagerly (``optimizer.apply``), traced in a
``tf.function``, through ``train_on_batch`` or through ``fit``, with a plain optimizer in
:func:`safevars.scope` or with a :class:`~safevars.SafeOptimizer`.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.creator_scope import scope

EVERY = 2
CALLS = 5  # two applied updates (calls 2 and 4), three calls that only accumulate
X = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
Y = np.array([[1.0], [-1.0], [0.5], [2.0]], np.float32)


def make_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed=3)),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=4)),
        ]
    )


def version(variable) -> int:
    return safevars.wrap(variable).version


def train(model, optimizer, how: str, after_call) -> None:
    """``CALLS`` calls of one step, ``after_call()`` after each."""
    if how in ("apply", "traced"):

        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(X) - Y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        call = tf.function(step) if how == "traced" else step
    else:
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        if how == "train_on_batch":

            def call():
                model.train_on_batch(X, Y)

        else:

            def call():
                model.fit(X, Y, batch_size=len(X), epochs=1, shuffle=False, verbose=0)

    for _ in range(CALLS):
        call()
        after_call()


@pytest.mark.parametrize("kind", ["plain", "safe"])
@pytest.mark.parametrize("how", ["apply", "traced", "train_on_batch", "fit"])
def test_a_version_counts_an_applied_update_not_a_call(how, kind):
    with scope():
        model = make_model()
        sgd = keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=EVERY)
    optimizer = safevars.SafeOptimizer(sgd) if kind == "safe" else sgd
    weights = model.trainable_variables
    history: list[tuple[list[int], list[np.ndarray]]] = []

    def record():
        history.append(([version(w) for w in weights], [w.numpy().copy() for w in weights]))

    record()
    train(model, optimizer, how, record)

    assert int(sgd._iterations.numpy()) == CALLS
    applied = CALLS // EVERY
    assert int(sgd.iterations.numpy()) == applied  # Keras' own count of updates
    assert [version(w) for w in weights] == [applied] * len(weights)
    # Exactly the calls that changed a weight's value added a version to it.
    for (before_versions, before), (after_versions, after) in zip(history, history[1:]):
        for v0, a, v1, b in zip(before_versions, before, after_versions, after):
            assert v1 - v0 == int(not np.array_equal(a, b))
    # The optimizer's slots of those weights (momentum, accumulators) count the same.
    slots = [v for v in sgd.variables if "momentum" in v.name or "accumulator" in v.name]
    assert len(slots) == 2 * len(weights)
    assert {version(s) for s in slots} == {applied}


def test_every_way_of_stepping_leaves_the_same_values():
    """The versions agree, and so do the values: bitwise those of plain Keras."""

    def run(how: str, safe: bool) -> list[np.ndarray]:
        if safe:
            with scope():
                model = make_model()
        else:
            model = make_model()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.5, gradient_accumulation_steps=EVERY)
        train(model, optimizer, how, lambda: None)
        return [w.numpy() for w in model.trainable_variables]

    for how in ("apply", "traced", "train_on_batch"):
        for got, want in zip(run(how, safe=True), run(how, safe=False)):
            np.testing.assert_array_equal(got, want)
