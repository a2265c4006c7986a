"""SafeOptimizer's traced step: what runs inside the mutex, and the gate that opens it.

The step's ops wait for one gate op after the ``MutexLock`` (not for the ``MutexLock``
itself, whose async completion would hand every op it makes ready to a thread pool of its
own); a section the lock makes few ops ready in waits for the ``MutexLock`` directly
(:mod:`safevars.sections.gate`). These tests pin what the cost work must keep: every write
of a traced step runs after the lock is taken and before it is released, the lock opens
through the gate, and concurrent traced steps stay exact.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeOptimizer, SafeVariable
from safevars.locking import share_lock
from safevars.sections import gate as section_gate
from tests.support.graph_walk import ancestors
from tests.support.threading_harness import run_threads
from tests.support.traced_step import traced_step

_WRITES = {"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}


def _lock_consumers(lock):
    return {c for out in lock.outputs for c in out.consumers()} | set(lock._control_outputs)


def _traced_step():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    opt = SafeOptimizer(keras.optimizers.Adam(1e-3))
    opt.build(model.trainable_variables)
    step = traced_step(model, opt)
    return step.get_concrete_function().graph, model, opt


def test_every_write_of_a_traced_step_runs_between_the_lock_and_its_release():
    graph, model, _ = _traced_step()
    ops = graph.get_operations()
    (lock,) = [op for op in ops if op.type == "MutexLock"]  # one lock for the whole step
    (release,) = [op for op in ops if op.type == "ConsumeMutexLock"]
    writes = [op for op in ops if op.type in _WRITES]
    # Adam: 2 slots and the variable per model variable, and iterations; one joint add
    # for the versions of every model variable; the counters and their own version.
    variables = len(model.trainable_variables)
    assert len(writes) == 3 * variables + 1 + 1 + 2
    before_release = ancestors(release)
    for write in writes:
        assert lock in ancestors(write), write.name
        assert write in before_release, write.name


def test_the_step_waits_for_one_gate_not_for_the_mutex_lock():
    graph, _, _ = _traced_step()
    ops = graph.get_operations()
    (lock,) = [op for op in ops if op.type == "MutexLock"]
    consumers = _lock_consumers(lock)
    gates = [op for op in consumers if op.type != "ConsumeMutexLock"]
    assert [op.type for op in gates] == ["VarIsInitializedOp"]
    (gate,) = gates
    assert gate.control_inputs == [lock]
    # Nothing else of the section is made ready by the MutexLock's (async) completion.
    assert {op.type for op in consumers} == {"VarIsInitializedOp", "ConsumeMutexLock"}


def _made_ready_by(lock, graph):
    """The ops the lock's completion makes ready: they wait for it and for no other op of
    its section (everything between the lock and its release)."""
    (release,) = [op for op in graph.get_operations() if op.type == "ConsumeMutexLock"]
    section = {op for op in ancestors(release) if lock in ancestors(op)} | {lock}
    return [
        op
        for op in _lock_consumers(lock) - {release}
        if not any(s in section and s is not lock for s in _sources(op))
    ]


def _sources(op):
    return [t.op for t in op.inputs] + list(op.control_inputs)


def test_joined_writes_wait_for_the_mutex_lock_itself():
    """Lock coarsening: later writes join the first one's section. With one op made ready
    by the lock (the first write: each later one waits for the one before), the section
    has no gate: it would be one more op and one more captured variable per call."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def three_writes():
        for _ in range(3):
            v.assign_add(1.0, read_value=False)

    graph = three_writes.get_concrete_function().graph
    (lock,) = [op for op in graph.get_operations() if op.type == "MutexLock"]
    assert "VarIsInitializedOp" not in {op.type for op in graph.get_operations()}
    writes = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    assert len(writes) == 4  # three writes and their one version count, behind the lock
    assert all(lock in ancestors(write) for write in writes)
    assert [op.type for op in _made_ready_by(lock, graph)] == ["AssignAddVariableOp"]
    three_writes()
    assert float(v.numpy()) == 3.0 and v.version == 3


