"""Locks, versions and the global lock order: how a critical section is entered eagerly.

Every :class:`~safevars.SafeVariable` owns one :class:`Guard` (its version) and points at
one :class:`SectionLock` (its lock). Usually each variable has a lock of its own;
:func:`share_lock` lets variables that are always updated together (a model's weights
and its optimizer's state) share one, each keeping its own version, so a step over them
takes one lock instead of one per variable. Graph sections (``tf.function``) are in
:mod:`safevars.sections`; this module is the eager half and the bookkeeping both share.

Two lock levels, one order:

* **Eager level.** A ``threading.Lock`` per :class:`SectionLock`, re-entrant for the
  thread that holds it (a holder and a depth), plus a *sequence number* that is odd
  while a section is open. Optimistic snapshot readers (see :mod:`safevars.snapshot`)
  read the sequence numbers before and after reading values and retry on a change.
  Versions live in a Python ``int``: a write costs one uncontended ``Lock.acquire``.
* **Run-time level.** A ``tf.CriticalSection``'s mutex, placed on the variables' device,
  created the first time one of the lock's variables is written, versioned or
  snapshotted inside a ``tf.function``; from then on the lock is in *run-time mode*:
  graph sections take the mutex with a ``MutexLock`` op, eager sections take it too (so
  eager threads and running graphs exclude each other), and versions live in int64
  resource variables next to the values.

Locks are ordered by creation (:attr:`SectionLock.order`). Sections that name several
locks take them in that order, which rules out deadlock. A thread that holds some locks
may take more only in increasing order; anything else raises
:class:`~safevars.LockOrderError` *before* taking any lock.

Faults. The bookkeeping is written so that an exception raised at any bytecode (an
asynchronous exception from ``PyThreadState_SetAsyncExc``, a ``KeyboardInterrupt`` from
SIGINT) leaves every lock either not taken or fully released:

* CPython raises asynchronous exceptions only at *check points* (after a call returns,
  at a function's first instruction, on a backward jump). Acquisition is recorded by the
  same C call that takes the mutex (:func:`_take`), so a handler always knows whether it
  holds the lock; every release is a run of attribute stores with no check point before
  the final ``Lock.release()`` call.
* An eager write and its version count are made by one C call chain
  (:meth:`Guard.write_counted`), so an interrupt cannot land between them: value and
  version stay paired.
* A :class:`hold` (``safevars.locked``) whose ``__exit__`` never ran (an interrupt at its
  first instruction, or a context entered by hand and dropped) releases its locks when it
  is garbage-collected.
* A lock whose holding thread has ended is taken back by the next thread that waits for
  it (:attr:`LockStatistics.takeovers` counts it); a later thread reusing the dead
  thread's identifier is never mistaken for the holder (holders are ``Thread`` objects).

What is not covered: a second asynchronous exception delivered while the handler of
the first is releasing (the same limit as ``contextlib`` and any ``finally`` block), and
distributed variables, whose writes go through Python code between the write and the
count (the lock is still never orphaned).

NOTES:
  Calling a ``tf.function`` that writes ``v`` from inside ``safevars.locked(v)`` once
  ``v`` is in run-time mode would wait on a mutex the caller holds, exactly as nesting
  ``tf.CriticalSection.execute`` would. safevars detects it when the function is traced
  inside the section (raising :class:`~safevars.LockReentryError`) but cannot see a
  function traced elsewhere and merely called inside the section: do not do that.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import operator
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

from safevars import _autograph  # noqa: F401  (registers safevars with AutoGraph)
from safevars import _tf_internal as tfi
from safevars.distribute import on_parameter_server
from safevars.errors import (
    InvalidArgumentError,
    LockOrderError,
    LockReentryError,
    LockTimeoutError,
    UnsupportedStrategyError,
)

__all__ = [
    "Guard",
    "HeldLock",
    "LockStatistics",
    "SectionLock",
    "check_timeout",
    "guard_of",
    "guards_of",
    "held_locks",
    "hold",
    "protect",
    "share_lock",
]

_ORDER = itertools.count()
_local = threading.local()
_LOCKS: weakref.WeakSet[SectionLock] = weakref.WeakSet()
_TAKEOVER = threading.Lock()  # Serializes taking a lock back from a dead holder.
_POLL = 0.25  # Seconds between dead-holder checks while waiting for a lock.
_PACKAGE = __name__.rsplit(".", 1)[0] + "."
_consume = collections.deque(maxlen=0).extend  # Runs an iterator to its end, in C.
_current_thread = threading.current_thread


def _held() -> list[SectionLock]:
    """Locks the calling thread may hold eagerly, in acquisition order.

    Entries are pruned lazily: a lock counts as held only while its holder is the
    calling thread (:func:`_holding`), so a lock released by another thread (a kept
    ``locked`` context closed elsewhere) never confuses the order check.
    """
    try:
        return _local.held
    except AttributeError:
        _local.held = []
        return _local.held


def _holding(lock: SectionLock, me: threading.Thread) -> bool:
    slot = lock._slot
    return bool(slot) and slot[0] is me


def _caller_location() -> str:
    """``file:line`` of the innermost frame outside safevars (where a lock was taken)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class LockStatistics(NamedTuple):
    """A frozen record of one variable's lock and version state, for debugging.

    Attributes:
      order: Position of the variable's lock in the global lock order.
      locked: Whether some thread holds the eager lock right now.
      owner: ``threading.get_ident()`` of that thread, or ``None``.
      depth: How many times the holder has entered (re-entrant depth).
      runtime_mode: Whether the lock is also a ``tf.CriticalSection`` mutex (set once a
        variable under it was written, versioned or snapshotted in a ``tf.function``).
      writes: Completed writes recorded eagerly since construction or restore.
      thread_name: Name of the holding thread, or ``None``.
      held_for: Seconds since the holder took the lock, or ``None``.
      where: ``file:line`` where the holder took the lock, or ``None``.
      shared_by: How many variables share this lock (1 unless :func:`share_lock`).
      takeovers: How often a waiter took this lock back from a thread that had ended
        while holding it.
      duplicates_discarded: Retried parameter-server steps whose update to this variable
        was recognised as already applied and skipped (:mod:`safevars.exactly_once`).
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


class HeldLock(NamedTuple):
    """One safevars lock held right now (see :func:`held_locks`).

    Attributes:
      variables: Names of the variables under the lock.
      thread_name: Name of the holding thread.
      thread_ident: Its ``threading.get_ident()``.
      thread_alive: Whether that thread is still running (a lock whose holder ended is
        taken back by the next thread that waits for it).
      held_for: Seconds since it was taken.
      where: ``file:line`` (outside safevars) where it was taken.
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
            for guard in _guards_of_lock(self):
                guard.version_var.assign(guard._version, read_value=False)
            self.runtime = True
        return True

    def undo_runtime(self) -> None:
        """Leaves run-time mode again if no traced graph uses the mutex yet."""
        with tf.init_scope(), hold_locks([self]):
            if self.runtime and self.graph_uses == 0:
                self.runtime = False
                self.cs = None

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


