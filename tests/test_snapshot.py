"""Snapshots: immutable, consistent across variables, never torn by transactions."""

from __future__ import annotations

import contextlib
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.deadlines import scaled
from tests.support.threading_harness import JOIN_TIMEOUT, run_threads


def test_snapshot_is_immutable_and_unaffected_by_later_writes():
    v = SafeVariable([1.0, 2.0])
    snap = v.snapshot()
    v.assign([5.0, 6.0])
    np.testing.assert_array_equal(snap.numpy(), [1.0, 2.0])
    assert snap.version == 0 and v.version == 1
    with pytest.raises(ValueError):
        snap.numpy()[0] = 9.0  # read-only array
    with pytest.raises(AttributeError):
        snap.version = 3  # type: ignore[misc]
    assert float(tf.reduce_sum(tf.convert_to_tensor(snap))) == 3.0


def test_structure_is_preserved(mode):
    a, b, c = SafeVariable(1.0), SafeVariable(2.0), SafeVariable(3.0)
    b.assign(20.0)
    out = mode(lambda: safevars.snapshot({"a": a, "pair": (b, c)}))()
    if mode.name == "eager":
        assert out["a"].version == 0 and out["pair"][0].version == 1
        assert float(out["pair"][0].value) == 20.0
    else:  # a tf.function returns the snapshots' values
        assert float(out["pair"][0]) == 20.0 and float(out["a"]) == 1.0


def test_graph_snapshot_versions_are_tensors():
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def f():
        v.assign_add(1.0)
        s = v.snapshot()
        return s.value, s.version

    value, version = f()
    assert float(value) == 2.0 and version.dtype == tf.int64 and int(version) == 1


def test_bad_structure():
    v = SafeVariable(1.0)
    # A plain tf.Variable is wrapped on the fly (issue 13); a tensor is not a variable.
    with pytest.raises(safevars.InvalidArgumentError, match=r"structure\[1\].*safevars.wrap"):
        safevars.snapshot([v, tf.constant(1.0)])
    with pytest.raises(safevars.InvalidArgumentError, match="empty"):
        safevars.snapshot([])
    with pytest.raises(safevars.InvalidArgumentError, match="not built"):
        safevars.snapshot(keras.Sequential([keras.layers.Dense(2)]))


@pytest.mark.parametrize("shared", [False, True], ids=["two_locks", "one_shared_lock"])
@pytest.mark.parametrize("runtime_mode", [False, True], ids=["eager_locks", "runtime_mode"])
def test_no_torn_reads_under_concurrent_transactions(runtime_mode, shared):
    """A writer moves value between two variables; the sum is invariant in every snapshot.
    With one shared lock (a model built in a scope) a snapshot under the lock takes it
    without ``hold``."""
    from safevars.locking import share_lock

    a, b = SafeVariable(1000.0), SafeVariable(0.0)
    if shared:
        assert share_lock([a.guard, b.guard])
    if runtime_mode:

        @tf.function(autograph=False)
        def to_runtime():
            return safevars.snapshot([a, b])[0].value

        to_runtime()
    stop = threading.Event()
    reads_per_reader, readers = (5000, 2) if not runtime_mode else (1000, 2)
    broken: list[tuple[float, float]] = []

    def role(i):
        if i == 0:
            step = 0
            while not stop.is_set():
                amount = 1.0 if step % 2 == 0 else -1.0
                safevars.transaction([a, b], lambda: (a.assign_sub(amount), b.assign_add(amount)))
                step += 1
            return
        try:
            for _ in range(reads_per_reader):
                sa, sb = safevars.snapshot([a, b])
                total = float(sa.value) + float(sb.value)
                if total != 1000.0 or sa.version != sb.version:
                    broken.append((float(sa.value), float(sb.value)))
        finally:
            if i == 1:
                stop.set()

    run_threads(readers + 1, role)
    assert a.version == b.version > 0
    assert not broken, f"torn snapshots: {broken[:5]}"


