"""A plain optimizer's eager step in the scope counts its versions inside its section.

The step writes the weights and adds their versions under the model's lock, so a
``safevars.snapshot(model)`` taken while other threads step sees each weight's value
together with its own version, never a value one step ahead of its version (as it would
if the versions were added after the lock is released).
"""

from __future__ import annotations

import threading

import keras
import numpy as np
import tensorflow as tf

import safevars
from safevars.creator_scope import scope
from tests.support.threading_harness import run_threads

STEPPERS, STEPS = 2, 150
MINIMUM_SNAPSHOTS = 300


def test_snapshots_while_two_threads_step_see_each_value_with_its_version():
    """SGD(1.0) with a gradient of ones from weights of zeros: after n steps every element
    of a weight is exactly -n (small integers are exact in float32), so a snapshot at
    version n must hold -n everywhere, in every weight."""
    with scope():
        model = keras.Sequential(
            [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="zeros")]
        )
        optimizer = keras.optimizers.SGD(1.0)
    weights = model.trainable_variables
    optimizer.build(weights)  # Keras' build itself is not thread-safe
    ones = [tf.ones_like(w) for w in weights]
    trainable = len(weights)
    stepping = threading.Event()
    steppers_left = [STEPPERS]
    left_lock = threading.Lock()
    seen: list[tuple[int, list[np.ndarray]]] = []

    def role(i: int) -> None:
        if i < STEPPERS:
            stepping.set()
            try:
                for _ in range(STEPS):
                    optimizer.apply(ones, weights)
            finally:
                with left_lock:
                    steppers_left[0] -= 1
            return
        stepping.wait()
        while steppers_left[0] or len(seen) < MINIMUM_SNAPSHOTS:
            snaps = safevars.snapshot(model)[:trainable]
            versions = {s.version for s in snaps}
            assert len(versions) == 1, f"the weights of one step at different versions: {versions}"
            seen.append((versions.pop(), [s.numpy() for s in snaps]))

    run_threads(STEPPERS + 1, role)

    total = STEPPERS * STEPS
    split = [(v, a) for v, arrays in seen for a in arrays if not np.all(a == -v)]
    assert not split, (
        f"{len(split)} of {len(seen) * trainable} snapshotted weights hold a value that is "
        f"not their version's, e.g. version {split[0][0]} with {split[0][1].ravel()[:3]}"
    )
    assert len({v for v, _ in seen}) > 2  # the snapshots saw the steps go by
    assert [safevars.wrap(w).version for w in weights] == [total] * trainable
    for w in weights:
        np.testing.assert_array_equal(w.numpy(), np.full(w.shape, -float(total), np.float32))
