"""Run-time mode's two levels (versions in variables, and the mutex for eager sections),
and its end: a lock whose graphs are all garbage-collected returns to eager mode.

A lock used only by XLA-compiled functions (called eagerly, which hold the lock around
the call) keeps its versions in variables but takes no TensorFlow mutex eagerly; the
first graph that takes the mutex with a ``MutexLock`` op switches eager sections to take
it too, and that switch waits for every eager holder that did not.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest
import tensorflow as tf

import safevars
from safevars import _tf_internal as tfi
from safevars import locking
from safevars.locking import acquisition
from safevars.sections import graph_section
from tests.support.deadlines import scaled
from tests.support.threading_harness import call_bounded, in_frame, join_all, run_threads, wait_for


def test_a_lock_only_xla_functions_use_takes_no_mutex_eagerly():
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), jit_compile=True, autograph=False)
    add()
    assert v.statistics().runtime_mode and not v.statistics().eager_mutex
    run_threads(4, lambda _: [add() for _ in range(50)])
    with safevars.locked(v):
        v.assign_add(1.0)  # an eager write under the Python lock alone
    assert float(v.numpy()) == 202.0 and v.version == 202
    snap = safevars.snapshot(v)  # optimistic again: compiled writes move the sequence
    assert float(snap.numpy()) == 202.0 and snap.version == 202


def test_a_graph_taking_the_mutex_waits_for_an_eager_holder_without_it():
    """An eager section opened before any graph took the mutex holds only the Python
    lock; a graph traced meanwhile must not run inside that section."""
    v = safevars.SafeVariable(0.0)
    add_compiled = tf.function(lambda: v.assign_add(1.0), jit_compile=True, autograph=False)
    add_compiled()  # run-time versions, no mutex yet
    inside, traced = threading.Event(), threading.Event()
    seen: list[float] = []

    def role(index: int) -> None:
        if index == 0:
            with safevars.locked(v):
                inside.set()
                time.sleep(0.5)  # the other thread traces and runs its graph meanwhile
                seen.append(float(v.numpy()))
            return
        assert inside.wait(scaled(60))
        graph_add = tf.function(lambda: v.assign_add(10.0), autograph=False)
        graph_add()  # its trace switches the lock to take the mutex eagerly
        traced.set()

    run_threads(2, role)
    assert traced.is_set() and seen == [1.0]  # the graph's write waited for the section
    assert float(v.numpy()) == 11.0 and v.version == 2
    assert v.statistics().eager_mutex  # eager sections take the mutex now

    def mixed(index: int) -> None:  # compiled calls and eager writes, under the mutex now
        for _ in range(25):
            if index % 2:
                add_compiled()
            else:
                v.assign_add(1.0)

    run_threads(4, mixed)
    assert float(v.numpy()) == 111.0 and v.version == 102


# --------------------------------------------------------------- run-time mode ends


def _mode(v: safevars.SafeVariable) -> tuple[bool, bool, int]:
    stats = v.statistics()
    return stats.runtime_mode, stats.eager_mutex, stats.graph_uses


def test_a_lock_returns_to_eager_mode_when_its_last_graph_is_freed():
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    version = tf.function(lambda: v.version, autograph=False)
    add()
    assert int(version()) == 1
    assert _mode(v) == (True, True, 2)
    del add
    gc.collect()
    v.assign_add(1.0)  # one function is still alive: eager sections take the mutex
    assert _mode(v) == (True, True, 1)
    assert int(version()) == 2
    del version
    gc.collect()
    assert v.statistics().graph_uses == 0
    v.assign_add(1.0)  # the next eager section switches the lock back
    assert _mode(v) == (False, False, 0)
    assert (float(v.numpy()), v.version) == (3.0, 3)
    v.update(lambda x: x + 1.0)
    assert (float(v.numpy()), v.version, v.snapshot().version) == (4.0, 4, 4)
    # A new graph takes the lock to run-time mode again; versions go on from the same.
    add_again = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add_again()
    read = tf.function(lambda: (v.read_value(), v.version), autograph=False)
    assert _mode(v)[:2] == (True, True)
    value, graph_version = read()
    assert (float(value), int(graph_version), v.version) == (5.0, 5, 5)


def test_the_mutex_is_destroyed_when_the_lock_leaves_run_time_mode():
    """The mutex is a resource TensorFlow keeps (with a thread once taken) until it is
    destroyed: a lock that leaves run-time mode destroys it, and so does a lock that is
    garbage-collected in run-time mode."""
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add()
    handle = v.guard.lock.cs._handle
    del add
    gc.collect()
    v.assign_add(1.0)
    with pytest.raises(tf.errors.NotFoundError):  # (a MutexLock would make a new one)
        tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=False)

    def written_in_a_graph() -> tuple[safevars.SafeVariable, object]:
        w = safevars.SafeVariable(0.0)
        add = tf.function(lambda: w.assign_add(1.0), autograph=False)
        add()
        return w, add

    kept = written_in_a_graph()
    handle = kept[0].guard.lock.cs._handle
    del kept
    gc.collect()
    with pytest.raises(tf.errors.NotFoundError):
        tf.raw_ops.DestroyResourceOp(resource=handle, ignore_lookup_error=False)


def test_graphs_and_eager_writers_stay_exact_while_the_last_graph_goes():
    """Graph threads update through functions of their own and then drop them, while
    eager threads update throughout: the lock leaves run-time mode while eager sections
    run, never while a graph that takes the mutex is alive or running."""
    v = safevars.SafeVariable(0.0)
    rounds, graph_threads, eager_threads = 150, 2, 2
    dropped = threading.Barrier(graph_threads)

    def work(index: int) -> None:
        if index < graph_threads:
            step = tf.function(lambda: v.update(lambda x: x + 1.0), autograph=False)
            for _ in range(rounds):
                step()
            del step
            dropped.wait(scaled(60))
            if index == 0:
                # gc.collect() returns at once, collecting nothing, while another thread
                # collects (an automatic collection in an eager thread, say): collect
                # until both functions are gone, so the eager sections below switch the
                # lock back while the other threads still write.
                deadline = time.monotonic() + scaled(60)
                while v.statistics().graph_uses and time.monotonic() < deadline:
                    gc.collect()
                assert v.statistics().graph_uses == 0
            for _ in range(rounds):
                v.update(lambda x: x + 1.0)
        else:
            for _ in range(2 * rounds):
                v.update(lambda x: x + 1.0)

    run_threads(graph_threads + eager_threads, work)
    total = 2 * rounds * (graph_threads + eager_threads)
    assert (float(v.numpy()), v.version) == (float(total), total)
    v.assign_add(1.0)
    assert _mode(v) == (False, False, 0)
    assert (float(v.numpy()), v.version) == (float(total + 1), total + 1)


def test_a_function_still_alive_keeps_run_time_mode_across_threads():
    """A function kept by one thread while others write eagerly: every eager section
    takes the mutex as long as it lives, so its graph's updates are never lost."""
    v = safevars.SafeVariable(0.0)
    step = tf.function(lambda: v.update(lambda x: x + 1.0), autograph=False)
    step()

    def work(index: int) -> None:
        for i in range(150):
            if index % 2:
                step()
            else:
                if i % 50 == 0:
                    gc.collect()  # (frees nothing that a graph still uses)
                v.update(lambda x: x + 1.0)

    run_threads(4, work)
    assert (float(v.numpy()), v.version) == (601.0, 601)
    assert _mode(v) == (True, True, 1)