def _take(lock: SectionLock, me: threading.Thread, timeout: float | None) -> None:
    """Acquires ``lock._mutex`` and records ``me`` in ``lock._slot`` in one C call.

    ``compress((me,), map(acquire, ...))`` yields ``me`` only if ``acquire`` returned
    True, and ``list.extend`` appends it inside the same call: there is no check point
    between taking the mutex and recording the holder, so an interrupt either comes
    before (nothing taken) or after (the holder's handler sees itself in the slot).

    Raises:
      LockTimeoutError: ``timeout`` seconds passed; nothing is held.
    """
    slot, mutex = lock._slot, lock._mutex
    slot.extend(itertools.compress((me,), map(mutex.acquire, (False,))))
    if slot and slot[0] is me:
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - time.monotonic()))
        slot.extend(itertools.compress((me,), map(mutex.acquire, (True,), (wait,))))
        if slot and slot[0] is me:
            return
        holder = slot[0] if slot else None
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
        if not slot or slot[0] is not dead:
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
    future._result = None  # type: ignore[attr-defined]  # releases the TF mutex


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


def _check_order(held: list[SectionLock], first_new: SectionLock, me: threading.Thread) -> None:
    """Raises unless ``first_new`` sorts after every lock the thread holds."""
    held[:] = [lock for lock in held if _holding(lock, me)]
    if not held:
        return
    top = max(held, key=lambda lock: lock.order)
    if first_new.order < top.order:
        raise LockOrderError(
            f"This thread holds the lock of {top.name!r} and tried to take the lock of "
            f"{first_new.name!r}, which comes earlier in safevars' global lock order; "
            "that could deadlock. Name every variable up front: "
            "safevars.locked(a, b, ...) or safevars.transaction([a, b, ...], fn)."
        )


def sorted_locks(guards: Iterable[Guard]) -> list[SectionLock]:
    """The distinct locks of ``guards``, in the global order."""
    return sorted({id(g.lock): g.lock for g in guards}.values(), key=lambda lock: lock.order)


