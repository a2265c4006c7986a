"""Guard: one variable's version and the lock protecting it, and how to find a guard.

Every SafeVariable owns one :class:`Guard`. Its version is a Python ``int`` eagerly and
an int64 resource variable (:class:`_VersionVariable`) in checkpoints and graphs.
:meth:`Guard.call_locked` is the single-variable fast path of a section, and
:meth:`Guard.write_counted` makes an eager write and its version count one chain of C
calls. :func:`protect` registers more state under a guard's lock (checkpoints take it),
and :func:`guard_of` / :func:`guards_of` find the guard of a variable.
"""

from __future__ import annotations

import collections
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.errors import InvalidArgumentError
from safevars.locking.acquisition import enter
from safevars.locking.holding import hold
from safevars.locking.joint_counter import JointCounter
from safevars.locking.lock_order import _check_order
from safevars.locking.ownership import _current_thread, _held, _holding
from safevars.locking.runtime_mode import ensure_runtime, undo_runtime, use_in_graph
from safevars.locking.section_lock import (
    _GUARDS_BY_LOCK,
    SectionLock,
    _guards_of_lock,
    holder_of,
)
from safevars.locking.statistics import LockStatistics, _duplicates_of

_VALUE_KEY = "VARIABLE_VALUE"  # trackable.VARIABLE_VALUE_KEY: a variable's checkpoint entry

# Runs an iterator to its end, in C.
_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend


class _VersionVariable(tfi.ResourceVariable):
    """The int64 resource variable that holds a guard's version in checkpoints and graphs.

    It tells its guard when a checkpoint restores it, so the eager version follows.

    In run-time mode it stores the version minus the guard's joint counter, if the guard
    has one (:mod:`safevars.locking.joint_versions`); a checkpoint holds the version
    itself, under the same key as any variable's value.
    """

    _safevars_guard: Guard | None = None

    def _serialize_to_tensors(self):  # noqa: D401 - TF override
        guard = self._safevars_guard
        if guard is None or guard.joint is None:
            return super()._serialize_to_tensors()
        with tf.device(self.device):
            total = self.read_value() + guard.joint.variable.read_value()
        return {_VALUE_KEY: total}

    def _restore_from_tensors(self, restored_tensors):  # noqa: D401 - TF override
        guard = self._safevars_guard
        if guard is not None and guard.joint is not None:
            with tf.device(self.device):
                own = restored_tensors[_VALUE_KEY] - guard.joint.variable.read_value()
            restored_tensors = {**restored_tensors, _VALUE_KEY: own}
        result = super()._restore_from_tensors(restored_tensors)
        if guard is not None and tf.executing_eagerly():
            guard._after_version_restore()
        return result