def test_a_cached_batched_snapshot_does_not_keep_locks_in_run_time_mode():
    """Snapshots of many variables in run-time mode read them through one cached traced
    function; that cache does not keep the locks in run-time mode once the graphs that
    put them there are gone, and is never used over a mutex the lock no longer has."""
    vs = [safevars.SafeVariable(float(i)) for i in range(10)]
    add = tf.function(lambda: [v.assign_add(1.0) for v in vs], autograph=False)
    add()
    snaps = safevars.snapshot(vs)
    assert [s.version for s in snaps] == [1] * 10
    del add
    gc.collect()
    for v in vs:
        v.assign_add(1.0)
    assert all(_mode(v) == (False, False, 0) for v in vs)
    assert [s.version for s in safevars.snapshot(vs)] == [2] * 10
    add = tf.function(lambda: [v.assign_add(1.0) for v in vs], autograph=False)
    add()  # new mutexes: the cached reader of the old ones must not be used
    snaps = safevars.snapshot(vs)
    assert [(float(s.numpy()), s.version) for s in snaps] == [(i + 3.0, 3) for i in range(10)]


def test_eager_sections_stop_taking_the_tf_mutex_once_the_last_graph_is_freed(monkeypatch):
    """Measures the mode by what eager sections do: every ``MutexLock`` run eagerly is
    counted. In run-time mode an eager section takes the lock's TF mutex only while a
    call of a function taking it runs (none here); after the last function using the
    lock is freed, one section switches back (it takes the mutex once, to wait for a
    graph still running) and the next ones take none."""
    taken: list[object] = []
    real = tfi.mutex_lock

    def counting(*args: object, **kwargs: object) -> object:
        if tf.executing_eagerly():
            taken.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(tfi, "mutex_lock", counting)
    v = safevars.SafeVariable(0.0)
    for _ in range(3):
        v.assign_add(1.0)
    assert taken == []  # eager mode: the Python lock alone
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add()
    for _ in range(3):
        v.assign_add(1.0)
        v.update(lambda x: x + 1.0)
    assert taken == [] and _mode(v)[:2] == (True, True)  # run-time mode, no call running
    del add
    gc.collect()
    taken.clear()
    for _ in range(3):
        v.assign_add(1.0)
        v.update(lambda x: x + 1.0)
    assert len(taken) == 1  # the switch back's; then none
    assert v.guard.lock.cs is None and _mode(v) == (False, False, 0)
    assert (float(v.numpy()), v.version) == (16.0, 16)


