"""Rollback of a failed eager transaction restores value AND version, in every lock mode.

A variable already written inside a ``tf.function`` (run-time mode) keeps its version
where graphs read it too; a rollback must restore it there, or graphs, snapshots and
``compare_and_assign`` see a version one too high. Versions are therefore read both
eagerly and inside a ``tf.function`` after each rollback. Only the public API is used.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.graphs import kept_with
from tests.support.threading_harness import run_threads


class Abort(Exception):
    """The failure the transactions below raise on purpose."""


def _runtime_variable(value: float) -> tuple[SafeVariable, tf.types.experimental.Function]:
    """A variable at ``value + 1``, version 1, written once inside a ``tf.function``.

    Returns it with a ``tf.function`` reading (value, version, snapshot value, snapshot
    version) at graph run time.
    """
    v = SafeVariable(value)
    kept_with(v, tf.function(lambda: v.assign_add(1.0), autograph=False))()
    assert v.statistics().runtime_mode and v.version == 1

    @tf.function(autograph=False)
    def read_in_graph():
        snap = v.snapshot()
        return v.read_value(), v.version, snap.value, snap.version

    return v, read_in_graph


def _state(v: SafeVariable, read_in_graph) -> dict[str, tuple[float, int]]:
    """Value and version as seen eagerly, by an eager snapshot and inside a graph."""
    snap = v.snapshot()
    value, version, snap_value, snap_version = (t.numpy() for t in read_in_graph())
    return {
        "eager": (float(v.numpy()), v.version),
        "eager snapshot": (float(snap.numpy()), snap.version),
        "graph": (float(value), int(version)),
        "graph snapshot": (float(snap_value), int(snap_version)),
    }


def _everywhere(value: float, version: int) -> dict[str, tuple[float, int]]:
    return dict.fromkeys(["eager", "eager snapshot", "graph", "graph snapshot"], (value, version))


def _fail_after(*writes):
    def fn():
        for write in writes:
            write()
        raise Abort("roll back")

    return fn


def test_rollback_restores_value_and_version_in_runtime_mode():
    v, read_in_graph = _runtime_variable(1.0)
    with pytest.raises(Abort):
        safevars.transaction(
            [v],
            _fail_after(
                lambda: v.assign(10.0),
                lambda: v.assign_add(1.0),
                lambda: v.update(lambda x: x * 2.0),
            ),
        )
    assert _state(v, read_in_graph) == _everywhere(2.0, 1)
    stats = v.statistics()
    assert not stats.locked and stats.runtime_mode
    # Counting goes on from the restored version, in a graph and eagerly.
    tf.function(lambda: v.assign_add(1.0), autograph=False)()
    assert _state(v, read_in_graph) == _everywhere(3.0, 2)
    assert v.compare_and_assign(7.0, 2) is True
    assert _state(v, read_in_graph) == _everywhere(7.0, 3)


def test_graph_compare_and_assign_sees_the_restored_version():
    v, _ = _runtime_variable(1.0)
    with pytest.raises(Abort):
        safevars.transaction([v], _fail_after(lambda: v.assign_add(5.0)))
    cas = tf.function(lambda expected: v.compare_and_assign(9.0, expected), autograph=False)
    assert not bool(cas(tf.constant(2, tf.int64)))  # the rolled-back version
    assert bool(cas(tf.constant(1, tf.int64)))
    assert (float(v.numpy()), v.version) == (9.0, 2)


def test_rollback_of_variables_in_both_modes_at_once():
    a, read_a = _runtime_variable(10.0)  # run-time mode: 11.0, version 1
    b = SafeVariable(0.0)  # eager only
    b.assign(1.0)
    with pytest.raises(Abort):
        safevars.transaction(
            [a, b], _fail_after(lambda: a.assign_sub(4.0), lambda: b.assign_add(4.0))
        )
    assert _state(a, read_a) == _everywhere(11.0, 1)
    assert (float(b.numpy()), b.version) == (1.0, 1) and b.snapshot().version == 1
    assert not b.statistics().runtime_mode


def test_failed_transactions_leave_no_trace_among_running_graphs():
    """Graph writers and failing eager transactions at once: only the graphs count."""
    v, read_in_graph = _runtime_variable(-1.0)  # 0.0, version 1
    graph_add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    graph_add()  # 1.0, version 2: traced before the threads start
    graph_writers, eager_failers, iterations = 2, 2, 40

    def work(i):
        for _ in range(iterations):
            if i < graph_writers:
                graph_add()
            else:
                with pytest.raises(Abort):
                    safevars.transaction(
                        [v], _fail_after(lambda: v.assign_add(100.0), lambda: v.assign_add(100.0))
                    )

    run_threads(graph_writers + eager_failers, work)
    writes = graph_writers * iterations
    assert _state(v, read_in_graph) == _everywhere(1.0 + writes, 2 + writes)
