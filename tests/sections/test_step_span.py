"""Traced steps locked from their start: SafeOptimizer's ``lock_span="step"`` (from the
reads of the weights) and GradientAccumulator's (a traced ``add`` takes its lock early).

What must hold: the forward pass's reads wait for the step's section, so concurrent
traced steps equal some serial order of whole steps; the lock is never taken before an
op that may wait for another thread (a Python function, an iterator, another section),
so such an op that wants the same lock does not deadlock; and ``lock_span="update"``
(``"add"`` for the accumulator) keeps the lock off the forward and backward passes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import GradientAccumulator, InvalidArgumentError, SafeOptimizer
from tests.support.graph_walk import ancestors
from tests.support.threading_harness import call_bounded, run_threads
from tests.support.traced_step import traced_step


def _model(seed: int = 0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])


def _step_graph(lock_span: str, before=None):
    """The graph of a traced step; ``before(x)`` is traced first, into the input."""
    model = _model()
    opt = SafeOptimizer(keras.optimizers.Adam(1e-3), lock_span=lock_span)
    opt.build(model.trainable_variables)
    step = traced_step(model, opt, before=before)
    return step.get_concrete_function().graph, model


def _model_reads(graph):
    """The forward pass's reads of the model's weights (the layers' ops)."""
    return [
        op
        for op in graph.get_operations()
        if op.type == "ReadVariableOp" and op.name.startswith("sequential")
    ]


def _one(graph, kind):
    (op,) = [op for op in graph.get_operations() if op.type == kind]
    return op


def test_the_forward_pass_reads_the_weights_inside_the_section():
    graph, model = _step_graph("step")
    lock = _one(graph, "MutexLock")
    reads = _model_reads(graph)
    assert len(reads) == len(model.trainable_variables)
    for read in reads:
        assert lock in ancestors(read), read.name
    # The lock waits for nothing of the forward pass: it opens the step.
    assert not [op for op in ancestors(lock) if op.type == "ReadVariableOp"]


def test_lock_span_update_takes_the_lock_after_the_gradients():
    graph, _ = _step_graph("update")
    lock = _one(graph, "MutexLock")
    reads = _model_reads(graph)
    for read in reads:
        assert lock not in ancestors(read), read.name
    # The lock waits for the gradients, hence for the forward pass (the last bias's
    # read feeds no gradient).
    assert len(set(reads) & ancestors(lock)) == len(reads) - 1


def test_the_lock_waits_for_a_python_function_traced_before_it():
    def before(x):
        out = tf.py_function(lambda t: t * 1.0, [x], tf.float32)
        out.set_shape(x.shape)
        return out

    graph, _ = _step_graph("step", before)
    lock = _one(graph, "MutexLock")
    py = _one(graph, "EagerPyFunc")
    assert py in ancestors(lock)
    for read in _model_reads(graph):  # traced after the Python function: gated
        assert lock in ancestors(read), read.name


def test_reads_traced_before_an_op_that_may_wait_stay_outside_the_section():
    model = _model()
    opt = SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    x = tf.ones([5, 4])

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            out = model(x)
            # The forward pass feeds a Python function: its reads come before it.
            out = tf.py_function(lambda t: t * 1.0, [out], tf.float32)
            out.set_shape([5, 2])
            loss = tf.reduce_sum(out * out)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    graph = step.get_concrete_function().graph
    lock = _one(graph, "MutexLock")
    for read in _model_reads(graph):
        assert lock not in ancestors(read), read.name  # gating it would make a cycle
    step()  # and the step runs
    assert int(opt.iterations.numpy()) == 1


def test_a_python_function_that_writes_the_model_before_the_step_does_not_deadlock():
    """The Python function wants the step's lock (an eager write of a model variable);
    the section must not be open while it runs, or the step would wait for it forever."""
    model = _model()
    opt = SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    bias = safevars.wrap(model.trainable_variables[1])
    wide = tf.ones([256, 256])

    def nudge(t):
        bias.assign_add(tf.zeros_like(bias))  # eagerly, under the model's lock
        return t

    @tf.function(autograph=False)
    def step():
        # Work before the Python function, so the lock (which waits for nothing else)
        # would be taken first if it did not wait for the Python function.
        slow = tf.reduce_sum(tf.matmul(tf.matmul(wide, wide), wide)) * 0.0
        x = tf.py_function(nudge, [tf.ones([5, 4]) + slow], tf.float32)
        x.set_shape([5, 4])
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for _ in range(5):
        call_bounded(step, timeout=60)
    assert int(opt.iterations.numpy()) == 5
    assert bias.version == 5 + 5  # five steps, five Python-function writes


def _quadratic(lock_span: str):
    """A step whose gradient depends on the weights: applied from stale weights, the
    result differs from every serial order."""
    w = tf.Variable(np.full([64], 1.0, np.float32))
    opt = SafeOptimizer(keras.optimizers.SGD(0.01), lock_span=lock_span)
    opt.build([w])
    # A variable, not a constant: Grappler would fold the products of a constant away.
    wide = tf.Variable(tf.ones([192, 192]))

    @tf.function(autograph=False)
    def step():
        with tf.GradientTape() as tape:
            # Work between the read and the update widens the window for a stale step.
            delay = tf.reduce_sum(tf.matmul(tf.matmul(wide, wide), wide)) * 0.0
            loss = tf.reduce_sum(w * w) + delay * tf.reduce_sum(w)
        opt.apply_gradients([(tape.gradient(loss, w), w)])

    return w, opt, step


def test_four_threads_of_traced_steps_equal_the_serial_steps():
    threads, calls = 4, 15
    serial_w, _, serial_step = _quadratic("step")
    for _ in range(threads * calls):
        serial_step()
    w, opt, step = _quadratic("step")
    run_threads(threads, lambda index: [step() for _ in range(calls)])
    assert int(opt.iterations.numpy()) == threads * calls
    # Every step is w <- w - 0.01 * 2w of the w it read: the same in any order.
    np.testing.assert_array_equal(w.numpy(), serial_w.numpy())


def test_lock_span_is_checked_kept_in_the_config_and_read_only():
    adam = keras.optimizers.Adam(1e-3)
    with pytest.raises(InvalidArgumentError, match="lock_span must be one of 'step', 'update'"):
        SafeOptimizer(adam, lock_span="forward")
    assert type(adam) is keras.optimizers.Adam  # nothing changed
    opt = SafeOptimizer(adam, lock_span="update")
    assert opt.lock_span == "update"
    assert opt.get_config()["safevars"]["lock_span"] == "update"
    again = SafeOptimizer.from_config(opt.get_config())
    assert again.lock_span == "update"
    assert SafeOptimizer(keras.optimizers.SGD()).lock_span == "step"
    with pytest.raises(AttributeError):
        opt.lock_span = "step"


# ---------------------------------------------------------------- GradientAccumulator.add


def _traced_add(lock_span: str, before=None):
    """A traced micro-step (forward, backward, add) of ``_model``'s gradients."""
    model = _model()
    acc = GradientAccumulator(model.trainable_variables, lock_span=lock_span)
    x = tf.ones([5, 4])

    @tf.function(autograph=False)
    def micro_step():
        inputs = before(x, acc) if before is not None else x
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(inputs))
        return acc.add(tape.gradient(loss, model.trainable_variables))

    return micro_step, acc, model