def test_joint_versions_are_kept_exactly_across_the_switch_back():
    """Versions that live partly in a joint counter (what an optimizer's weights and
    slots share) come back into Python as the same numbers, and go on from there."""
    a, b = safevars.SafeVariable(0.0), safevars.SafeVariable(0.0)
    guards = [a.guard, b.guard]
    assert locking.share_lock(guards) and locking.join_versions(guards)

    def both() -> None:  # a write of both counted once on the joint counter
        def body() -> object:
            written = tf.group(a.__wrapped__.assign_add(1.0), b.__wrapped__.assign_add(1.0))
            locking.bump_graph_together(guards, written)
            return written

        graph_section(guards, body)

    step = tf.function(both, autograph=False)
    step()
    step()
    a.assign_add(1.0)  # eager, in run-time mode: a's own count
    assert a.guard.joint.value() == 2 and (a.version, b.version) == (3, 2)
    del step
    gc.collect()
    b.assign_add(1.0)  # switches back, then counts in Python
    assert _mode(a) == (False, False, 0)
    assert (a.version, b.version) == (3, 3)
    assert [(float(s.numpy()), s.version) for s in safevars.snapshot([a, b])] == [(3.0, 3)] * 2
    step = tf.function(both, autograph=False)
    step()  # run-time mode again: the versions move into variables unchanged
    assert (a.version, b.version) == (4, 4)
    read = tf.function(lambda: (a.version, b.version), autograph=False)
    assert [int(x) for x in read()] == [4, 4]


def test_a_graph_traced_while_the_lock_switches_back_stays_exact():
    """Round after round, the lock's last function is dropped; then one thread writes
    eagerly (its first section switches the lock back) while another traces a new
    function over the lock and calls it, and a third writes eagerly too. Whichever comes
    first, the new graph either keeps run-time mode or waits for the switch and gets a
    mutex of its own: no update is lost and value equals version after every round."""
    v = safevars.SafeVariable(0.0)
    keep = [tf.function(lambda: v.update(lambda x: x + 1.0), autograph=False)]
    keep[0]()
    total = 1
    rounds, calls = 12, 8  # 3 of each start offset (round_index % 4)
    for round_index in range(rounds):
        keep.clear()
        gc.collect()
        assert v.statistics().graph_uses == 0

        def work(index: int, round_index: int = round_index) -> None:
            if index == 1:
                for _ in range(round_index % 4):  # (the trace starts a little later)
                    with safevars.locked(v):
                        pass
                step = tf.function(lambda: v.update(lambda x: x + 1.0), autograph=False)
                for _ in range(calls):
                    step()
                keep.append(step)
            else:
                for _ in range(calls):
                    v.update(lambda x: x + 1.0)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch every few bytecodes: more interleavings
        try:
            run_threads(3, work)
        finally:
            sys.setswitchinterval(interval)
        total += 3 * calls
        assert _mode(v) == (True, True, 1)  # the new function is alive
        assert (float(v.numpy()), v.version) == (float(total), total), round_index
        with safevars.locked(v):  # an eager section with the function alive: no switch
            pass
        assert _mode(v) == (True, True, 1)


