"""Locks under real concurrency: no lost update, no deadlock, re-entry, order, mixed mode.

Every worker starts on a ``threading.Barrier`` and is joined with a timeout; invariants
are exact. No test asserts a timing.
"""

from __future__ import annotations

import os
import random
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.deadlines import scaled
from tests.support.graphs import kept_with
from tests.support.threading_harness import run_threads

THIS_FILE = os.path.basename(__file__)  # where the locks taken here say they were taken

THREADS, ITERATIONS = 8, 1000


def test_update_loses_nothing():
    v = SafeVariable(0.0)
    run_threads(THREADS, lambda i: [v.update(lambda x: x + 1.0) for _ in range(ITERATIONS)])
    assert float(v.numpy()) == THREADS * ITERATIONS
    assert v.version == THREADS * ITERATIONS


def test_locked_read_then_assign_loses_nothing():
    v = SafeVariable(0.0)

    def work(i):
        for _ in range(ITERATIONS):
            with safevars.locked(v):
                v.assign(v.read_value() + 1.0)

    run_threads(THREADS, work)
    assert float(v.numpy()) == THREADS * ITERATIONS
    assert v.version == THREADS * ITERATIONS


def test_locked_over_safe_variables_walks_no_nest(monkeypatch):
    """``locked(a, b)`` takes its variables as they are, without ``tf.nest``: a Ctrl-C
    that landed in ``tf.nest``'s C code once came out as an ``AttributeError``, not a
    ``KeyboardInterrupt`` (``test_faults.py``'s SIGINT test, TensorFlow 2.21)."""
    a, b = SafeVariable(0.0), SafeVariable(0.0)

    def walked(*args, **kwargs):
        raise AssertionError("tf.nest walked the variables")

    monkeypatch.setattr(tf.nest, "map_structure", walked)
    with safevars.locked(a, b):
        a.assign_add(1.0, read_value=False)
        b.assign_add(1.0, read_value=False)
    assert (float(a.numpy()), a.version, float(b.numpy()), b.version) == (1.0, 1, 1.0, 1)


def test_versions_strictly_increase_per_observer():
    v = SafeVariable(0.0)
    seen: dict[int, list[int]] = {i: [] for i in range(4)}

    def work(i):
        for _ in range(300):
            v.assign_add(1.0)
            seen[i].append(v.snapshot().version)

    run_threads(4, work)
    for versions in seen.values():
        assert all(b > a for a, b in zip(versions, versions[1:]))
    assert v.version == 1200 and float(v.numpy()) == 1200.0


def test_random_subsets_in_random_orders_never_deadlock():
    variables = [SafeVariable(0.0) for _ in range(6)]
    rounds = 150

    def work(i):
        rng = random.Random(i)
        for _ in range(rounds):
            subset = rng.sample(variables, rng.randint(1, len(variables)))
            if rng.random() < 0.5:
                with safevars.locked(*subset):
                    for v in subset:
                        v.assign(v.read_value() + 1.0)
            else:
                safevars.transaction(subset, lambda s=subset: [v.assign_add(1.0) for v in s])

    run_threads(6, work)
    total = sum(float(v.numpy()) for v in variables)
    writes = sum(v.version for v in variables)
    assert total == writes  # every write added exactly 1


def test_reentry_works_for_the_holding_thread():
    v = SafeVariable(0.0)
    with safevars.locked(v):
        with safevars.locked(v):
            v.update(lambda x: x + 1.0)
        safevars.transaction([v], lambda: v.assign_add(1.0))
        assert v.statistics().depth == 1
    stats = v.statistics()
    assert float(v.numpy()) == 2.0 and v.version == 2
    assert not stats.locked and stats.depth == 0


