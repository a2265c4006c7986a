"""Fixtures of the SafeOptimizer tests."""

from __future__ import annotations

import itertools

import pytest
import tensorflow as tf

_COLLECTIVE_KEY_BASES = itertools.count(1)


@pytest.fixture(autouse=True)
def _unique_collective_keys(monkeypatch):
    """Gives each test's MirroredStrategy its own collective group keys.

    Every MirroredStrategy built in one process numbers its collective groups from 1, and
    TensorFlow caches a collective's shape by (group, instance) key, so a second strategy
    whose first all-reduce has another shape fails ("Shape mismatch in the collective
    instance 100"). ``_collective_key_base`` is TensorFlow's knob for tests.
    """
    base = 1_000_000 + 100_000 * next(_COLLECTIVE_KEY_BASES)
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", base)