def test_a_graph_traced_just_before_the_switch_back_keeps_run_time_mode(monkeypatch):
    """The narrowest case of the race above, made to happen: a thread traces a function
    over the lock after an eager section has seen no graph using it and before the
    switch back begins. That function keeps its mutex: the switch back gives up, eager
    sections keep taking the mutex, and nothing is lost."""
    from safevars.locking import acquisition

    v = safevars.SafeVariable(0.0)
    first = tf.function(lambda: v.assign_add(1.0), autograph=False)
    first()
    del first
    gc.collect()
    leave = acquisition.LEAVE_RUNTIME[0]
    traced: list[object] = []

    def trace_first(lock: object) -> None:
        if not traced:  # a graph traced in another thread, at this very point
            step = tf.function(lambda: v.update(lambda x: x + 1.0), autograph=False)
            call_bounded(lambda: step.get_concrete_function(), timeout=120)
            traced.append(step)
        leave(lock)

    monkeypatch.setattr(acquisition, "LEAVE_RUNTIME", [trace_first])
    v.assign_add(1.0)  # sees no graph, then one is traced before the switch back
    assert traced and _mode(v) == (True, True, 1)
    run_threads(4, lambda i: [traced[0]() if i % 2 else v.assign_add(1.0) for _ in range(50)])
    assert (float(v.numpy()), v.version) == (202.0, 202)
    assert _mode(v) == (True, True, 1)


# ------------------------------------------- the eager mutex, only while a call runs


def _mutex_takes(monkeypatch) -> list[int]:
    """Counts the eager ``MutexLock`` s sections take from now on."""
    taken = [0]
    real = acquisition._mutex_lock

    def counting(lock, timeout):
        taken[0] += 1
        return real(lock, timeout)

    monkeypatch.setattr(acquisition, "_mutex_lock", counting)
    return taken


def test_an_eager_section_takes_the_mutex_only_while_a_call_taking_it_runs(monkeypatch):
    """A ``MutexLock`` op costs an eager section about 100 µs (it hands the lock over on
    the mutex's thread). While a call of a function whose graph takes the mutex runs,
    an eager write takes it and waits for the graph's section; with no such call
    running, it takes the Python lock alone."""
    v = safevars.SafeVariable(0.0)
    inside, release = threading.Event(), threading.Event()

    def hold_the_section(x):
        inside.set()
        assert release.wait(scaled(60))
        return x

    @tf.function(autograph=False)
    def slow_add():  # the py_function runs inside the graph's section
        return v.update(
            lambda x: tf.ensure_shape(tf.py_function(hold_the_section, [x], tf.float32), []) + 1.0
        )

    slow_add.get_concrete_function()  # traced: the lock's eager sections may take the mutex
    assert v.statistics().eager_mutex
    takes = _mutex_takes(monkeypatch)
    caller = threading.Thread(target=slow_add, daemon=True)
    caller.start()
    assert inside.wait(scaled(60))  # the call runs, inside its section
    writer = threading.Thread(target=lambda: v.assign_add(10.0), daemon=True)
    writer.start()
    wait_for(lambda: in_frame(writer, "_mutex_lock") or not writer.is_alive(), "the writer")
    assert writer.is_alive() and float(v.numpy()) == 0.0  # it waits for the section
    release.set()
    assert join_all([caller, writer], 60) == []
    assert float(v.numpy()) == 11.0 and v.version == 2 and takes[0] == 1

    v.assign_add(100.0)  # no call runs: the Python lock alone
    with safevars.locked(v):
        v.assign_add(1000.0)
    assert takes[0] == 1 and float(v.numpy()) == 1111.0 and v.version == 4