# ---------------------------------------------------------------------- guards


class _VersionVariable(tfi.ResourceVariable):
    """The int64 resource variable that holds a guard's version in checkpoints and graphs.

    It tells its guard when a checkpoint restores it, so the eager version follows.
    """

    _safevars_guard: Guard | None = None

    def _restore_from_tensors(self, restored_tensors):  # noqa: D401 - TF override
        result = super()._restore_from_tensors(restored_tensors)
        guard = self._safevars_guard
        if guard is not None and tf.executing_eagerly():
            guard._after_version_restore()
        return result


_GUARDS_BY_LOCK: weakref.WeakKeyDictionary[SectionLock, weakref.WeakSet[Guard]] = (
    weakref.WeakKeyDictionary()
)


def _guards_of_lock(lock: SectionLock) -> list[Guard]:
    return list(_GUARDS_BY_LOCK.get(lock, ()))


class Guard:
    """Version of one variable, and the :class:`SectionLock` that protects it.

    A guard never holds a reference that keeps its variable alive beyond the variable's
    own lifetime: the variable (or its proxy) owns the guard, not the other way round.

    Thread safety: ``_version`` and ``_writes`` change only under the lock; optimistic
    readers read ``_version`` without it and re-validate with the sequence number.
    """

    __slots__ = ("name", "device", "lock", "_version", "_writes", "version_var", "__weakref__")

    def __init__(self, variable: Any, version: int = 0) -> None:
        self.name = getattr(variable, "name", "variable")
        self.device = getattr(variable, "device", "")
        self._version = int(version)
        self._writes = 0
        self.lock = SectionLock(self.name, self.device)
        _GUARDS_BY_LOCK.setdefault(self.lock, weakref.WeakSet()).add(self)
        with tf.init_scope(), tf.device(self.device):
            self.version_var = _VersionVariable(
                initial_value=tf.constant(self._version, tf.int64),
                trainable=False,
                name=self.name.split(":")[0] + "_safevars_version",
                shape=(),
            )
        self.version_var._safevars_guard = self
        protect(self, variable)
        protect(self, self.version_var)

    # Lock state, as it was when each variable had a lock of its own.
    order = property(lambda self: self.lock.order)
    runtime = property(lambda self: self.lock.runtime)
    cs = property(lambda self: self.lock.cs)

    def owned(self) -> bool:
        """Whether the calling thread holds this guard's eager lock."""
        return _holding(self.lock, _current_thread())

    # ------------------------------------------------------------------ eager sections

    def call_locked(
        self, fn: Callable[[], Any], writes: int = 0, timeout: float | None = None
    ) -> Any:
        """Runs ``fn()`` eagerly under this guard's lock; counts ``writes`` if it returns.

        The single-variable fast path of :class:`hold`, with the same re-entrancy and
        lock-order rules and no allocation. ``fn`` may count its own write atomically
        with :meth:`write_counted` (then ``writes`` is 0). Nothing is counted if ``fn``
        raises.

        Raises:
          LockTimeoutError: the lock was not free within ``timeout`` seconds.
          LockOrderError: the thread holds a lock that sorts after this one.
        """
        me = _current_thread()
        while True:
            lock = self.lock
            slot = lock._slot
            if slot and slot[0] is me:
                lock._depth += 1
                try:
                    result = fn()
                    if writes:
                        self._count(writes)
                    return result
                finally:
                    lock._depth -= 1
            held = _held()
            if held:
                _check_order(held, lock, me)
            try:
                lock._enter(me, timeout)
                if self.lock is not lock:  # share_lock moved us while we waited.
                    continue
                held.append(lock)
                result = fn()
                if writes:
                    self._count(writes)
                return result
            finally:
                if slot and slot[0] is me and lock._depth == 1:
                    lock.seq += 1  # The release: attribute stores, then one C call.
                    lock._depth = 0
                    lock._token = None
                    del slot[:]
                    lock._mutex.release()
                    if held and held[-1] is lock:
                        held.pop()

    def write_counted(
        self,
        kernel: Any,
        op_name: str,
        inputs: tuple[Any, ...],
        attrs: tuple[Any, ...] = (),
        writes: int = 1,
    ) -> None:
        """Runs the eager kernel ``op_name`` on ``inputs`` and counts ``writes``, together.

        The write and the version update are one chain of C calls (``TFE_Py_FastPath
        Execute``, then ``setattr`` of the Python version, or a second kernel for the
        run-time version variable), with no check point between them: an interrupt
        lands before both or after both. The caller holds the lock. ``kernel`` (the
        generated op function) is the slow path when the fast path declines.
        """
        ctx = tfi.eager_context()
        if self.lock.runtime:
            count = (
                tfi.fast_execute,
                ctx,
                "AssignAddVariableOp",
                None,
                self.version_var.handle,
                tf.constant(writes, tf.int64),
            )
        else:
            count = (setattr, self, "_version", self._version + writes)
        steps = ((tfi.fast_execute, ctx, op_name, None, *inputs, *attrs), count)
        stats = (setattr, self, "_writes", self._writes + writes)
        try:
            _consume(itertools.starmap(operator.call, (*steps, stats)))
        except tfi.NotOkStatusException as e:
            tfi.raise_from_not_ok_status(e, None)
        except tfi.FallbackException:
            kernel(*inputs, **dict(zip(attrs[::2], attrs[1::2])))
            self._count(writes)

    def _count(self, writes: int = 1) -> None:
        self._writes += writes
        if self.lock.runtime:
            self.version_var.assign_add(writes, read_value=False)
        else:
            self._version += writes

    bump_eager = _count  # Name used by callers outside this module.

    # ------------------------------------------------------------------ versions

    def version(self) -> int | tf.Tensor:
        """The version: an ``int`` eagerly, an int64 tensor while tracing a graph."""
        if not tf.executing_eagerly():
            self.lock.ensure_runtime(self.owned())
            self.lock.graph_uses += 1
            return self.version_var.read_value()
        if self.lock.runtime:
            return int(self.version_var.numpy())
        return self._version

    def bump_graph(self, after: Any, writes: int = 1) -> Any:
        """Graph op adding ``writes`` to the version once ``after`` has run."""
        with tf.control_dependencies([after] if after is not None else []):
            return self.version_var.assign_add(writes, read_value=False)

    def sync_version_var(self) -> None:
        """Copies the eager version into the version variable (before a checkpoint)."""
        if self.lock.runtime or not tf.executing_eagerly():
            return
        with hold([self]):
            self.version_var.assign(self._version, read_value=False)

    def set_version(self, version: int) -> None:
        """Sets the version (deepcopy, restore, rollback); the caller holds the lock."""
        self._version = int(version)
        self.version_var.assign(self._version, read_value=False)

    def _after_version_restore(self) -> None:
        with hold([self]):
            self._version = int(self.version_var.numpy())

    def ensure_runtime(self) -> bool:
        return self.lock.ensure_runtime(self.owned())

    def undo_runtime(self) -> None:
        self.lock.undo_runtime()

    def statistics(self) -> LockStatistics:
        lock = self.lock
        slot = lock._slot
        holder = slot[0] if slot else None
        return LockStatistics(
            order=lock.order,
            locked=lock._mutex.locked(),
            owner=holder.ident if holder is not None else None,
            depth=lock._depth if holder is not None else 0,
            runtime_mode=lock.runtime,
            writes=self._writes,
            thread_name=holder.name if holder is not None else None,
            held_for=(time.monotonic() - lock._since) if holder is not None else None,
            where=lock._where if holder is not None else None,
            shared_by=len(_guards_of_lock(lock)) or 1,
            takeovers=lock.takeovers,
            duplicates_discarded=_duplicates_of(self),
        )