def test_out_of_order_acquisition_is_refused_before_locking():
    first, second = SafeVariable(0.0), SafeVariable(0.0)
    with safevars.locked(second):
        with pytest.raises(safevars.LockOrderError, match="global lock order"):
            first.assign(1.0)
        with pytest.raises(RuntimeError):
            with safevars.locked(first):
                pass
        assert not first.statistics().locked
    assert float(first.numpy()) == 0.0 and first.version == 0
    # In order is fine.
    with safevars.locked(first):
        second.assign(2.0)
    assert second.version == 1


def test_transaction_rolls_back_on_exception():
    a, b = SafeVariable(10.0), SafeVariable(0.0)

    def move_then_fail():
        a.assign_sub(4.0)
        b.assign_add(4.0)
        raise KeyError("abort")

    with pytest.raises(KeyError, match="abort"):
        safevars.transaction([a, b], move_then_fail)
    assert (float(a.numpy()), float(b.numpy())) == (10.0, 0.0)
    assert (a.version, b.version) == (0, 0)
    assert not a.statistics().locked and not b.statistics().locked


def test_transaction_bad_arguments_change_nothing():
    v = SafeVariable(1.0)
    with pytest.raises(safevars.NotCallableError):
        safevars.transaction([v], "not callable")  # type: ignore[arg-type]
    with pytest.raises(safevars.InvalidArgumentError, match="variables"):
        safevars.transaction([v, "not a variable"], lambda: None)
    with pytest.raises(safevars.InvalidArgumentError, match="at least one"):
        safevars.transaction([], lambda: None)
    with pytest.raises(safevars.InvalidArgumentError, match="at least one"):
        with safevars.locked():
            pass
    assert v.version == 0 and not v.statistics().locked


def test_locked_refuses_tf_function():
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def f():
        with safevars.locked(v):
            v.assign_add(1.0)

    with pytest.raises(safevars.InvalidArgumentError, match="transaction"):
        f()
    assert v.version == 0


def test_graph_transaction_is_atomic_across_threads():
    a, b = SafeVariable(0.0), SafeVariable(0.0)

    @tf.function(autograph=False)
    def step():
        def body():
            x = a.read_value()
            a.assign(x + 1.0)
            b.assign(b.read_value() + 1.0)

        safevars.transaction([a, b], body)

    run_threads(4, lambda i: [step() for _ in range(100)])
    assert float(a.numpy()) == 400.0 and float(b.numpy()) == 400.0
    assert a.version == 400 and b.version == 400


def test_mixed_eager_threads_and_running_tf_function_lose_nothing():
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def graph_increment():
        return v.update(lambda x: x + 1.0)

    def work(i):
        for _ in range(150):
            if i % 2:
                graph_increment()
            else:
                v.update(lambda x: x + 1.0)

    run_threads(4, work)
    assert float(v.numpy()) == 600.0
    assert v.version == 600
    assert v.statistics().runtime_mode


def test_mixed_locked_section_excludes_running_graph():
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def graph_increment():
        return v.assign_add(1.0)

    graph_increment()  # traced outside any locked section: run-time mode

    def work(i):
        for _ in range(100):
            if i % 2:
                graph_increment()
            else:
                with safevars.locked(v):
                    v.assign(v.read_value() + 1.0)

    run_threads(4, work)
    assert float(v.numpy()) == 401.0 and v.version == 401


def test_tracing_a_writer_inside_locked_section_raises_instead_of_hanging():
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def graph_increment():
        return v.assign_add(1.0)

    with safevars.locked(v):
        with pytest.raises(safevars.LockReentryError, match="locked"):
            graph_increment()
    assert v.version == 0 and not v.statistics().locked
    assert float(graph_increment()) == 1.0 and v.version == 1


def test_nested_graph_update_of_same_variable_is_reentrant_in_transaction():
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def f():
        return safevars.transaction([v], lambda: v.update(lambda x: x * 3.0))

    assert float(f()) == 3.0 and v.version == 1