def test_a_traced_add_takes_its_lock_before_the_gradients_are_computed():
    micro_step, _, _ = _traced_add("step")
    graph = micro_step.get_concrete_function().graph
    lock = _one(graph, "MutexLock")
    assert not {op.type for op in ancestors(lock)} & {"MatMul", "ReadVariableOp"}


def test_lock_span_add_takes_the_lock_after_the_gradients():
    micro_step, _, _ = _traced_add("add")
    graph = micro_step.get_concrete_function().graph
    lock = _one(graph, "MutexLock")
    assert "MatMul" in {op.type for op in ancestors(lock)}


def test_a_python_function_that_adds_before_a_traced_add_does_not_deadlock():
    wide = tf.ones([256, 256])

    def before(x, acc):
        def add_eagerly(t):
            acc.add([tf.zeros_like(v) for v in acc_variables])  # under the same lock
            return t

        slow = tf.reduce_sum(tf.matmul(tf.matmul(wide, wide), wide)) * 0.0
        out = tf.py_function(add_eagerly, [x + slow], tf.float32)
        out.set_shape(x.shape)
        return out

    micro_step, acc, model = _traced_add("step", before)
    acc_variables = model.trainable_variables
    for _ in range(4):
        call_bounded(micro_step, timeout=60)
    assert acc.count == 8  # four traced adds, four eager ones


def test_four_threads_of_traced_micro_steps_add_every_contribution_once():
    micro_step, acc, model = _traced_add("step")
    threads, calls = 4, 10
    run_threads(threads, lambda index: [micro_step() for _ in range(calls)])
    assert acc.count == threads * calls
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.ones([5, 4])))
    expected = tape.gradient(loss, model.trainable_variables)
    for got, want in zip(acc.take(), expected):  # the mean of equal contributions
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


def test_the_accumulators_lock_span_is_checked():
    model = _model()
    with pytest.raises(InvalidArgumentError, match="lock_span must be one of 'step', 'add'"):
        GradientAccumulator(model.trainable_variables, lock_span="update")


def test_model_fit_runs_its_steps_with_the_reads_inside_the_section(monkeypatch):
    """Keras' train step is a tf.function nested in its train_function; its reads of the
    weights must be found there too (a silent fall back to "update" would pass every
    other test)."""
    from safevars.sections import step_span

    spans = []
    plan = step_span.plan

    def recording_plan(graph, variables):
        spans.append(plan(graph, variables))
        return spans[-1]

    monkeypatch.setattr(step_span, "plan", recording_plan)
    model = _model()
    model.compile(optimizer=SafeOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
    x, y = np.ones([8, 4], np.float32), np.zeros([8, 2], np.float32)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert spans and all(span is not None for span in spans)
    assert all(len(span.gated) >= len(model.trainable_variables) for span in spans)
    assert int(model.optimizer.iterations.numpy()) == 4
