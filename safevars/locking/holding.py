"""hold: the context that holds several locks at once, in the global lock order.

``safevars.locked`` returns a :class:`hold`; transactions, snapshots and checkpoints
hold their locks with one. It takes the locks in the order of
:mod:`safevars.locking.lock_order`, re-enters those the thread holds already, and
releases them innermost first with a release that is safe at any bytecode; a context
that is never closed releases its locks when it is garbage-collected. :func:`hold_locks`
holds locks directly, for code that has no guard at hand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from safevars.locking.acquisition import enter
from safevars.locking.lock_order import HasLock, _check_order, sorted_locks
from safevars.locking.ownership import _current_thread, _held, _holding

if TYPE_CHECKING:
    from safevars.locking.section_lock import SectionLock


class _Hold:
    """What :class:`hold` does, without a finalizer (the class of a closed context).

    A context switches to this class once it has released everything, so that dropping
    it runs no Python finalizer: a ``KeyboardInterrupt`` whose handler happened to run
    in a finalizer would be swallowed ("Exception ignored in ...").
    """

    __slots__ = ("_n", "_locks", "_timeout", "_guards", "_reader", "_where")

    def __init__(
        self, guards: Iterable[HasLock], timeout: float | None = None, reader: bool = False
    ) -> None:
        self._n = 0  # How many of _locks this context holds (a prefix, in order).
        self._guards: list[HasLock] | None = list(guards)
        self._locks = sorted_locks(self._guards)
        self._timeout = timeout
        self._reader = reader  # Only reads (a snapshot): let in first while it waits.
        self._where: str | None = None  # What took the locks (None: the caller's line).

    def __enter__(self) -> None:
        me = _current_thread()
        while True:
            self._take_all(me)
            if self._guards is None or sorted_locks(self._guards) == self._locks:
                return None
            self._release()  # share_lock regrouped the guards while we waited.
            self._locks = sorted_locks(self._guards)

    def _take_all(self, me: threading.Thread) -> None:
        self.__class__ = hold  # Open: released by the finalizer if never closed.
        locks = self._locks
        held = _held()
        new = [lock for lock in locks if not _holding(lock, me)]
        if new and held:
            _check_order(held, new[0], me)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        try:
            for index, lock in enumerate(locks):
                if me in lock._slot:
                    lock._depth += 1
                    self._n = index + 1
                    continue
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                enter(lock, me, remaining, self._reader, self._where)
                self._n = index + 1
                held.append(lock)
        except BaseException:
            n = self._n
            if n < len(locks) and locks[n] in new and locks[n].holder() is me:
                self._n = n + 1  # taken, then interrupted before it was counted
            self._release()
            raise

    def _release(self, *exc: object) -> None:
        """Releases what this context holds, innermost first; safe at any bytecode."""
        locks = self._locks
        while self._n:
            self._n -= 1
            lock = locks[self._n]
            lock._depth -= 1
            if not lock._depth:
                lock.seq += 1
                lock._token = None
                del lock._slot[:]
                lock._mutex.release()
        self.__class__ = _Hold  # Closed: nothing left for a finalizer to do.
        _prune(_held())

    __exit__ = _release


def _prune(held: list[SectionLock]) -> None:
    """Drops the locks at the end of this thread's held list that it no longer holds (a
    stale entry would keep a lock, and its mutex, alive after its variables are gone)."""
    me = _current_thread()
    while held and not _holding(held[-1], me):
        held.pop()


class hold(_Hold):  # noqa: N801 - used like a function: ``with hold(guards):``
    """Context manager holding the eager locks of ``guards`` (global order, re-entrant).

    ``safevars.locked`` returns one. Raises :class:`LockOrderError` before taking
    anything if the calling thread already holds a lock that sorts after one it would
    newly take, and :class:`LockTimeoutError` (nothing held) if ``timeout`` runs out.

    ``reader=True`` (snapshots): the block only reads, and while it waits for a lock,
    threads entering that lock leave it to the block first (for a bounded time: see
    :mod:`safevars.locking.acquisition`).

    Thread safety: the locks belong to the thread that entered; any thread may close
    the context (``__exit__``) and so release them. A context that is never closed (an
    interrupt at the first instruction of ``__exit__``, or a context entered by hand and
    dropped) releases its locks when it is garbage-collected.
    """

    __slots__ = ()

    def __del__(self) -> None:
        try:
            held = self._n
        except AttributeError:  # __init__ was interrupted before anything was taken.
            return
        if held:
            self._release()


def hold_locks(locks: Sequence[SectionLock], where: str | None = None) -> hold:
    """A :class:`hold` over locks directly (for code that has no guard at hand).

    ``where``: what takes them, as the locks' statistics and :func:`held_locks` report
    it; by default the ``file:line`` that called safevars.
    """
    context = hold([])
    context._guards = None
    context._locks = sorted(set(locks), key=lambda lock: lock.order)
    context._where = where
    return context
