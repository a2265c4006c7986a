"""Reads and writes inside a section the calling thread holds: no waiting on itself.

``snapshot``, ``update`` and ``compare_and_assign`` called inside the thread's own
``safevars.locked(...)`` or ``safevars.transaction(...)`` must run at once (re-entrant),
see the section's earlier writes, and count one version per write. Each case runs in a
thread joined with a bound (``call_bounded``), so a section that waits on its own lock
fails the test instead of hanging it.

Every case runs in two modes (the ``variable`` fixture):

* ``eager``: a variable only ever used eagerly (Python locks, sequence-lock snapshots);
* ``runtime``: a variable first written inside a ``tf.function``, so every section on it
  also holds its ``tf.CriticalSection``.

Only the public API is used, so the tests hold whatever the locks look like inside.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.graphs import kept_with
from tests.support.threading_harness import call_bounded


def _variable(kind: str, value: float = 0.0) -> SafeVariable:
    """A variable at ``value + 1`` and version 1, in the lock mode ``kind``."""
    v = SafeVariable(value)
    if kind == "runtime":
        kept_with(v, tf.function(lambda: v.assign_add(1.0), autograph=False))()
    else:
        v.assign_add(1.0)
    assert v.version == 1 and float(v.numpy()) == value + 1.0
    assert v.statistics().runtime_mode == (kind == "runtime")
    return v


@pytest.fixture(params=["eager", "runtime"])
def kind(request) -> str:
    return request.param


def _assert_released(*variables: SafeVariable) -> None:
    for v in variables:
        stats = v.statistics()
        assert not stats.locked and stats.depth == 0, stats


# ---------------------------------------------------------------------- snapshots


def test_snapshot_inside_own_transaction(kind):
    v = _variable(kind)
    assert call_bounded(lambda: safevars.transaction([v], lambda: v.snapshot().version)) == 1

    def write_then_snapshot():
        v.assign_add(1.0)
        return v.snapshot()

    snap = call_bounded(lambda: safevars.transaction([v], write_then_snapshot))
    assert snap.version == 2 and float(snap.numpy()) == 2.0  # sees the section's write
    assert v.version == 2 and float(v.numpy()) == 2.0
    _assert_released(v)


def test_snapshot_inside_own_locked(kind):
    v = _variable(kind)

    def body():
        with safevars.locked(v):
            before = v.snapshot()
            v.assign(5.0)
            with safevars.locked(v):  # nested: depth 2
                nested = v.snapshot()
            return before, nested, v.snapshot()

    before, nested, after = call_bounded(body)
    assert [s.version for s in (before, nested, after)] == [1, 2, 2]
    assert [float(s.numpy()) for s in (before, nested, after)] == [1.0, 5.0, 5.0]
    _assert_released(v)


def test_snapshot_of_several_inside_locked_of_one(kind):
    v = _variable(kind)
    w = _variable(kind, value=10.0)  # created after v: later in the lock order

    def body():
        with safevars.locked(v):
            v.assign_add(1.0)
            one_held = safevars.snapshot([v, w])
        with safevars.locked(v, w):
            w.assign_add(1.0)
            both_held = safevars.snapshot({"v": v, "w": w})
        return one_held, both_held

    one_held, both_held = call_bounded(body)
    assert [(s.version, float(s.numpy())) for s in one_held] == [(2, 2.0), (1, 11.0)]
    assert {k: (s.version, float(s.numpy())) for k, s in both_held.items()} == {
        "v": (2, 2.0),
        "w": (2, 12.0),
    }
    _assert_released(v, w)


# ---------------------------------------------------------------------- writes


def test_update_inside_own_sections(kind):
    v = _variable(kind)

    def body():
        with safevars.locked(v):
            first = v.update(lambda x: x + 1.0)
            second = safevars.transaction([v], lambda: v.update(lambda x: x * 10.0))
        third = safevars.transaction([v], lambda: v.update(lambda x: x - 1.0))
        return [float(r) for r in (first, second, third)]

    assert call_bounded(body) == [2.0, 20.0, 19.0]
    assert v.version == 4 and float(v.numpy()) == 19.0
    _assert_released(v)


def test_compare_and_assign_inside_own_sections(kind):
    v = _variable(kind)

    def body():
        with safevars.locked(v):
            wrote = v.compare_and_assign(5.0, 1)
            stale = v.compare_and_assign(6.0, 1)  # the version is 2 now
        current = safevars.transaction([v], lambda: v.compare_and_assign(7.0, v.version))
        return wrote, stale, current

    assert call_bounded(body) == (True, False, True)
    assert v.version == 3 and float(v.numpy()) == 7.0
    _assert_released(v)


# ---------------------------------------------------------------------- traced sections


def test_reads_and_writes_inside_a_traced_transaction(kind):
    """The same inside a tf.function: nested sections on held variables lock nothing."""
    v = _variable(kind)
    w = _variable(kind, value=10.0)

    @tf.function(autograph=False)
    def step():
        def body():
            v.assign_add(1.0)  # v: 2.0, version 2
            seen = v.snapshot()
            wrote = v.compare_and_assign(5.0, seen.version)  # 5.0, version 3
            stale = v.compare_and_assign(6.0, seen.version)
            updated = w.update(lambda x: x * 2.0)  # w: 22.0, version 2
            both = safevars.snapshot([v, w])
            return (
                seen.value,
                seen.version,
                wrote,
                stale,
                updated,
                [s.value for s in both],
                [s.version for s in both],
            )

        return safevars.transaction([v, w], body)

    out = call_bounded(lambda: tf.nest.map_structure(lambda t: t.numpy(), step()))
    seen_value, seen_version, wrote, stale, updated, values, versions = out
    assert (seen_value, seen_version, wrote, stale, updated) == (2.0, 2, True, False, 22.0)
    np.testing.assert_array_equal(values, [5.0, 22.0])
    np.testing.assert_array_equal(versions, [3, 2])
    assert (v.version, w.version) == (3, 2)
    assert (float(v.numpy()), float(w.numpy())) == (5.0, 22.0)
    _assert_released(v, w)