class Guard:
    """Version of one variable, and the :class:`SectionLock` that protects it.

    A guard never holds a reference that keeps its variable alive beyond the variable's
    own lifetime: the variable (or its proxy) owns the guard, not the other way round.

    Thread safety: ``_version`` and ``_writes`` change only under the lock; optimistic
    readers read ``_version`` without it and re-validate with the sequence number.
    """

    __slots__ = (
        "name",
        "device",
        "lock",
        "_version",
        "_writes",
        "version_var",
        "joint",
        "graph_reads",
        "__weakref__",
    )

    def __init__(self, variable: Any, version: int = 0, lock: SectionLock | None = None) -> None:
        self.name = getattr(variable, "name", "variable")
        self.device = getattr(variable, "device", "")
        self._version = int(version)
        self._writes = 0
        self.graph_reads = 0  # traced reads of the version (joint counters need none)
        if lock is None:
            lock = SectionLock(self.name, self.device)
        else:
            lock.names.append(self.name)
        self.lock = lock
        self.joint: JointCounter | None = None  # set by join_versions, then fixed
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
        self,
        fn: Callable[[], Any],
        writes: int = 0,
        timeout: float | None = None,
        reader: bool = False,
    ) -> Any:
        """Runs ``fn()`` eagerly under this guard's lock; counts ``writes`` if it returns.

        The single-variable fast path of :class:`hold`, with the same re-entrancy and
        lock-order rules and no allocation. ``fn`` may count its own write atomically
        with :meth:`write_counted` (then ``writes`` is 0). Nothing is counted if ``fn``
        raises. ``reader``: ``fn`` only reads (a snapshot), and is let in first while it
        waits (``acquisition.enter``).

        Raises:
          LockTimeoutError: the lock was not free within ``timeout`` seconds.
          LockOrderError: the thread holds a lock that sorts after this one.
        """
        me = _current_thread()
        while True:
            lock = self.lock
            slot = lock._slot
            if me in slot:
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
                enter(lock, me, timeout, reader)
                if self.lock is not lock:  # share_lock moved us while we waited.
                    continue
                held.append(lock)
                result = fn()
                if writes:
                    self._count(writes)
                return result
            finally:
                if me in slot and lock._depth == 1:
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
        count: tuple[Any, ...]
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
            _consume(tfi.call_each((*steps, stats)))
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
            use_in_graph(self.lock, self.owned(), mutexed=False)
            return self.graph_version()
        if self.lock.runtime:
            return int(self.version_var.numpy()) + self._joint_value()
        return self._version

    def graph_version(self) -> tf.Tensor:
        """The version as an int64 tensor read when the graph runs (run-time mode).

        Read inside the guard's section, or validated, by the caller.
        """
        self.graph_reads += 1  # before reading ``joint``: join_versions checks it after
        value = self.version_var.read_value()
        if self.joint is None:
            return value
        return value + self.joint.variable.read_value()

    def _joint_value(self) -> int:
        """The joint counter's share of the version (0 without one), eagerly."""
        return 0 if self.joint is None else self.joint.value()

    def bump_graph(self, after: Any, writes: int = 1) -> Any:
        """Graph op adding ``writes`` to the version once ``after`` has run.

        The kernel directly, not ``ResourceVariable.assign_add`` (the same op, traced in
        a third of the time: every traced write makes one).
        """
        # ``writes`` is an int or an int64 tensor; made before the control dependencies,
        # a constant carries none (the add alone waits for ``after``).
        count = tf.convert_to_tensor(writes, tf.int64)
        with tf.control_dependencies([after] if after is not None else []):
            return tfi.gen_resource_variable_ops.assign_add_variable_op(
                self.version_var.handle, count
            )

    def sync_version_var(self) -> None:
        """Copies the eager version into the version variable (before a checkpoint)."""
        if self.lock.runtime or not tf.executing_eagerly():
            return
        with hold([self]):
            self.store_version()

    def store_version(self) -> None:
        """Writes the eager version into the version variable (less the joint counter);
        the caller holds the lock."""
        own = self._version - self._joint_value()
        self.version_var.assign(own, read_value=False)

    def set_version(self, version: int) -> None:
        """Sets the version (deepcopy, restore, rollback); the caller holds the lock."""
        self._version = int(version)
        self.store_version()

    def _after_version_restore(self) -> None:
        with hold([self]):
            self._version = int(self.version_var.numpy()) + self._joint_value()

    def ensure_runtime(self) -> bool:
        return ensure_runtime(self.lock, self.owned())

    def undo_runtime(self) -> None:
        undo_runtime(self.lock)

    def statistics(self) -> LockStatistics:
        lock = self.lock
        holder = holder_of(lock._slot)
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
            eager_mutex=lock.mutexed,
            graph_uses=lock.graph_uses,
        )


# id(variable) -> its guard, for every variable a guard protects (the variable it was
# made for, its version variable, and any state registered with protect()): how
# checkpoints find the locks of what they save.
_PROTECTED: dict[int, weakref.ref[Guard]] = {}


def protect(guard: Guard, variable: Any) -> None:
    """Registers ``variable`` as state that ``guard``'s lock protects.

    Checkpoints (:mod:`safevars.locking.checkpoints`) hold the lock of every registered
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
