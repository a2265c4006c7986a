"""Threads training one model in the scope with each ``lock_span``: no update is lost.

With ``lock_span="update"`` (Hogwild-style) the forward and backward passes of several
threads overlap and only the update is locked. What must hold: every step's update is
whole and counted. The model's loss is linear in its weights, so every step's gradient
is the same whatever weights it read, and SGD with momentum 1 reads its momentum, adds
the same amount to it and writes it back in every step (in float32, exactly): after
``threads x calls`` steps the momentum and the weights are exactly where that many steps
take them, ``iterations`` counts every step and so does every weight's version. An update
whose read of the momentum is not inside its section (the section's gate removed) loses
steps when two threads read the same momentum.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from tests.support.threading_harness import run_threads

THREADS, CALLS = 4, 25
SIZE = 1 << 20  # elements: reading, updating and writing the momentum takes a while
LEARNING_RATE = 0.5  # times a gradient of 1: the momentum moves by exactly 0.5 a step


def _trainer(lock_span: str):
    """A linear model, SGD and a traced step whose gradient is 1 for every weight."""
    with safevars.scope():
        weights = keras.Variable(tf.zeros([SIZE]))
        sgd = keras.optimizers.SGD(LEARNING_RATE, momentum=1.0)
        sgd = safevars.SafeOptimizer(sgd, lock_span=lock_span)
    sgd.build([weights])
    wide = tf.Variable(tf.ones([160, 160]))  # work between the read and the update

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            delay = tf.reduce_sum(tf.matmul(tf.matmul(wide, wide), wide)) * 0.0
            loss = tf.reduce_sum(weights.value) + delay
        sgd.apply_gradients([(tape.gradient(loss, weights), weights)])

    step.get_concrete_function()  # traced once, before the threads
    return weights, sgd, step


@pytest.mark.parametrize("lock_span", ["update", "step"])
def test_no_update_is_lost_whatever_the_lock_span(lock_span):
    weights, sgd, step = _trainer(lock_span)
    run_threads(THREADS, lambda _: [step() for _ in range(CALLS)])
    steps = THREADS * CALLS
    # Momentum 1: after step t the momentum is -0.5 t and the weights -0.25 t (t + 1).
    want = -LEARNING_RATE * steps * (steps + 1) / 2
    np.testing.assert_array_equal(weights.numpy(), np.full([SIZE], want, np.float32))
    assert int(sgd.iterations.numpy()) == steps
    assert safevars.wrap(weights).version == steps
