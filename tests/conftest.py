"""Shared pytest configuration.

* Two logical CPU devices are configured before TensorFlow initializes its devices, so
  ``MirroredStrategy`` runs with two real replicas on any machine.
* ``mode`` runs a behavioural test eagerly and inside ``tf.function``: call
  ``mode(fn)`` to get ``fn`` back either as is or wrapped in a ``tf.function``.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 2

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )
except RuntimeError:  # Devices already initialized by an earlier import.
    pass


@pytest.fixture(params=["eager", "tf_function"])
def mode(request):
    """Returns a wrapper: identity eagerly, ``tf.function`` otherwise."""

    def run(fn):
        if request.param == "eager":
            return fn
        return tf.function(fn, autograph=False)

    run.name = request.param
    return run


_COLLECTIVE_KEY_BASES = itertools.count(1)


@pytest.fixture
def mirrored_strategy(monkeypatch):
    """A MirroredStrategy over the logical CPU devices (at least two replicas).

    Every strategy built in one process numbers its collective groups from the same base,
    and TensorFlow caches a collective's shape per key; a fresh base per test (the knob
    TensorFlow's own tests use) keeps one test's collectives from clashing with another's.
    """
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) >= 2, "conftest must configure two logical CPUs first"
    monkeypatch.setattr(
        tf.distribute.MirroredStrategy, "_collective_key_base",
        1_000_000 * next(_COLLECTIVE_KEY_BASES),
    )
    return tf.distribute.MirroredStrategy(devices[:NUM_LOGICAL_CPUS])
