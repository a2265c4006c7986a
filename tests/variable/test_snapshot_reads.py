"""How an eager snapshot reads (safevars/variable/snapshots.py, issue 44): every value and
version with one op where it can, one differentiable read per variable under a tape.

Consistency under writers (optimistic reads validated by the sequence number, locked
reads otherwise) is tested in tests/test_snapshot.py; these tests pin the structure of
the read, which is what made ``snapshot(model)`` of a small model cost 5.6x reading its
weights: 9 read ops for a 4-weight model, besides its lock's ``MutexLock``.
"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable, _tf_internal


@pytest.fixture
def read_ops(monkeypatch):
    """The number of variables each ``_ReadVariablesOp`` read, and each single read."""
    seen: dict[str, list[int]] = {"together": [], "single": []}
    together, single = _tf_internal.read_variables, _tf_internal.read_eagerly

    def read_variables(handles, dtypes):
        seen["together"].append(len(handles))
        return together(handles, dtypes)

    def read_eagerly(*args):
        seen["single"].append(1)
        return single(*args)

    monkeypatch.setattr(_tf_internal, "read_variables", read_variables)
    monkeypatch.setattr(_tf_internal, "read_eagerly", read_eagerly)
    return seen


def _trained_scope_model() -> keras.Model:
    """A 4-weight model built in safevars.scope(), trained by a traced SafeOptimizer step
    (its lock in run-time mode, its weights counted by one joint counter)."""
    with safevars.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
        optimizer = safevars.SafeOptimizer(keras.optimizers.SGD(0.1))
    x, y = tf.ones((4, 3)), tf.zeros((4, 1))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    step()
    step()
    return model


def test_plain_variables_are_read_with_one_op(read_ops):
    variables = [SafeVariable(float(i)) for i in range(5)]
    snaps = safevars.snapshot(variables)
    assert read_ops == {"together": [5], "single": []}
    assert [float(s.value) for s in snaps] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [s.version for s in snaps] == [0] * 5


def test_a_scope_model_is_read_with_its_versions_in_one_op(read_ops):
    model = _trained_scope_model()
    weights = [w._value for w in model.weights]
    guards = [w._self_guard for w in weights]
    assert guards[0].lock.mutexed and all(g.joint is guards[0].joint for g in guards)
    expected = [(w.numpy().tolist(), w.version) for w in weights]
    assert all(version == 2 for _, version in expected)  # two steps, one joint add each
    snaps = safevars.snapshot(model)
    # The 4 values, the 4 version variables and the one joint counter, with one op.
    assert read_ops == {"together": [9], "single": []}
    assert [(s.value.numpy().tolist(), s.version) for s in snaps] == expected


def test_under_a_gradient_tape_each_value_is_read_so_the_tape_differentiates_it(read_ops):
    v = SafeVariable(3.0)
    with tf.GradientTape() as tape:
        (snap,) = safevars.snapshot([v])
        loss = snap.value * 2.0
    assert read_ops == {"together": [], "single": [1]}
    assert float(tape.gradient(loss, v)) == 2.0


def test_a_scope_model_is_snapshotted_without_walking_a_nest(monkeypatch):
    from safevars.variable import snapshots, wrapping

    model = _trained_scope_model()
    assert snapshots.scope_weights(model) == [w._value for w in model.weights]
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert snapshots.scope_weights(plain) is None  # plain weights: wrapped on the fly
    assert snapshots.scope_weights([SafeVariable(1.0)]) is None  # not a layer

    def no_walk(*args, **kwargs):
        raise AssertionError("snapshot(model) of a scope model walked a nest")

    monkeypatch.setattr(wrapping.tf.nest, "map_structure", no_walk)
    assert len(safevars.snapshot(model)) == 4
