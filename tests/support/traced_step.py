"""One traced training step (forward, backward, ``apply_gradients``), for structural and
behavioural tests of what a SafeOptimizer step does in a ``tf.function``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf


def traced_step(
    model: Any,
    opt: Any,
    skip: int | None = None,
    before: Callable[[tf.Tensor], tf.Tensor] | None = None,
) -> Any:
    """A ``tf.function`` step of ``model`` (4 inputs) on a batch of 5 ones, loss the sum of
    its outputs. ``skip``: that variable gets no gradient; ``before(x)`` is traced first,
    into the input."""
    x = tf.ones([5, 4])

    @tf.function(autograph=False)
    def step() -> None:
        inputs = before(x) if before is not None else x
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(inputs))
        grads = tape.gradient(loss, model.trainable_variables)
        if skip is not None:
            grads[skip] = None
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step