def test_a_section_runs_on_the_parameter_server_holding_all_its_variables():
    from types import SimpleNamespace

    from safevars.sections.section import _section_device

    def guards(*devices):
        return [SimpleNamespace(device=d) for d in devices]

    ps0 = "/job:ps/replica:0/task:0/device:CPU:0"
    ps1 = "/job:ps/replica:0/task:1/device:CPU:0"
    assert _section_device(guards(ps0, ps0)) == ps0
    assert _section_device(guards(ps1)) == ps1
    # Several tasks, a worker, or no device at all: TensorFlow places the ops.
    assert _section_device(guards(ps0, ps1)) is None
    assert _section_device(guards("/job:worker/replica:0/task:0/device:CPU:0")) is None
    assert _section_device(guards("/job:localhost/replica:0/task:0/device:CPU:0")) is None
    assert _section_device(guards("")) is None


def test_a_graph_write_takes_the_lock_only_once_its_value_is_computed():
    v = SafeVariable(tf.zeros([4]))
    x = tf.ones([4])

    @tf.function(autograph=False)
    def write():
        v.assign(tf.sqrt(x) * 3.0)  # computed before the section, outside the lock

    graph = write.get_concrete_function().graph
    (lock,) = [op for op in graph.get_operations() if op.type == "MutexLock"]
    (value,) = [op for op in graph.get_operations() if op.type == "Mul"]
    assert value in lock.control_inputs
    (release,) = [op for op in graph.get_operations() if op.type == "ConsumeMutexLock"]
    assign = [op for op in graph.get_operations() if op.type == "AssignVariableOp"]
    assert set(assign) <= set(release.control_inputs)  # released after the write
    write()
    np.testing.assert_allclose(v.numpy(), [3.0] * 4)
    assert v.version == 1


def test_graphs_writing_each_others_results_crosswise_do_not_deadlock():
    # Each write's lock is taken only once its value (another section's result) exists;
    # taking it first would hold one lock while waiting for the other (it hung).
    a, b = SafeVariable(0.0), SafeVariable(0.0)

    @tf.function(autograph=False)
    def one():
        a.assign(b.update(lambda x: x + 1.0))

    @tf.function(autograph=False)
    def other():
        b.assign(a.update(lambda x: x + 1.0))

    one(), other()
    run_threads(2, lambda i: [(one if i == 0 else other)() for _ in range(200)])
    assert a.version == b.version == 2 * (1 + 200)


def test_a_nested_graph_section_out_of_lock_order_is_refused_at_trace_time():
    first, second = SafeVariable(1.0), SafeVariable(2.0)

    @tf.function(autograph=False)
    def in_order():
        return first.update(lambda x: x + second.update(lambda y: y + 1.0))

    assert float(in_order()) == 4.0 and (first.version, second.version) == (1, 1)

    @tf.function(autograph=False)
    def out_of_order():
        return second.update(lambda y: y + first.update(lambda x: x + 1.0))

    with pytest.raises(safevars.LockOrderError, match="global lock order"):
        out_of_order()
    assert (float(first.numpy()), float(second.numpy())) == (4.0, 3.0)
    assert (first.version, second.version) == (1, 1)


# ---------------------------------------------------------------------- timeouts, holders


class _Holder:
    """A thread that holds ``safevars.locked(*variables)`` until released."""

    def __init__(self, *variables):
        self.entered, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=variables, name="stuck-holder", daemon=True
        )
        self.thread.start()
        assert self.entered.wait(scaled(30))

    def _run(self, *variables):
        with safevars.locked(*variables):  # the line held_locks() must name
            self.entered.set()
            self.release.wait(scaled(60))

    def stop(self):
        self.release.set()
        self.thread.join(scaled(30))
        assert not self.thread.is_alive()


def _state(v):
    stats = v.statistics()
    return float(np.sum(v.numpy())), v.version, stats.locked, stats.owner, stats.depth


