"""SectionLock: the lock of one variable, or of several that share_lock joined.

It records its holder and re-entrant depth, the sequence number optimistic snapshot
readers validate against (odd while a section is open), and, once in run-time mode, the
``tf.CriticalSection`` whose mutex graph sections take (see :mod:`safevars.locking` for
the two lock levels). ``_GUARDS_BY_LOCK`` maps each lock to the guards (variables) under
it.
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.distribute import on_parameter_server
from safevars.errors import LockReentryError, UnsupportedStrategyError
from safevars.locking.acquisition import _mutex_lock, _take
from safevars.locking.holding import hold_locks
from safevars.locking.lock_order import _ORDER
from safevars.locking.ownership import _caller_location
from safevars.locking.statistics import _LOCKS, HeldLock

if TYPE_CHECKING:
    from safevars.locking.guard import Guard


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
        "cs",
        "gate",
        "graph_uses",
        "takeovers",
        "contended",
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
        self.cs: Any = None
        self.gate: Any = None  # Run-time mode: the variable whose read opens a section.
        self.graph_uses = 0
        self.takeovers = 0
        self.contended = 0  # Snapshots left that skip the optimistic read (snapshot.py).
        _LOCKS.add(self)

    @property
    def name(self) -> str:
        return self.names[0] if len(self.names) == 1 else "+".join(self.names)

    def holder(self) -> threading.Thread | None:
        slot = self._slot
        return slot[0] if slot else None

    # ------------------------------------------------------------------ taking it

    def _check_coordinator(self) -> None:
        if self.runtime and on_parameter_server(self.device):
            # An eager MutexLock from the coordinator on a parameter server's mutex,
            # while scheduled steps take it too, was measured to hang: refuse instead.
            raise UnsupportedStrategyError(
                f"{self.name!r} lives on a parameter server and is locked by tf.functions "
                "there; an eager write, transaction or snapshot from the coordinator "
                "cannot take that lock safely. Do it inside a tf.function (scheduled with "
                "ClusterCoordinator.schedule, or called on the coordinator)."
            )

    def _enter(self, me: threading.Thread, timeout: float | None) -> None:
        """Takes the lock for ``me`` (which does not hold it) and opens the section.

        On return the lock is held with depth 1 and an odd sequence number; on an
        exception (timeout, interrupt) it is not held. The caller checked the order.
        """
        self._check_coordinator()
        slot = self._slot
        try:
            _take(self, me, timeout)
            self._depth = 1
            self.seq += 1
            self._since = time.monotonic()
            self._where = _caller_location()
            if self.runtime:
                self._token = _mutex_lock(self, timeout)
        except BaseException:
            if slot and slot[0] is me:  # Taken in this call: give it back, no calls first.
                if self.seq & 1:
                    self.seq += 1
                self._depth = 0
                self._token = None
                del slot[:]
                self._mutex.release()
            raise

    # ------------------------------------------------------------------ run-time mode

    def ensure_runtime(self, held_here: bool) -> bool:
        """Switches to run-time mode (idempotent). Called when tracing a graph.

        Returns:
          Whether this call made the switch (so a failed trace can undo it).
        """
        if self.runtime:
            return False
        if held_here:
            raise LockReentryError(
                f"A tf.function that writes, versions or snapshots {self.name!r} is being "
                "traced while this thread holds that variable's lock (inside "
                "safevars.locked or safevars.transaction). Running it there would wait "
                "on the lock its caller holds. Trace and call the function outside the "
                "locked block, or put the whole step inside safevars.transaction([...], "
                "fn) within the tf.function."
            )
        with tf.init_scope(), hold_locks([self]):
            if self.runtime:
                return False
            with tf.device(self.device):
                # A unique shared_name: CriticalSection defaults it to the name, and
                # two variables named alike would share (and deadlock) a mutex.
                self.cs = tf.CriticalSection(
                    name=self.names[0].split(":")[0] + "_safevars_lock",
                    shared_name=f"safevars_lock_{uuid.uuid4().hex}",
                )
                self.gate = tfi.ResourceVariable(
                    initial_value=tf.constant(0, tf.int32),
                    trainable=False,
                    name=self.names[0].split(":")[0] + "_safevars_gate",
                    shape=(),
                )
            for guard in _guards_of_lock(self):
                guard.store_version()
            self.runtime = True
        return True

    def undo_runtime(self) -> None:
        """Leaves run-time mode again if no traced graph uses the mutex yet."""
        with tf.init_scope(), hold_locks([self]):
            if self.runtime and self.graph_uses == 0:
                self.drop_runtime()

    def drop_runtime(self) -> None:
        """Forgets run-time mode and its graph objects (the caller checked no traced
        graph uses them)."""
        self.runtime, self.cs, self.gate = False, None, None

    def held_record(self, now: float) -> HeldLock | None:
        slot = self._slot
        if not slot:
            return None
        thread = slot[0]
        return HeldLock(
            variables=tuple(self.names),
            thread_name=thread.name,
            thread_ident=thread.ident,
            thread_alive=thread.is_alive(),
            held_for=max(0.0, now - self._since),
            where=self._where,
            depth=self._depth,
            runtime_mode=self.runtime,
        )


_GUARDS_BY_LOCK: weakref.WeakKeyDictionary[SectionLock, weakref.WeakSet[Guard]] = (
    weakref.WeakKeyDictionary()
)


def _guards_of_lock(lock: SectionLock) -> list[Guard]:
    return list(_GUARDS_BY_LOCK.get(lock, ()))