# Guard -> a no-argument function returning how many duplicates were discarded for it;
# registered by safevars.exactly_once for the variables it protects.
DUPLICATE_COUNTERS: weakref.WeakKeyDictionary[Guard, Callable[[], int]] = (
    weakref.WeakKeyDictionary()
)


def _duplicates_of(guard: Guard) -> int:
    counter = DUPLICATE_COUNTERS.get(guard)
    return int(counter()) if counter is not None else 0


# id(variable) -> its guard, for every variable a guard protects (the variable it was
# made for, its version variable, and any state registered with protect()): how
# checkpoints find the locks of what they save.
_PROTECTED: dict[int, weakref.ref[Guard]] = {}


def protect(guard: Guard, variable: Any) -> None:
    """Registers ``variable`` as state that ``guard``'s lock protects.

    Checkpoints (:mod:`safevars.checkpointing`) hold the lock of every registered
    variable they save or restore, so what they write is a state that existed.
    """
    key = id(variable)
    _PROTECTED[key] = weakref.ref(guard)
    try:
        weakref.finalize(variable, _PROTECTED.pop, key, None)
    except TypeError:  # Not weakly referenceable: kept until the process ends.
        pass


def guard_of(obj: Any) -> Guard | None:
    """The guard protecting ``obj`` (a SafeVariable, a protected variable), or None."""
    guard = getattr(obj, "_self_guard", None)
    if isinstance(guard, Guard):
        return guard
    ref = _PROTECTED.get(id(obj))
    return ref() if ref is not None else None