TIMEOUT_CALLS = {
    "update": lambda v: v.update(lambda x: x + 1.0, timeout=0.2),
    "compare_and_assign": lambda v: v.compare_and_assign(5.0, v.version, timeout=0.2),
    "locked": lambda v: safevars.locked(v, timeout=0.2).__enter__(),
    "transaction": lambda v: safevars.transaction([v], lambda: v.assign(9.0), timeout=0.2),
    "snapshot": lambda v: v.snapshot(timeout=0.2),
    "safevars.snapshot": lambda v: safevars.snapshot([v], timeout=0.2),
}


@pytest.mark.parametrize("runtime", [False, True], ids=["eager", "runtime"])
@pytest.mark.parametrize("call", sorted(TIMEOUT_CALLS))
def test_a_timeout_names_the_holder_and_changes_nothing(call, runtime):
    v = SafeVariable(1.0)
    if runtime:
        kept_with(v, tf.function(lambda: v.assign_add(1.0), autograph=False))()
    holder = _Holder(v)
    try:
        before = _state(v) if not runtime else None
        with pytest.raises(safevars.LockTimeoutError) as caught:
            TIMEOUT_CALLS[call](v)
        assert isinstance(caught.value, TimeoutError)
        assert isinstance(caught.value, safevars.SafeVarsError)
        message = str(caught.value)
        assert "'stuck-holder'" in message and f"{THIS_FILE}:" in message
        assert v.name.split(":")[0] in message
        if before is not None:
            assert _state(v) == before
        held = safevars.held_locks()
        assert [(h.thread_name, h.depth) for h in held] == [("stuck-holder", 1)]
        assert held[0].where.endswith(f"{THIS_FILE}:{_HOLD_LINE}")
        assert held[0].variables == (v.name,)
    finally:
        holder.stop()
    assert safevars.held_locks() == []
    version = v.version
    v.update(lambda x: x + 1.0, timeout=scaled(5))  # and the lock works afterwards
    assert v.version == version + 1


_HOLD_LINE = _Holder._run.__code__.co_firstlineno + 1


def test_a_timeout_waiting_for_a_running_graph_names_it_and_releases_later():
    v = SafeVariable(0.0)
    inside, release = threading.Event(), threading.Event()

    def block(x):
        inside.set()
        release.wait(scaled(60))
        return x

    @tf.function(autograph=False)
    def slow_write():
        def body():
            value = tf.py_function(block, [v.read_value()], tf.float32)
            return v.assign(value + 1.0)

        return safevars.transaction([v], body)

    runner = threading.Thread(target=slow_write, daemon=True)
    runner.start()
    assert inside.wait(scaled(60))
    try:
        with pytest.raises(safevars.LockTimeoutError, match="running tf.function"):
            v.update(lambda x: x + 10.0, timeout=0.3)
        assert not v.statistics().locked  # the eager lock was given back
    finally:
        release.set()
        runner.join(scaled(60))
    assert not runner.is_alive()
    v.update(lambda x: x + 1.0, timeout=scaled(10))  # the abandoned MutexLock was released
    assert float(v.numpy()) == 2.0 and v.version == 2


@pytest.mark.parametrize("bad", [-1, "1", True, [1]])
def test_bad_timeouts_are_refused_before_anything_happens(bad):
    v = SafeVariable(0.0)
    with pytest.raises(safevars.InvalidArgumentError, match="timeout"):
        v.update(lambda x: x + 1.0, timeout=bad)
    with pytest.raises(safevars.InvalidArgumentError, match="timeout"):
        safevars.locked(v, timeout=bad)
    assert _state(v) == (0.0, 0, False, None, 0)


