"""Taking one lock: the acquire that records its holder, takeovers, the run-time mutex.

* :func:`enter` takes a lock the calling thread does not hold and opens its section
  (depth 1, odd sequence number, where it was taken, the run-time mutex), or leaves it
  not held on any exception.
* :func:`_take` acquires the ``threading.Lock`` and records the holder in one C call:
  an interrupt lands either before (nothing taken) or after (the holder's handler sees
  itself in the slot).
* A waiter looks every ``_POLL`` seconds for a holder thread that has ended and takes
  its lock back (:func:`_take_back`, serialized by ``_TAKEOVER``).
* A snapshot waiting for a lock (``reader``) is let in first: a thread entering the
  lock while one waits leaves it, free, to the snapshot for up to ``_HANDOFF`` seconds
  (:func:`_yield_to_readers`). ``threading.Lock`` is not fair: a writer that releases
  and takes the lock again back to back took it before a waiting snapshot woke, so
  under a writer that never pauses a snapshot waited for many of its sections. Once
  the snapshot has the lock, the writer waits for it as any waiter does: a thread
  taking snapshots back to back slows a writer as much as one taking locked reads
  back to back does (measured: see ``_yield_to_readers``), not more.
* In run-time mode an eager section also takes the lock's ``tf.CriticalSection`` mutex
  (:func:`_mutex_lock`; in a helper thread when there is a timeout) while a call of a
  function whose graph takes it runs (:func:`admit_call`), or always once the lock is
  ``untracked``. A lock in run-time
  mode that no live graph uses any more is switched back to eager mode first, by the
  hook :mod:`~safevars.locking.runtime_mode` registers (``LEAVE_RUNTIME``).
* :func:`check_timeout` checks a ``timeout`` argument, and :func:`_timeout_error` says
  who holds the lock when a wait runs out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from safevars import _tf_internal as tfi
from safevars.distribute import on_parameter_server
from safevars.errors import InvalidArgumentError, LockTimeoutError, UnsupportedStrategyError
from safevars.locking.ownership import _caller_location
from safevars.locking.section_lock import holder_of

if TYPE_CHECKING:
    from safevars.locking.section_lock import SectionLock


_TAKEOVER = threading.Lock()  # Serializes taking a lock back from a dead holder.
_POLL = 0.25  # Seconds between dead-holder checks while waiting for a lock.
# Seconds a thread entering a lock leaves it, free, to a snapshot waiting for it at most,
# and how often it looks whether the snapshot took it. Bounded: a snapshot that does not
# wake in time (or a registration an interrupt left behind) costs a writer this once.
_HANDOFF = 0.01
_HANDOFF_POLL = 5e-5

# runtime_mode.leave_runtime (a layer above): switches a lock that no live graph uses
# back to eager mode; called with the lock just taken.
LEAVE_RUNTIME: list[Callable[[SectionLock], None]] = []


def _check_coordinator(lock: SectionLock) -> None:
    if lock.mutexed and lock.graph_users and on_parameter_server(lock.device):
        # An eager MutexLock from the coordinator on a parameter server's mutex,
        # while scheduled steps take it too, was measured to hang: refuse instead.
        raise UnsupportedStrategyError(
            f"{lock.name!r} lives on a parameter server and is locked by tf.functions "
            "there; an eager write, transaction or snapshot from the coordinator "
            "cannot take that lock safely. Do it inside a tf.function (scheduled with "
            "ClusterCoordinator.schedule, or called on the coordinator)."
        )


def enter(
    lock: SectionLock,
    me: threading.Thread,
    timeout: float | None,
    reader: bool = False,
    where: str | None = None,
) -> None:
    """Takes ``lock`` for ``me`` (which does not hold it) and opens the section.

    On return the lock is held with depth 1 and an odd sequence number; on an
    exception (timeout, interrupt) it is not held. The caller checked the order.
    ``reader``: the section only reads (a snapshot); while it waits, threads entering
    the lock leave it to the snapshot first (:func:`_yield_to_readers`). ``where``: what
    took the lock, for ``statistics().where`` and ``held_locks()``; by default the
    ``file:line`` of the caller outside safevars (a walk up the stack).
    """
    _check_coordinator(lock)
    slot = lock._slot
    try:
        if lock.readers and not reader:
            timeout = _yield_to_readers(lock, me, timeout)
        _take(lock, me, timeout, reader)
        lock._depth = 1
        lock.seq += 1
        lock._since = time.monotonic()
        lock._where = _caller_location() if where is None else where
        if lock.runtime and not lock.graph_users:  # every graph using it is gone
            LEAVE_RUNTIME[0](lock)
        if lock.mutexed and (lock.graph_calls or lock.untracked):
            lock._token = _mutex_lock(lock, timeout)
    except BaseException:
        if me in slot:  # Taken in this call: give it back, no calls first.
            if lock.seq & 1:
                lock.seq += 1
            lock._depth = 0
            lock._token = None
            del slot[:]
            lock._mutex.release()
        raise


def admit_call(lock: SectionLock, me: threading.Thread, token: object) -> None:
    """Counts an eager call of a function whose graph takes ``lock``'s mutex as running
    (``token`` in ``lock.graph_calls``), once no eager section holds ``lock``.

    An eager section takes the mutex only while such a call runs (or always, once the
    lock is ``untracked``): a ``MutexLock`` op hands the lock over on the mutex's own
    thread, 100 µs here, the largest part of a small eager section. Taking the lock to
    add the token orders the two: a section that found no call running holds the lock
    until it ends, so the call waits for it here; a call admitted before the section
    took the lock is in ``graph_calls``, and the section takes the mutex. ``me`` does
    not hold ``lock`` (the caller checked: the call would wait on itself).
    """
    _briefly(lock, me, lambda: lock.graph_calls.append(token))


def mark_untracked(locks: Iterable[SectionLock]) -> None:
    """Marks ``locks`` ``untracked``: a graph taking their mutexes may run outside any
    counted call, so every eager section takes the mutex from now on.

    Set with each lock taken, so a section that skipped the mutex has ended first. A lock
    the calling thread holds (tracing a tf.data function inside ``safevars.locked``)
    takes its mutex now, for the rest of the section.
    """
    me = threading.current_thread()
    for lock in locks:
        if lock.untracked:
            continue
        slot = lock._slot
        if me in slot:
            lock.untracked = True
            if lock.mutexed and lock._token is None:
                with tfi.ops.init_scope():  # (called while tracing: run it eagerly)
                    lock._token = _mutex_lock(lock, None)
            continue
        _briefly(lock, me, _untracking(lock))


def _untracking(lock: SectionLock) -> Callable[[], None]:
    def untrack() -> None:
        lock.untracked = True

    return untrack


def _briefly(lock: SectionLock, me: threading.Thread, change: Callable[[], None]) -> None:
    """Takes ``lock`` (not held by ``me``), runs ``change`` and releases it, without
    opening a section: a section over the lock either ended before ``change`` or begins
    after it. Given back on any exception, an interrupt included: ``_take`` records the
    holder in the same C call that acquires, inside the ``try``."""
    slot = lock._slot
    try:
        _take(lock, me, None)
        change()
    finally:
        if me in slot:
            del slot[:]
            lock._mutex.release()


def _yield_to_readers(
    lock: SectionLock, me: threading.Thread, timeout: float | None
) -> float | None:
    """Leaves ``lock``, while it is free, to the snapshots waiting for it
    (``lock.readers``, other than ``me``) for ``_HANDOFF`` seconds at most (and never
    past ``timeout``); returns what is left of ``timeout``.

    The thread entering holds nothing of ``lock``, and a snapshot holds no lock that sorts
    after the one it waits for (the global order): once it has the lock, it needs nothing
    the entering thread holds, so leaving it the lock cannot deadlock. A registration
    still there after a whole ``_HANDOFF`` with the lock free belongs to no waiting
    snapshot (an interrupt between registering and waiting) or to one too slow to wake:
    it is dropped, so that it delays no other thread.

    Measured (2026-11-30, 2 cores): a thread in transactions over two variables back to
    back, beside a thread taking snapshots of them back to back: before, 439-494
    snapshots and 5,846-6,023 transactions a second; now 6,522 and 1,252. Beside a
    thread taking locked reads back to back instead (no preference): 5,279-6,071 reads
    and 1,551-1,924 transactions. Alone the writer does 8,600-9,400.
    """
    start = time.monotonic()
    handoff = _HANDOFF if timeout is None else min(_HANDOFF, timeout)
    readers = lock.readers
    while not lock._slot and any(thread is not me for thread in readers):
        if time.monotonic() - start >= handoff:
            if handoff == _HANDOFF:  # (the lock still free: the loop's condition)
                del readers[:]
            break
        time.sleep(_HANDOFF_POLL)  # (the GIL released: the snapshot's thread runs)
    return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


def _take(
    lock: SectionLock, me: threading.Thread, timeout: float | None, reader: bool = False
) -> None:
    """Acquires ``lock._mutex`` and records ``me`` in ``lock._slot`` in one C call.

    ``compress((me,), map(acquire, ...))`` yields ``me`` only if ``acquire`` returned
    True, and ``list.extend`` appends it inside the same call: there is no check point
    between taking the mutex and recording the holder, so an interrupt either comes
    before (nothing taken) or after (the holder's handler sees itself in the slot).
    A ``reader`` that has to wait is in ``lock.readers`` while it waits.

    Raises:
      LockTimeoutError: ``timeout`` seconds passed; nothing is held.
    """
    slot, mutex = lock._slot, lock._mutex
    slot.extend(itertools.compress((me,), map(mutex.acquire, (False,))))
    if me in slot:
        return
    if not reader:
        _wait(lock, me, timeout)
        return
    lock.readers.append(me)
    try:
        _wait(lock, me, timeout)
    finally:
        with contextlib.suppress(ValueError):  # (dropped by _yield_to_readers)
            lock.readers.remove(me)


def _wait(lock: SectionLock, me: threading.Thread, timeout: float | None) -> None:
    """The blocking part of :func:`_take`: waits for ``lock._mutex``, looking every
    ``_POLL`` seconds for a holder that has ended."""
    slot, mutex = lock._slot, lock._mutex
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
        slot.extend(itertools.compress((me,), map(mutex.acquire, (True,), (wait,))))
        if me in slot:
            return
        holder = holder_of(slot)
        if holder is not None and not holder.is_alive() and _take_back(lock, holder, me):
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise _timeout_error([lock], timeout)


def _take_back(lock: SectionLock, dead: threading.Thread, me: threading.Thread) -> bool:
    """Makes ``me`` the holder of a lock whose holder thread has ended.

    A thread can end while holding a lock only by leaving a section it entered by hand
    (``locked(v).__enter__()``) open: every write it made inside was complete, so the
    variables are consistent and the lock is handed over as it is (mutex still taken),
    its run-time mutex released and a fresh section opened for ``me``.
    """
    with _TAKEOVER:
        slot = lock._slot
        if dead not in slot:
            return False
        lock._token = None
        if lock.seq & 1:
            lock.seq += 1
        lock.takeovers += 1
        slot[0] = me
        lock._depth = 0
    return True


def _mutex_lock(lock: SectionLock, timeout: float | None) -> Any:
    """Takes the lock's ``tf.CriticalSection`` mutex eagerly; the tensor holds it.

    A ``MutexLock`` op cannot time out. With a timeout, it runs in a helper thread and
    is waited for with that timeout; if it does not finish in time, the helper's tensor
    is dropped as soon as the op returns (releasing the mutex again) and
    :class:`LockTimeoutError` is raised.
    """
    if timeout is None:
        return tfi.mutex_lock(lock.cs._handle)
    future = _mutex_pool().submit(tfi.mutex_lock, lock.cs._handle)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        future.add_done_callback(_drop_result)
        raise _timeout_error([lock], timeout, runtime=True) from None


def _drop_result(future: concurrent.futures.Future[Any]) -> None:
    future._result = None  # releases the TF mutex


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _mutex_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="safevars-mutex"
            )
        return _POOL


def _timeout_error(
    locks: Sequence[SectionLock], timeout: float | None, runtime: bool = False
) -> LockTimeoutError:
    for lock in () if runtime else locks:  # (runtime: the caller holds the eager lock)
        record = lock.held_record(time.monotonic())
        if record is not None:
            who = (
                f"held by thread {record.thread_name!r} (ident {record.thread_ident}"
                f"{'' if record.thread_alive else ', ended'}) for {record.held_for:.2f}s, "
                f"taken at {record.where}"
            )
            names = lock.names
            break
    else:
        names = [n for lock in locks for n in lock.names]
        who = (
            "held by a running tf.function (a graph section holds its mutex)"
            if runtime
            else "released just as the wait ended"
        )
    return LockTimeoutError(
        f"Timed out after {timeout}s waiting for the lock of {', '.join(map(repr, names))}: "
        f"{who}. Nothing was changed. safevars.held_locks() lists every lock held now; "
        "pass a longer timeout, or find why the holder does not release."
    )


def check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
        raise InvalidArgumentError(
            f"timeout must be None (wait for ever) or a number of seconds >= 0, got {timeout!r}."
        )
    return float(timeout)