def test_a_call_waits_for_an_eager_section_that_did_not_take_the_mutex():
    """An eager section that found no call running holds the Python lock alone: a call
    made meanwhile waits for the section to end before its graph runs."""
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(10.0), autograph=False)
    add.get_concrete_function()
    entered = threading.Event()
    seen: list[float] = []

    def role(index: int) -> None:
        if index == 0:
            with safevars.locked(v):
                entered.set()
                wait_for(
                    lambda: bool(caller) and (in_frame(caller[0], "admit_call") or done.is_set()),
                    "the call",
                )
                seen.append(float(v.numpy()))
                seen.append(float(done.is_set()))
            return
        caller.append(threading.current_thread())
        assert entered.wait(scaled(60))
        add()
        done.set()

    caller: list[threading.Thread] = []
    done = threading.Event()
    run_threads(2, role)
    assert seen == [0.0, 0.0]  # the call had not run inside the section
    assert float(v.numpy()) == 10.0 and v.version == 1


def test_a_lock_a_tf_data_function_takes_is_taken_with_its_mutex_by_eager_sections(
    monkeypatch,
):
    """tf.data's own threads run a transformation's graph, not a call this process
    counts: every eager section over its lock takes the mutex."""
    v = safevars.SafeVariable(0.0)
    dataset = tf.data.Dataset.range(4).map(lambda i: (v.assign_add(1.0), i)[1])
    takes = _mutex_takes(monkeypatch)
    v.assign_add(10.0)
    assert takes[0] == 1
    assert list(dataset.as_numpy_iterator()) == [0, 1, 2, 3]
    assert float(v.numpy()) == 14.0 and v.version == 5


def test_a_traced_function_called_in_a_tf_data_transformation_makes_sections_take_the_mutex(
    monkeypatch,
):
    """A function traced and called before, then called from a tf.data transformation:
    tf.data's threads run it, outside any counted call (the call wrapper marks its locks,
    as the function is not traced again)."""
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add()
    lock = v.guard.lock
    assert not lock.untracked
    traces = add.experimental_get_tracing_count()
    dataset = tf.data.Dataset.range(4).map(lambda i: (add(), i)[1])
    assert add.experimental_get_tracing_count() == traces  # the same graph, called
    assert lock.untracked
    takes = _mutex_takes(monkeypatch)
    v.assign_add(10.0)
    assert takes[0] == 1
    assert list(dataset.as_numpy_iterator()) == [0, 1, 2, 3]
    assert float(v.numpy()) == 15.0 and v.version == 6


def test_a_call_on_an_asynchronous_executor_makes_eager_sections_take_the_mutex(monkeypatch):
    """An asynchronous call returns before its graph has run: from then on every eager
    section over its locks takes the mutex."""
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add()
    takes = _mutex_takes(monkeypatch)
    v.assign_add(10.0)
    assert takes[0] == 0  # a synchronous call ran: counted
    tf.config.experimental.set_synchronous_execution(False)  # (this thread's executor)
    try:
        add()
    finally:
        tf.config.experimental.set_synchronous_execution(True)
    v.assign_add(100.0)
    assert takes[0] == 1 and float(v.numpy()) == 112.0 and v.version == 4


def test_a_tf_data_function_traced_inside_a_section_makes_that_section_take_the_mutex():
    """tf.data may run a transformation as soon as it is traced: a section of the tracing
    thread that did not take the mutex takes it then, for the rest of the section."""
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), autograph=False)
    add()  # the lock takes the mutex in graphs; eager sections need not, yet
    lock = v.guard.lock
    with safevars.locked(v):
        assert lock._token is None
        dataset = tf.data.Dataset.range(2).map(lambda i: (v.assign_add(1.0), i)[1])
        assert lock.untracked and lock._token is not None
        assert not tf.is_symbolic_tensor(lock._token)  # taken now, not traced
    assert lock._token is None  # released with the section
    assert list(dataset.as_numpy_iterator()) == [0, 1]
    assert float(v.numpy()) == 3.0 and v.version == 3