def test_held_locks_lists_nested_and_shared_holders_and_nothing_after():
    a, b = SafeVariable(0.0, name="a"), SafeVariable(0.0, name="b")
    assert safevars.held_locks() == []
    with safevars.locked(a):
        with safevars.locked(a, b):
            held = {h.variables: h for h in safevars.held_locks()}
            assert set(held) == {("a:0",), ("b:0",)}
            assert held[("a:0",)].depth == 2 and held[("b:0",)].depth == 1
            me = threading.current_thread()
            assert {h.thread_ident for h in held.values()} == {me.ident}
            assert all(h.thread_alive and h.held_for >= 0 for h in held.values())
            assert a.statistics().thread_name == me.name
            assert a.statistics().where.endswith(".py:" + a.statistics().where.split(":")[-1])
    assert safevars.held_locks() == []
    assert a.statistics().thread_name is None and a.statistics().held_for is None


def test_where_is_the_callers_line_however_deep_in_safevars_the_lock_is_taken():
    # update() and transaction() reach the lock through several safevars modules; every
    # safevars frame is skipped, so `where` names the line that called safevars.
    v = SafeVariable(0.0)
    seen = []
    update_line = sys._getframe().f_lineno + 1
    v.update(lambda x: seen.append(v.statistics().where) or x + 1.0)
    transaction_line = sys._getframe().f_lineno + 1
    safevars.transaction([v], lambda: seen.append(v.statistics().where))
    assert [where.rsplit("/", 1)[-1] for where in seen] == [
        f"{THIS_FILE}:{update_line}",
        f"{THIS_FILE}:{transaction_line}",
    ]


# ---------------------------------------------------------------------- shared locks


def test_shared_lock_keeps_versions_apart_and_excludes_across_variables():
    from safevars.locking import share_lock

    a, b, c = SafeVariable(0.0), SafeVariable(0.0), SafeVariable(0.0)
    assert share_lock([a.guard, b.guard, c.guard])
    assert a.guard.lock is b.guard.lock is c.guard.lock
    assert a.statistics().shared_by == 3

    def work(i):
        v = (a, b, c)[i % 3]
        for _ in range(200):
            with safevars.locked(v):
                # Holding one variable's lock holds all three.
                assert all(x.guard.owned() for x in (a, b, c))
                v.assign(v.read_value() + 1.0)

    run_threads(6, work)
    assert [float(x.numpy()) for x in (a, b, c)] == [400.0] * 3
    assert [x.version for x in (a, b, c)] == [400] * 3


def test_one_mutex_per_graph_section_over_variables_sharing_a_lock():
    from safevars.locking import share_lock

    vs = [SafeVariable(float(i)) for i in range(12)]
    assert share_lock([v.guard for v in vs])

    @tf.function(autograph=False)
    def step():
        return safevars.transaction(vs, lambda: [v.assign_add(1.0) for v in vs])

    graph = step.get_concrete_function().graph
    assert [op.type for op in graph.get_operations()].count("MutexLock") == 1
    run_threads(4, lambda i: [step() for _ in range(25)])
    assert [v.version for v in vs] == [100] * 12
    assert [float(v.numpy()) for v in vs] == [100.0 + i for i in range(12)]


def test_share_lock_joins_the_lock_a_traced_graph_uses_and_refuses_two_or_held():
    from safevars.locking import share_lock

    a, b, c = SafeVariable(0.0), SafeVariable(0.0), SafeVariable(0.0)
    # Each function is kept: a lock is used by graphs only while they live.
    add_a = tf.function(lambda: a.assign_add(1.0), autograph=False)
    add_a()
    lock_a, lock_c = a.guard.lock, c.guard.lock
    # b joins the lock a traced graph takes (its graphs keep taking that mutex).
    assert share_lock([b.guard, a.guard])
    assert b.guard.lock is lock_a and lock_a.order < lock_c.order
    add_c = tf.function(lambda: c.assign_add(1.0), autograph=False)
    add_c()
    assert not share_lock([a.guard, c.guard])  # two locks that graphs use: refused
    assert (a.guard.lock, c.guard.lock) == (lock_a, lock_c)
    with safevars.locked(c):
        assert not share_lock([c.guard, SafeVariable(0.0).guard])  # held: refused
    tf.function(lambda: b.assign_add(2.0), autograph=False)()  # under a's mutex now
    assert float(b.numpy()) == 2.0 and b.version == 1
    # The lock graphs use is the target even when it is not the earliest of them.
    early, late = SafeVariable(0.0), SafeVariable(0.0)
    add_late = tf.function(lambda: late.assign_add(1.0), autograph=False)
    add_late()
    lock_late = late.guard.lock
    assert early.guard.lock.order < lock_late.order
    assert share_lock([early.guard, late.guard])
    assert early.guard.lock is lock_late


