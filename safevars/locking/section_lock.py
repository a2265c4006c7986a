"""SectionLock: the lock of one variable, or of several that share_lock joined.

The lock's state: its holder and re-entrant depth, the sequence number optimistic
snapshot readers validate against (odd while a section is open), and, once in run-time
mode, the ``tf.CriticalSection`` whose mutex graph sections take (see
:mod:`safevars.locking` for the two lock levels). Taking it is
:mod:`~safevars.locking.acquisition`, switching it to run-time mode
:mod:`~safevars.locking.runtime_mode`. ``_ORDER`` draws each lock's place in the global
order; ``_GUARDS_BY_LOCK`` maps each lock to the guards (variables) under it, typed by
what a lock needs of them (:class:`LockMember`).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Protocol

from safevars.locking.statistics import _LOCKS, HeldLock

_ORDER = itertools.count()  # Each lock's place in the global lock order (lock_order.py).


def holder_of(slot: list[threading.Thread]) -> threading.Thread | None:
    """The thread in a lock's slot, or None, read once: safe while the holder, another
    thread, empties the slot (a list iterator stops at the list's current end)."""
    for thread in slot:
        return thread
    return None


class SectionLock:
    """The lock of one variable, or of several that :func:`share_lock` joined.

    Ownership: held by one thread at a time (a ``threading.Thread`` object, so a new
    thread that reuses an ended thread's identifier is a different holder) and
    re-entrant for it. Any thread may release a section another thread opened (closing a
    kept ``safevars.locked`` context); the underlying ``threading.Lock`` allows it.

    Fields are changed only by the thread that holds ``_mutex`` (or that takes it back
    from a dead holder under ``_TAKEOVER``); ``seq`` and ``_slot`` are read without it by
    optimistic readers, which re-validate.
    """

    __slots__ = (
        "order",
        "device",
        "names",
        "_mutex",
        "_slot",
        "_depth",
        "seq",
        "_token",
        "_since",
        "_where",
        "runtime",
        "mutexed",
        "cs",
        "cs_deleter",
        "gate",
        "graph_users",
        "leaving",
        "takeovers",
        "contended",
        "readers",
        "graph_calls",
        "untracked",
        "__weakref__",
    )

    def __init__(self, name: str, device: str) -> None:
        self.order = next(_ORDER)
        self.device = device
        self.names: list[str] = [name]
        self._mutex = threading.Lock()
        self._slot: list[threading.Thread] = []  # [holder] while held, [] while free.
        self._depth = 0
        self.seq = 0
        self._token: Any = None  # The MutexLock tensor of an eager run-time section.
        self._since = 0.0
        self._where = ""
        self.runtime = False
        self.mutexed = False  # Eager sections take the mutex too (see runtime_mode.py).
        self.cs: Any = None
        self.cs_deleter: Any = None  # Destroys the mutex resource when dropped.
        self.gate: Any = None  # Run-time mode: the variable whose read opens a section.
        # One token per live graph using the lock (runtime_mode.use_in_graph); appended
        # and removed by single C calls, so a graph's finalizer needs no lock.
        self.graph_users: list[object] = []
        self.leaving = False  # A switch back to eager mode is under way (runtime_mode).
        self.takeovers = 0
        self.contended = 0  # Snapshots left that skip the optimistic read (variable/snapshots.py).
        # Threads of snapshots waiting for the lock, let in first (acquisition.py);
        # appended and removed by single C calls.
        self.readers: list[threading.Thread] = []
        # One token per eager call, running now, of a function whose graph takes the
        # mutex (acquisition.admit_call); appended and removed by single C calls. While
        # none runs and the lock is not ``untracked``, eager sections skip the mutex.
        self.graph_calls: list[object] = []
        # A graph taking the mutex may run outside such a call (a tf.data function, a
        # call on an asynchronous executor, a TF1 graph): eager sections always take it.
        self.untracked = False
        _LOCKS.add(self)

    @property
    def graph_uses(self) -> int:
        """How many live traced graphs use this lock (sections, version reads)."""
        return len(self.graph_users)

    @property
    def name(self) -> str:
        return self.names[0] if len(self.names) == 1 else "+".join(self.names)

    def holder(self) -> threading.Thread | None:
        return holder_of(self._slot)

    def held_record(self, now: float) -> HeldLock | None:
        thread = holder_of(self._slot)
        if thread is None:
            return None
        return HeldLock(
            variables=tuple(self.names),
            thread_name=thread.name,
            thread_ident=thread.ident,
            thread_alive=thread.is_alive(),
            held_for=max(0.0, now - self._since),
            where=self._where,
            depth=self._depth,
            runtime_mode=self.mutexed,
        )


class LockMember(Protocol):
    """What a lock needs of a variable under it (a :class:`~safevars.locking.Guard`)."""

    name: str
    _version: int
    version_var: Any
    graph_reads: int

    def store_version(self) -> None:
        """Writes the eager version into the version variable (run-time mode begins)."""

    def _joint_value(self) -> int:
        """The joint counter's share of the version (0 without one), eagerly."""


_GUARDS_BY_LOCK: weakref.WeakKeyDictionary[SectionLock, weakref.WeakSet[LockMember]] = (
    weakref.WeakKeyDictionary()
)


def _guards_of_lock(lock: SectionLock) -> list[LockMember]:
    return list(_GUARDS_BY_LOCK.get(lock, ()))