def test_a_snapshot_of_one_lock_takes_every_lock_if_a_variable_moved_meanwhile(monkeypatch):
    """A snapshot of variables sharing one lock takes that lock alone; if ``share_lock``
    moved one of them to another lock between the snapshot's look at the locks and its
    acquisition, it takes both (``hold``), never reading the moved one unlocked."""
    from safevars.locking import Guard, share_lock

    c = SafeVariable(0.0)  # Its lock comes first in the order: a share_lock targets it.
    a, b = SafeVariable(1.0), SafeVariable(2.0)
    assert share_lock([a.guard, b.guard])
    shared, other = a.guard.lock, c.guard.lock
    original = Guard.call_locked
    moved_at = []  # other.seq once b moved (share_lock takes and releases it too)

    def moved_first(self, fn, writes=0, timeout=None, reader=False):
        if b.guard.lock is shared:  # (once)
            assert share_lock([b.guard, c.guard]) and b.guard.lock is other
            moved_at.append(other.seq)
        return original(self, fn, writes, timeout, reader)

    monkeypatch.setattr(Guard, "call_locked", moved_first)
    for lock in (shared, other):
        lock.contended = 4  # past an optimistic read: straight to the locks
    x, y = safevars.snapshot([a, b])
    assert (float(x.value), float(y.value)) == (1.0, 2.0)
    assert other.seq == moved_at[0] + 2  # b's new lock was taken and released
    assert not shared._slot and not other._slot


