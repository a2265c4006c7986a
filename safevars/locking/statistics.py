"""What a debugger or a watchdog sees: a variable's lock statistics, the locks held now.

:class:`LockStatistics` is the frozen record ``SafeVariable.statistics()`` returns.
:func:`held_locks` lists every lock held right now (:class:`HeldLock`) from ``_LOCKS``,
the set of live locks every :class:`~safevars.locking.section_lock.SectionLock` joins.
``DUPLICATE_COUNTERS`` is the hook where :mod:`safevars.exactly_once` registers the
counters behind :attr:`LockStatistics.duplicates_discarded`. The bottom of
:mod:`safevars.locking`: it imports none of the package's other modules.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class LockStatistics(NamedTuple):
    """A frozen record of one variable's lock and version state, for debugging.

    Attributes:
      order: Position of the variable's lock in the global lock order.
      locked: Whether some thread holds the eager lock right now.
      owner: ``threading.get_ident()`` of that thread, or ``None``.
      depth: How many times the holder has entered (re-entrant depth).
      runtime_mode: Whether the lock is also a ``tf.CriticalSection`` mutex and its
        variables keep their versions in variables (set once a variable under it was
        written, versioned or snapshotted in a ``tf.function``, until the last traced
        graph using it is garbage-collected and an eager section switches it back).
      writes: Completed writes recorded eagerly since construction or restore.
      thread_name: Name of the holding thread, or ``None``.
      held_for: Seconds since the holder took the lock, or ``None``.
      where: ``file:line`` where the holder took the lock (for a lock held around an
        eager call of an XLA-compiled ``tf.function``: that function's name), or
        ``None``.
      shared_by: How many variables share this lock (1 unless :func:`share_lock`).
      takeovers: How often a waiter took this lock back from a thread that had ended
        while holding it.
      duplicates_discarded: Retried parameter-server steps whose update to this variable
        was recognised as already applied and skipped (:mod:`safevars.exactly_once`).
      eager_mutex: Whether eager sections take that mutex too: once a graph that is not
        XLA-compiled took it (a lock used only by XLA-compiled functions called eagerly
        needs the Python lock alone; :mod:`safevars.locking.runtime_mode`), while a call
        of a function whose graph takes it runs (or always, for a lock a ``tf.data``
        function or a call on an asynchronous executor takes).
      graph_uses: How many traced graphs alive now use the lock. Run-time mode ends with
        them: once it is 0, the next eager section switches the lock back to eager mode
        (``runtime_mode`` and ``eager_mutex`` False) and frees its mutex.
    """

    order: int
    locked: bool
    owner: int | None
    depth: int
    runtime_mode: bool
    writes: int
    thread_name: str | None = None
    held_for: float | None = None
    where: str | None = None
    shared_by: int = 1
    takeovers: int = 0
    duplicates_discarded: int = 0
    eager_mutex: bool = False
    graph_uses: int = 0


class HeldLock(NamedTuple):
    """One safevars lock held right now (see :func:`held_locks`).

    Attributes:
      variables: Names of the variables under the lock.
      thread_name: Name of the holding thread.
      thread_ident: Its ``threading.get_ident()``.
      thread_alive: Whether that thread is still running (a lock whose holder ended is
        taken back by the next thread that waits for it).
      held_for: Seconds since it was taken.
      where: ``file:line`` (outside safevars) where it was taken; for a lock held
        around an eager call of an XLA-compiled ``tf.function``,
        ``"tf.function 'name' (XLA-compiled), called eagerly"``.
      depth: Re-entrant depth.
      runtime_mode: Whether the holder also holds the lock's ``tf.CriticalSection`` mutex.
    """

    variables: tuple[str, ...]
    thread_name: str
    thread_ident: int | None
    thread_alive: bool
    held_for: float
    where: str
    depth: int
    runtime_mode: bool


class _Recorded(Protocol):
    """What :func:`held_locks` needs of a live lock (a ``SectionLock``)."""

    def held_record(self, now: float) -> HeldLock | None:
        """Who holds the lock, since when, taken where; None while it is free."""


# Every live lock; each SectionLock adds itself when it is made.
_LOCKS: weakref.WeakSet[_Recorded] = weakref.WeakSet()


def held_locks() -> list[HeldLock]:
    """Every safevars lock held right now: by which thread, since when, taken where.

    Cheap enough for a watchdog or a debugger (one pass over the live locks, no lock
    taken). Eager holders only: a running ``tf.function`` holding a run-time mutex is
    not a thread and is not listed.

    Thread safety: a consistent record per lock; locks taken or released during the
    call may or may not appear.

    Modes: eager (Python) state; call it from any thread.
    """
    now = time.monotonic()
    records = [lock.held_record(now) for lock in list(_LOCKS)]
    return sorted((r for r in records if r is not None), key=lambda r: -r.held_for)


# Guard -> a no-argument function returning how many duplicates were discarded for it;
# the hook safevars.exactly_once registers the variables it protects with.
DUPLICATE_COUNTERS: weakref.WeakKeyDictionary[Any, Callable[[], int]] = weakref.WeakKeyDictionary()


def _duplicates_of(guard: object) -> int:
    counter = DUPLICATE_COUNTERS.get(guard)
    return int(counter()) if counter is not None else 0
