"""Shared pytest configuration.

* Two logical CPU devices are configured before TensorFlow initializes its devices, so
  ``MirroredStrategy`` runs with two real replicas on any machine.
* ``mode`` runs a behavioural test eagerly and inside ``tf.function``: call
  ``mode(fn)`` to get ``fn`` back either as is or wrapped in a ``tf.function``.
"""

from __future__ import annotations

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


@pytest.fixture
def mirrored_strategy():
    """A MirroredStrategy over the logical CPU devices (at least two replicas)."""
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) >= 2, "conftest must configure two logical CPUs first"
    return tf.distribute.MirroredStrategy(devices[:NUM_LOGICAL_CPUS])