def test_readers_do_not_wait_for_readers(monkeypatch):
    """A snapshot completes while another reader is parked inside its read."""
    from safevars import _tf_internal

    v = SafeVariable(1.0)
    parked, release = threading.Event(), threading.Event()
    calls = {"n": 0}

    def parking(original):
        def slow_read(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                parked.set()
                release.wait(JOIN_TIMEOUT)
            return original(*args, **kwargs)

        return slow_read

    # An eager snapshot reads with one of these (several variables' values and versions
    # at once where it can).
    for read in ("read_eagerly", "read_variables"):
        monkeypatch.setattr(_tf_internal, read, parking(getattr(_tf_internal, read)))
    try:
        t = threading.Thread(target=v.snapshot, daemon=True)
        t.start()
        assert parked.wait(JOIN_TIMEOUT)
        assert v.snapshot().version == 0  # did not block on the parked reader
    finally:
        release.set()
        t.join(JOIN_TIMEOUT)
    assert not t.is_alive()


def test_snapshots_make_progress_under_a_writer_that_never_pauses():
    """Issue #17: under a busy writer the optimistic reader used to retry, re-reading
    tensors while the writer kept writing (9-18 snapshots in the window where locked
    reads completed 537). Now a failed optimistic read falls back to the locks at once,
    so a snapshot waits for one transaction at most, never for the writer to pause.

    A writer commits transactions over ``a, b`` back to back until the reader has taken
    its snapshots and seen the writer commit between them: every snapshot is consistent
    (the sum, and both versions equal) and the versions never go back. A reader that
    waits for the writer to pause, or a writer the reader starves, never finishes:
    ``run_threads`` fails it as a deadlock. How fast a snapshot is against a locked read
    under that writer is a goal of the benchmark suite (``snapshot/2 variables, busy
    writer``), not of a test; that a waiting snapshot is let in before the writer enters
    again is the hand-over tests' below.
    The exact bound on re-reads is the next test's (each variable read at most twice).
    """
    a, b = SafeVariable(1000.0), SafeVariable(0.0)
    snapshots = 200

    def move():
        a.assign_sub(1.0)
        b.assign_add(1.0)

    reader_done = threading.Event()
    seen: list[tuple[float, int, int]] = []

    def role(i):
        if i == 0:
            while not reader_done.is_set():
                safevars.transaction([a, b], move)
        else:
            try:  # (until the writer has committed between snapshots a few times)
                while len(seen) < snapshots or len({s[1] for s in seen}) < 3:
                    x, y = safevars.snapshot([a, b])
                    seen.append((float(x.value) + float(y.value), x.version, y.version))
            finally:
                reader_done.set()

    run_threads(2, role)
    torn = [s for s in seen if s[0] != 1000.0 or s[1] != s[2]]
    assert not torn, f"a snapshot was torn (sum, version of a, version of b): {torn[:5]}"
    versions = [s[1] for s in seen]
    assert versions == sorted(versions), "a later snapshot saw an older version"


def test_a_writer_leaves_the_free_lock_to_a_snapshot_waiting_for_it(monkeypatch):
    """``threading.Lock`` is not fair: a writer that releases a lock and enters it again
    at once took it back before a waiting snapshot woke, section after section (the
    busy-writer benchmark measured snapshots 1.75-2.02x slower than locked reads). Now a
    thread entering a lock that a snapshot waits for leaves it, free, to the snapshot.

    This thread stands for the waiting snapshot (registered as one registers itself);
    a writer arrives and must not take the free lock until the snapshot has had it. The
    hand-over's bound (10 ms, for a snapshot that does not wake) is raised to a deadlock
    bound, so a slow machine cannot fail the test; the half second the writer is given
    only lets a writer that barges in do so (as it did: checked by removing the yield).
    """
    from safevars.locking import acquisition, hold

    monkeypatch.setattr(acquisition, "_HANDOFF", scaled(60))
    v = SafeVariable(0.0)
    lock = v.guard.lock
    snapshot_thread = threading.current_thread()
    lock.readers.append(snapshot_thread)
    writer = threading.Thread(target=v.assign_add, args=(1.0,), daemon=True)
    try:
        writer.start()
        writer.join(0.5)
        assert writer.is_alive() and v.version == 0, "the writer took a lock a snapshot waits for"
        with hold([v.guard], reader=True):  # the snapshot's turn
            assert v.version == 0 and float(v.read_value()) == 0.0
    finally:
        lock.readers.remove(snapshot_thread)
    writer.join(JOIN_TIMEOUT)
    assert not writer.is_alive() and v.version == 1 and float(v.read_value()) == 1.0
    assert not v.statistics().locked and lock.readers == []


def test_snapshots_taken_back_to_back_never_shut_a_writer_out():
    """The other side of letting snapshots in first: two threads taking snapshots back
    to back, and a writer committing 100 transactions among them. Once a snapshot has
    the lock the writer waits for it as any waiter does, so it finishes (a writer shut
    out would hit ``run_threads``' deadlock bound), and every snapshot is consistent."""
    a, b = SafeVariable(1000.0), SafeVariable(0.0)
    transactions = 100
    writer_done = threading.Event()
    torn = []

    def move():
        a.assign_sub(1.0)
        b.assign_add(1.0)

    def role(i):
        if i == 0:
            try:
                for _ in range(transactions):
                    safevars.transaction([a, b], move)
            finally:
                writer_done.set()
        else:
            while not writer_done.is_set():
                x, y = safevars.snapshot([a, b])
                if float(x.value) + float(y.value) != 1000.0 or x.version != y.version:
                    torn.append((x, y))

    run_threads(3, role)
    assert not torn, torn[:3]
    assert (a.version, b.version) == (transactions, transactions)
    assert float(b.read_value()) == transactions and a.guard.lock.readers == []


@pytest.mark.parametrize("count", [1, 2], ids=["one lock", "two locks"])
def test_a_snapshot_that_waits_comes_between_two_sections_of_a_writer(monkeypatch, count):
    """The whole path: a snapshot that finds a writer in waits for the lock, registered
    (on the first lock of its global order when there are two), and is taken between the
    writer's section and the one it enters right after. Without the hand-over this one
    race usually goes to the snapshot anyway (its thread wakes while the writer runs
    Python: it failed 1 run in 5 with the hand-over removed); the test that fails then
    is ``test_a_writer_leaves_the_free_lock_to_a_snapshot_waiting_for_it``."""
    from safevars.locking import acquisition, sorted_locks

    monkeypatch.setattr(acquisition, "_HANDOFF", scaled(60))
    variables = [SafeVariable(0.0) for _ in range(count)]
    first = sorted_locks([v.guard for v in variables])[0]

    def bump():
        for v in variables:
            v.assign_add(1.0)

    section = safevars.locked(*variables)
    section.__enter__()
    bump()  # version 1, inside the writer's first section
    taken = []
    reader = threading.Thread(
        target=lambda: taken.append(safevars.snapshot(variables)), daemon=True
    )
    reader.start()
    deadline = time.monotonic() + scaled(60)
    while not first.readers and time.monotonic() < deadline:
        time.sleep(0.001)
    try:
        assert first.readers == [reader], "the snapshot never waited for the lock"
    finally:
        section.__exit__(None, None, None)
    safevars.transaction(variables, bump)  # the writer enters again at once: version 2
    reader.join(JOIN_TIMEOUT)
    assert not reader.is_alive()
    assert [s.version for s in taken[0]] == [1] * count, "the writer took the lock back first"
    assert [float(s.value) for s in taken[0]] == [1.0] * count
    assert [v.version for v in variables] == [2] * count and not first.readers


def test_a_registration_no_snapshot_waits_behind_delays_a_writer_once():
    """A snapshot's registration that outlives its wait (an interrupt between registering
    and waiting) is dropped by the next writer after one hand-over bound: later writers
    do not wait for it."""
    v = SafeVariable(0.0)
    lock = v.guard.lock
    lock.readers.append(threading.Thread(target=print))  # no snapshot is waiting
    v.assign_add(1.0)
    assert lock.readers == [] and v.version == 1 and float(v.read_value()) == 1.0
    assert not v.statistics().locked


@pytest.mark.parametrize("taped", [False, True], ids=["one read op", "a read op each"])
def test_a_snapshot_reads_each_variable_at_most_twice_under_a_busy_writer(monkeypatch, taped):
    """The bound behind the progress guarantee: one optimistic read, then one read under
    the locks; never a retry loop re-reading tensors while writers keep writing.

    A writer is made to commit a transaction in the middle of *every* unlocked read
    (deterministically, from the read kernel), which is what a writer that never pauses
    does at worst: each optimistic attempt fails. Eagerly a snapshot reads its
    variables with one op; under a gradient tape with one read op each (which the tape
    can differentiate), between which a writer can commit.
    """
    from tensorflow.python.ops import gen_resource_variable_ops

    from safevars import _tf_internal

    a, b = SafeVariable(1000.0), SafeVariable(0.0)
    reads = [0]
    reader = threading.get_ident()

    def move():
        a.assign_sub(1.0)
        b.assign_add(1.0)

    def interrupted_by_a_writer(original, variables):
        def read(*args, **kwargs):
            if threading.get_ident() != reader:  # the writer's own reads (rollback copy)
                return original(*args, **kwargs)
            reads[0] += variables(args)
            if not a.statistics().locked:  # Not under the locks: a writer slips in.
                writer = threading.Thread(target=safevars.transaction, args=([a, b], move))
                writer.start()
                writer.join(JOIN_TIMEOUT)
                assert not writer.is_alive()
            return original(*args, **kwargs)

        return read

    # One read op per variable, or one for all of them (_tf_internal.read_variables).
    monkeypatch.setattr(
        gen_resource_variable_ops,
        "read_variable_op",
        interrupted_by_a_writer(gen_resource_variable_ops.read_variable_op, lambda a: 1),
    )
    monkeypatch.setattr(
        _tf_internal,
        "read_variables",
        interrupted_by_a_writer(_tf_internal.read_variables, lambda a: len(a[0])),
    )
    for _ in range(5):
        reads[0] = 0
        with tf.GradientTape() if taped else contextlib.nullcontext():
            x, y = safevars.snapshot([a, b])
        assert reads[0] <= 4, f"{reads[0]} reads for one snapshot of 2 variables"
        assert float(x.value) + float(y.value) == 1000.0
        assert float(x.value) + x.version == 1000.0
    # Writers got into the first snapshot's optimistic read(s): one per read op.
    assert a.version >= (2 if taped else 1)


def test_snapshot_converts_like_an_array():
    v = SafeVariable([[1.0, 2.0]])
    snap = v.snapshot()
    assert snap.shape == (1, 2) and snap.dtype == tf.float32
    np.testing.assert_array_equal(np.asarray(snap), [[1.0, 2.0]])
    assert np.asarray(snap, dtype=np.float64).dtype == np.float64
    v.assign([[3.0, 4.0]])
    np.testing.assert_array_equal(np.asarray(snap), [[1.0, 2.0]])


def test_plain_keras_variables_and_layers_share_the_wrap_lock(mode):
    plain = tf.Variable(1.0)
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    safe = safevars.wrap(plain)
    mode(lambda: safe.assign_add(1.0))()
    # A plain layer's weights are wrapped on the fly when named explicitly; the layer
    # itself is refused (NotProtectedError: its Keras writes would not be locked).
    with pytest.raises(safevars.NotProtectedError, match=r"safevars.protect\(layer\)"):
        mode(lambda: safevars.snapshot({"plain": plain, "layer": layer}))()
    out = mode(lambda: safevars.snapshot({"plain": plain, "layer": layer.weights}))()
    if mode.name == "eager":
        assert out["plain"].version == 1 and float(out["plain"].value) == 2.0
        assert [s.name for s in out["layer"]] == [w.value.name for w in layer.weights]
    else:
        assert float(out["plain"]) == 2.0 and len(out["layer"]) == 2
    assert safevars.wrap(layer.kernel).guard is safevars.wrap(layer.kernel.value).guard