def guards_of(variables: Sequence[Any], argument: str) -> list[Guard]:
    """The guards of ``variables`` (SafeVariables), or an error naming ``argument``."""
    guards = []
    for index, variable in enumerate(variables):
        guard = getattr(variable, "_self_guard", None)
        if not isinstance(guard, Guard):
            raise InvalidArgumentError(
                f"{argument}[{index}] is {type(variable).__name__}, not a SafeVariable. "
                "Create it with safevars.SafeVariable(...) or wrap it with "
                "safevars.wrap(variable)."
            )
        guards.append(guard)
    return guards


# ---------------------------------------------------------------------- multi-lock holds


class _Hold:
    """What :class:`hold` does, without a finalizer (the class of a closed context).

    A context switches to this class once it has released everything, so that dropping
    it runs no Python finalizer: a ``KeyboardInterrupt`` whose handler happened to run
    in a finalizer would be swallowed ("Exception ignored in ...").
    """

    __slots__ = ("_n", "_locks", "_timeout", "_guards")

    def __init__(self, guards: Iterable[Guard], timeout: float | None = None) -> None:
        self._n = 0  # How many of _locks this context holds (a prefix, in order).
        self._guards: list[Guard] | None = list(guards)
        self._locks = sorted_locks(self._guards)
        self._timeout = timeout

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
                slot = lock._slot
                if slot and slot[0] is me:
                    lock._depth += 1
                    self._n = index + 1
                    continue
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                lock._enter(me, remaining)
                self._n = index + 1
                held.append(lock)
        except BaseException:
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

    __exit__ = _release


class hold(_Hold):  # noqa: N801 - used like a function: ``with hold(guards):``
    """Context manager holding the eager locks of ``guards`` (global order, re-entrant).

    ``safevars.locked`` returns one. Raises :class:`LockOrderError` before taking
    anything if the calling thread already holds a lock that sorts after one it would
    newly take, and :class:`LockTimeoutError` (nothing held) if ``timeout`` runs out.

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


def hold_locks(locks: Sequence[SectionLock]) -> hold:
    """A :class:`hold` over locks directly (for code that has no guard at hand)."""
    context = hold([])
    context._guards = None
    context._locks = sorted(set(locks), key=lambda lock: lock.order)
    return context


def share_lock(guards: Sequence[Guard]) -> bool:
    """Makes ``guards`` share one lock, each keeping its own version, where it is safe.

    Variables that are always written together (a model's weights and its optimizer's
    state) then cost one lock per section instead of one per variable, and a
    ``tf.function`` step over them takes one mutex. The merged lock takes the earliest
    place of the merged locks in the global order.

    Returns:
      Whether all ``guards`` now share one lock. False (nothing changed) if one of the
      locks is held, is used by a traced ``tf.function`` already (its graphs take its
      old mutex), or the guards live on different devices of a parameter-server
      cluster.

    Thread safety: the locks are all held while the guards are moved, and a thread that
    waited on an old lock notices the move and takes the new one.

    Modes: eager only (call it while building, not while tracing).
    """
    locks = sorted_locks(guards)
    if len(locks) <= 1:
        return True
    if not tf.executing_eagerly():
        return False
    if any(lock.graph_uses or lock._slot for lock in locks):
        return False
    if len({lock.device for lock in locks if on_parameter_server(lock.device)}) > 1:
        return False
    target = locks[0]
    with hold_locks(locks):
        if any(lock.graph_uses for lock in locks):
            return False
        runtime = any(lock.runtime for lock in locks)
        for guard in guards:
            old = guard.lock
            if old is target:
                continue
            guard.lock = target
            _GUARDS_BY_LOCK.setdefault(target, weakref.WeakSet()).add(guard)
            old_set = _GUARDS_BY_LOCK.get(old)
            if old_set is not None:
                old_set.discard(guard)
            target.names.append(guard.name)
    if runtime and not target.runtime:
        target.ensure_runtime(False)
    for lock in locks[1:]:
        if not _guards_of_lock(lock):
            lock.runtime, lock.cs = False, None
    return True


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


# Graph sections live in safevars.sections; these names stay importable from here.
# Savers (tf.train.Checkpoint, Keras model.save) take the locks of what they save.
from safevars import checkpointing as _checkpointing  # noqa: E402, F401
from safevars.sections import graph_section, held_in_graph  # noqa: E402, F401
