"""Which ops of a section its lock orders: the stateful ones, so Grappler sees the rest
as it would without safevars.

A section's body is traced under a control dependency on its gate (its ``MutexLock`` or
a gate op behind it), and its release waits for the body. What must hold: every read
and write of the body runs after the lock is taken and before it is released, also a
write of a constant (whose only path to the lock was the constant's edge); no stateless
op keeps an edge to the gate or to the release (a ``Const`` with a control input, or an
``Add`` driving a control dependency, is left alone by Grappler's arithmetic optimizer:
the model then computed other bits, ``tests/conformance/test_bitwise_models.py``); and a
custom step whose forward pass writes (BatchNormalization's moving statistics, joined
into one section) still runs (it was a cycle).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeOptimizer
from tests.support.graph_walk import ancestors

_SECTION = ("MutexLock", "ConsumeMutexLock")


def _one(graph, kind):
    (op,) = [op for op in graph.get_operations() if op.type == kind]
    return op


def _body_ops(graph):
    """The ops between the section's lock and its release (the lock's descendants)."""
    lock = _one(graph, "MutexLock")
    release = _one(graph, "ConsumeMutexLock")
    return lock, release, [op for op in graph.get_operations() if lock in ancestors(op)]


def _step_in_one_section():
    """A function whose whole body is one section (as a ``fit`` step in the scope is):
    constants, arithmetic on the input, reads and writes."""
    with safevars.scope():  # one lock for both
        a, b = tf.Variable(tf.ones([3])), tf.Variable(tf.zeros([3]))

    @tf.function(autograph=False)
    def step(x):
        def body():
            scaled = x * 2.0 + 1.0  # stateless, on the input only
            a.assign(tf.ones([3]) * 4.0, read_value=False)  # a constant's write
            b.assign(scaled + a.read_value(), read_value=False)
            return tf.reduce_sum(scaled)

        return safevars.transaction([a, b], body)

    return a, b, step.get_concrete_function(tf.TensorSpec([3], tf.float32)).graph, step


def test_every_read_and_write_runs_between_the_lock_and_its_release():
    a, b, graph, step = _step_in_one_section()
    lock, release, _ = _body_ops(graph)
    waited_for = ancestors(release)
    state = [op for op in graph.get_operations() if op._is_stateful and op.type not in _SECTION]
    touching = [op for op in state if op.type in ("ReadVariableOp", "AssignVariableOp")]
    assert len(touching) >= 3
    for op in state:
        assert lock in ancestors(op), op.name
        assert op in waited_for, op.name
    step(tf.constant([1.0, 2.0, 3.0]))
    np.testing.assert_array_equal(b.numpy(), [7.0, 9.0, 11.0])


def test_a_write_of_a_constant_waits_for_the_lock_itself():
    _, _, graph, _ = _step_in_one_section()
    lock = _one(graph, "MutexLock")
    (write,) = [
        op
        for op in graph.get_operations()
        if op.type == "AssignVariableOp"
        and "Mul" in [t.op.type for t in op.inputs]
        and not [s for s in ancestors(op) if s.type == "ReadVariableOp"]
    ]
    assert lock in ancestors(write)


def test_no_stateless_op_keeps_an_edge_to_the_gate_or_the_release():
    _, _, graph, _ = _step_in_one_section()
    lock, release, _ = _body_ops(graph)
    gates = {lock} | {op for op in graph.get_operations() if op.type == "VarIsInitializedOp"}
    for op in graph.get_operations():
        if not op._is_stateful and op.type != "NoOp":  # (the function's own ending NoOp)
            assert not gates & set(op.control_inputs), op.name
    assert all(op._is_stateful for op in release.control_inputs), [
        op.name for op in release.control_inputs if not op._is_stateful
    ]
    # The body's constants and its arithmetic on the input wait for nothing.
    body = [graph.get_operation_by_name(name) for name in ("mul/y", "add/y", "ones", "mul", "add")]
    assert all(not op.control_inputs for op in body)


@pytest.mark.parametrize("optimizer", ["adam", "safe"])
def test_a_custom_step_whose_forward_pass_writes_runs(optimizer):
    """BatchNormalization writes its moving statistics in the forward pass: those writes
    join one section, released after the last of them, which the step's section waits
    for; the reads that feed them stay outside the step's section (gating them was a
    cycle), the reads after the last one are inside."""
    with safevars.scope():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((4,))]
        for _ in range(3):
            layers += [keras.layers.Dense(4), keras.layers.BatchNormalization()]
        model = keras.Sequential([*layers, keras.layers.Dense(1)])
        opt = keras.optimizers.Adam(1e-2)
        if optimizer == "safe":
            opt = SafeOptimizer(opt)
    opt.build(model.trainable_variables)
    x = tf.random.stateless_normal([8, 4], seed=[1, 2])

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    graph = step.get_concrete_function().graph
    locks = [op for op in graph.get_operations() if op.type == "MutexLock"]
    step_lock = locks[-1]  # the optimizer's section, traced last
    last_kernel = model.layers[-1].kernel
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    forward = [op for op in reads if not op.name.startswith(opt.name)]
    gated = [op for op in forward if step_lock in ancestors(op)]
    # The first layer's reads (traced first) feed the writes; the last layer's do not.
    assert forward[0] not in gated
    assert forward[-1] in gated
    for _ in range(3):
        step()
    assert int(opt.iterations.numpy()) == 3
    assert safevars.wrap(last_kernel).version == 3