# ---------------------------------------------------------------------- who holds a lock


class _ReleaseAt:
    """Empties a lock's holder slot before the ``k``-th bytecode of ``safevars.locking``
    code run in this thread, as the holder's release in another thread would if CPython
    switched threads there (Python 3.10 may switch before nearly any bytecode; later
    versions at fewer points, a subset of these)."""

    def __init__(self, slot: list, k: int) -> None:
        self.slot, self.k, self.seen, self.fired = slot, k, 0, False

    def before_bytecode(self) -> None:
        if self.seen == self.k:
            del self.slot[:]
            self.fired = True
        self.seen += 1

    def __enter__(self) -> _ReleaseAt:
        self._thread = threading.get_ident()
        if sys.version_info >= (3, 12):  # (3.12.1 reports no opcode events to settrace)
            monitoring = sys.monitoring
            self._tool = next(t for t in range(6) if monitoring.get_tool(t) is None)
            monitoring.use_tool_id(self._tool, "safevars-test")
            monitoring.register_callback(
                self._tool, monitoring.events.INSTRUCTION, self._instruction
            )
            monitoring.set_events(self._tool, monitoring.events.INSTRUCTION)
        else:
            sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        if sys.version_info >= (3, 12):
            monitoring = sys.monitoring
            monitoring.set_events(self._tool, 0)
            monitoring.register_callback(self._tool, monitoring.events.INSTRUCTION, None)
            monitoring.free_tool_id(self._tool)
        else:
            sys.settrace(None)

    def _instruction(self, code, offset):
        if "/safevars/locking/" not in code.co_filename.replace(os.sep, "/"):
            return sys.monitoring.DISABLE  # (other code: not reported again to this tool)
        if threading.get_ident() == self._thread:
            self.before_bytecode()
        return None

    def _trace(self, frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("safevars.locking") or threading.get_ident() != self._thread:
            return None
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            self.before_bytecode()
        return self._trace


def test_a_release_while_another_thread_asks_who_holds_the_lock_never_raises():
    """Only the holder empties a lock's slot, and it can do so between two reads of
    another thread's: ``slot and slot[0] is me`` raised IndexError (seen in CI on Python
    3.10, a graph traced by one thread while another released). Each reader runs once
    per bytecode with the release before it, and gets an answer that was true before
    or after the release."""
    from safevars.locking import ownership

    v = SafeVariable(0.0)
    lock = v._self_guard.lock
    other, me = threading.Thread(name="holder"), threading.current_thread()
    readers = {
        "_holding": (lambda: ownership._holding(lock, me), {False}),
        "holder": (lock.holder, {other, None}),
        "held_record": (
            lambda: getattr(lock.held_record(0.0), "thread_name", None),
            {"holder", None},
        ),
        "statistics": (lambda: v.statistics().thread_name, {"holder", None}),
    }
    for name, (read, answers) in readers.items():
        k = 0
        while True:
            lock._slot[:] = [other]
            release = _ReleaseAt(lock._slot, k)
            try:
                with release:
                    answer = read()
            finally:
                del lock._slot[:]
            assert answer in answers, (name, k, answer)
            if not release.fired:
                break
            k += 1
        assert k >= 1, name  # (a release was tried at one point at least)