@pytest.mark.parametrize("count", [section_gate.DIRECT_ROOTS, section_gate.DIRECT_ROOTS + 1])
def test_a_section_opens_through_a_gate_when_the_lock_would_make_many_ops_ready(count):
    """Independent reads in one transaction: each is made ready by the lock alone. Up to
    DIRECT_ROOTS of them wait for the MutexLock, more for one gate op behind it."""
    v = SafeVariable(np.arange(4.0, dtype=np.float32))

    @tf.function(autograph=False)
    def step():
        return safevars.transaction([v], lambda: [v.read_value() for _ in range(count)])

    graph = step.get_concrete_function().graph
    (lock,) = [op for op in graph.get_operations() if op.type == "MutexLock"]
    gates = [op for op in graph.get_operations() if op.type == "VarIsInitializedOp"]
    reads = [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assert len(reads) == count and all(lock in ancestors(op) for op in reads)
    if count <= section_gate.DIRECT_ROOTS:
        assert gates == [] and sorted(_made_ready_by(lock, graph), key=str) == sorted(
            reads, key=str
        )
    else:
        (gate,) = gates
        assert gate.control_inputs == [lock] and _made_ready_by(lock, graph) == [gate]
        assert all(gate in op.control_inputs and lock not in op.control_inputs for op in reads)
    assert [r.numpy().tolist() for r in step()] == [[0.0, 1.0, 2.0, 3.0]] * count


def test_a_join_that_makes_the_section_wide_adds_the_gate_and_writes_stay_whole():
    """Three variables sharing one lock, written one after another: the three sections
    join into one, each write a root of its own (no write of another variable holds it
    back). The third join adds the gate, and every write then waits for it. Readers
    (snapshots) on 2 threads, against 2 writers on a barrier, never see the three
    variables from different calls."""
    a, b, c = SafeVariable(0.0), SafeVariable(0.0), SafeVariable(0.0)
    assert share_lock([a.guard, b.guard, c.guard])

    @tf.function(autograph=False)
    def write_all(x):
        for v in (a, b, c):
            v.assign(x, read_value=False)

    graph = write_all.get_concrete_function(tf.TensorSpec([], tf.float32)).graph
    ops = graph.get_operations()
    (lock,) = [op for op in ops if op.type == "MutexLock"]
    (gate,) = [op for op in ops if op.type == "VarIsInitializedOp"]
    writes = [op for op in ops if op.type == "AssignVariableOp"]
    assert len(writes) == 3 and _made_ready_by(lock, graph) == [gate]
    assert all(gate in op.control_inputs and lock not in op.control_inputs for op in writes)

    calls, torn = 150, []

    def writer(i):
        for k in range(calls):
            write_all(tf.constant(float(i * calls + k)))

    def reader(_):
        for _ in range(calls):
            values = [float(s.value) for s in safevars.snapshot([a, b, c])]
            if len(set(values)) != 1:
                torn.append(values)

    run_threads(4, lambda i: (writer if i < 2 else reader)(i))
    assert torn == []
    assert a.version == b.version == c.version == 2 * calls


def test_four_threads_of_a_traced_read_then_write_and_step_stay_exact():
    """A section body that reads then writes (a lost update if two ran at once) and an
    optimizer step in the same traced function, from 4 threads on a barrier."""
    v = SafeVariable(np.zeros([3], np.float32))
    opt = SafeOptimizer(keras.optimizers.SGD(1.0))
    opt.build([v])
    calls = 40
    wide = tf.ones([128, 128])

    @tf.function(autograph=False)
    def step():
        opt.apply_gradients([(tf.ones([3]), v)])

        def body():
            x = v.read_value()
            # Work between the read and the write widens the window of a lost update.
            delay = tf.reduce_sum(tf.matmul(wide * x[0], wide)) * 0.0
            v.assign(x + 3.0 + delay)

        safevars.transaction([v], body)

    run_threads(4, lambda index: [step() for _ in range(calls)])
    total = 4 * calls
    np.testing.assert_array_equal(v.numpy(), np.full([3], 2.0 * total, np.float32))
    assert int(opt.iterations.numpy()) == total
    assert v.version == 2 * total  # one per applied step, one per transaction write
    assert opt.statistics().applied == total
