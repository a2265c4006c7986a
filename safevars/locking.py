"""Per-variable locks, versions and the global lock order.

Every :class:`~safevars.SafeVariable` owns one :class:`Guard`. A guard is the single
place that decides *how* a critical section over some variables is entered, so eager
code, ``tf.function`` graphs and multi-variable transactions all share one mechanism.

Two lock levels, one order:

* **Eager (trace-free) level.** A ``threading.Lock`` per variable, re-entrant for the
  thread that holds it (an owner and a depth), plus a *sequence number* that is odd while
  a critical section is open. Optimistic snapshot readers (see :mod:`safevars.snapshot`)
  read the sequence numbers before and after reading values and retry on a change, so
  readers never wait for one another. Versions live in a Python ``int``: a write costs
  one uncontended ``Lock.acquire``, not an extra TensorFlow op.
* **Run-time level.** A ``tf.CriticalSection`` placed on the variable's device. It is
  created the first time the variable is written (or versioned, or snapshotted) inside a
  ``tf.function``; from then on the guard is in *run-time mode*: graph writes execute
  inside the critical section, eager writes take the same mutex with the ``MutexLock``
  op, and the version lives in an int64 resource variable next to the value. A Python
  lock cannot order graph execution; the mutex does, across threads, ``tf.function``
  calls and parameter-server workers.

Guards are ordered by creation (:attr:`Guard.order`). Sections that name several
variables take their locks in that order, which rules out deadlock. A thread that holds
some locks may take more only in increasing order; anything else raises
:class:`~safevars.LockOrderError` *before* taking any lock.

NOTES:
  Calling a ``tf.function`` that writes ``v`` from inside ``safevars.locked(v)`` once
  ``v`` is in run-time mode would wait on a mutex the caller holds, exactly as nesting
  ``tf.CriticalSection.execute`` would. safevars detects it when the function is traced
  inside the section (raising :class:`~safevars.LockReentryError`) but cannot see a
  function traced elsewhere and merely called inside the section: do not do that.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_resource_variable_ops, resource_variable_ops

from safevars import _autograph  # noqa: F401  (registers safevars with AutoGraph)
from safevars.distribute import on_parameter_server
from safevars.errors import (
    InvalidArgumentError,
    LockOrderError,
    LockReentryError,
    UnsupportedStrategyError,
)

__all__ = ["Guard", "LockStatistics", "graph_section", "guards_of", "held_in_graph", "hold"]

_ORDER = itertools.count()
_local = threading.local()


def _held() -> list[Guard]:
    """Guards the calling thread holds eagerly, in acquisition order."""
    try:
        return _local.held
    except AttributeError:
        _local.held = []
        return _local.held


def _graph_held() -> list[tuple[Any, frozenset[Guard], list[Any]]]:
    """Stack of (graph, guards, write-ops) for transactions being traced by this thread."""
    try:
        return _local.graph_held
    except AttributeError:
        _local.graph_held = []
        return _local.graph_held


class LockStatistics(NamedTuple):
    """A frozen record of one guard's state, for debugging (see ``SafeVariable.statistics``).

    Attributes:
      order: Position in the global lock order.
      locked: Whether some thread holds the eager lock right now.
      owner: ``threading.get_ident()`` of that thread, or ``None``.
      depth: How many times the owner has entered (re-entrant depth).
      runtime_mode: Whether writes go through a ``tf.CriticalSection`` (set once the
        variable was written, versioned or snapshotted inside a ``tf.function``).
      writes: Completed writes recorded eagerly since construction or restore.
    """

    order: int
    locked: bool
    owner: int | None
    depth: int
    runtime_mode: bool
    writes: int


class _VersionVariable(resource_variable_ops.ResourceVariable):
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


class Guard:
    """Synchronization state of one variable: lock, sequence number and version.

    Ownership: the eager lock belongs to one thread at a time and is re-entrant for it.
    A guard never holds a reference that keeps its variable alive beyond the variable's
    own lifetime: the variable (or its proxy) owns the guard, not the other way round.

    Thread safety: every mutable field is changed only by the thread that holds
    ``_mutex``; ``seq`` and ``_version`` are read without it by optimistic readers, which
    re-validate.
    """

    __slots__ = (
        "order",
        "name",
        "device",
        "_mutex",
        "_owner",
        "_depth",
        "_token",
        "seq",
        "_version",
        "_writes",
        "runtime",
        "cs",
        "version_var",
        "graph_uses",
        "__weakref__",
    )

    def __init__(self, variable: tf.Variable, version: int = 0) -> None:
        self.order = next(_ORDER)
        self.name = getattr(variable, "name", "variable")
        self.device = getattr(variable, "device", "")
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self._depth = 0
        self._token: Any = None
        self.seq = 0
        self._version = int(version)
        self._writes = 0
        self.runtime = False
        self.cs: tf.CriticalSection | None = None
        self.graph_uses = 0
        with tf.init_scope(), tf.device(self.device):
            self.version_var = _VersionVariable(
                initial_value=tf.constant(self._version, tf.int64),
                trainable=False,
                name=self.name.split(":")[0] + "_safevars_version",
                shape=(),
            )
        self.version_var._safevars_guard = self

    # ------------------------------------------------------------------ eager locking

    def owned(self) -> bool:
        """Whether the calling thread holds this guard's eager lock."""
        return self._owner == threading.get_ident()

    def _enter_new(self, me: int) -> None:
        """Takes the lock for ``me`` (which does not hold it); caller checked the order."""
        if self.runtime and on_parameter_server(self.device):
            # An eager MutexLock from the coordinator on a parameter server's mutex,
            # while scheduled steps take it too, was measured to hang: refuse instead.
            raise UnsupportedStrategyError(
                f"{self.name!r} lives on a parameter server and is locked by tf.functions "
                "there; an eager write, transaction or snapshot from the coordinator "
                "cannot take that lock safely. Do it inside a tf.function (scheduled with "
                "ClusterCoordinator.schedule, or called on the coordinator)."
            )
        self._mutex.acquire()
        try:
            self._owner = me
            self._depth = 1
            self.seq += 1
            if self.runtime:
                self._token = gen_resource_variable_ops.mutex_lock(self.cs._handle)
        except BaseException:
            self._owner = None
            self._depth = 0
            self.seq += 1
            self._mutex.release()
            raise

    def call_locked(self, fn: Callable[[], Any], writes: int = 1) -> Any:
        """Runs ``fn()`` eagerly under this guard's lock, then counts ``writes`` writes.

        The single-variable fast path of :class:`hold` (every eager write takes it): same
        re-entrancy and lock-order rules, no allocation. Nothing is counted if ``fn``
        raises.
        """
        me = threading.get_ident()
        if self._owner == me:
            result = fn()
            self.bump_eager(writes)
            return result
        held = _held()
        if held:
            _check_order(held, self)
        self._enter_new(me)
        held.append(self)
        try:
            result = fn()
            self.bump_eager(writes)
        finally:
            held.pop()
            self._exit()
        return result

    def _exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._token = None  # Deleting the MutexLock tensor releases the TF mutex.
            self.seq += 1
            self._owner = None
            self._mutex.release()

    # ------------------------------------------------------------------ versions

    def version(self) -> int | tf.Tensor:
        """The version: an ``int`` eagerly, an int64 tensor while tracing a graph."""
        if not tf.executing_eagerly():
            self.ensure_runtime()
            self.graph_uses += 1
            return self.version_var.read_value()
        if self.runtime:
            return int(self.version_var.numpy())
        return self._version

    def bump_eager(self, writes: int = 1) -> None:
        """Records ``writes`` completed eager writes; the caller holds the lock."""
        self._writes += writes
        if self.runtime:
            self.version_var.assign_add(writes, read_value=False)
        else:
            self._version += writes

    def bump_graph(self, after: Any, writes: int = 1) -> Any:
        """Graph op adding ``writes`` to the version once ``after`` has run."""
        with tf.control_dependencies([after] if after is not None else []):
            return self.version_var.assign_add(writes, read_value=False)

    def sync_version_var(self) -> None:
        """Copies the eager version into the version variable (before a checkpoint)."""
        if self.runtime or not tf.executing_eagerly():
            return
        with hold([self]):
            self.version_var.assign(self._version, read_value=False)

    def set_version(self, version: int) -> None:
        """Sets the version (deepcopy, restore); the caller holds the lock."""
        self._version = int(version)
        self.version_var.assign(self._version, read_value=False)

    def _after_version_restore(self) -> None:
        with hold([self]):
            self._version = int(self.version_var.numpy())

    # ------------------------------------------------------------------ run-time mode

    def ensure_runtime(self) -> bool:
        """Switches to run-time mode (idempotent). Called when tracing a graph.

        Returns:
          Whether this call made the switch (so a failed trace can undo it).
        """
        if self.runtime:
            return False
        if self.owned():
            raise LockReentryError(
                f"A tf.function that writes, versions or snapshots {self.name!r} is being "
                "traced while this thread holds that variable's lock (inside "
                "safevars.locked or safevars.transaction). Running it there would wait "
                "on the lock its caller holds. Trace and call the function outside the "
                "locked block, or put the whole step inside safevars.transaction([...], "
                "fn) within the tf.function."
            )
        with tf.init_scope():
            with self._mutex:
                if self.runtime:
                    return False
                with tf.device(self.device):
                    # A unique shared_name: CriticalSection defaults it to the name,
                    # and two variables named alike would share (and deadlock) a mutex.
                    self.cs = tf.CriticalSection(
                        name=self.name.split(":")[0] + "_safevars_lock",
                        shared_name=f"safevars_lock_{uuid.uuid4().hex}",
                    )
                self.version_var.assign(self._version, read_value=False)
                self.runtime = True
        return True

    def undo_runtime(self) -> None:
        """Leaves run-time mode again if no traced graph uses the critical section yet."""
        with tf.init_scope(), self._mutex:
            if self.runtime and self.graph_uses == 0:
                self.runtime = False
                self.cs = None

    def statistics(self) -> LockStatistics:
        owner = self._owner
        return LockStatistics(
            order=self.order,
            locked=self._mutex.locked(),
            owner=owner,
            depth=self._depth if owner is not None else 0,
            runtime_mode=self.runtime,
            writes=self._writes,
        )


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


def _check_order(held: list[Guard], first_new: Guard) -> None:
    """Raises unless ``first_new`` sorts after every guard the thread holds."""
    top = max(held, key=lambda g: g.order)
    if first_new.order < top.order:
        raise LockOrderError(
            f"This thread holds the lock of {top.name!r} and tried to take the lock of "
            f"{first_new.name!r}, which comes earlier in safevars' global lock order; "
            "that could deadlock. Name every variable up front: "
            "safevars.locked(a, b, ...) or safevars.transaction([a, b, ...], fn)."
        )


def _sorted_unique(guards: Iterable[Guard]) -> list[Guard]:
    return sorted({id(g): g for g in guards}.values(), key=lambda g: g.order)


class hold:  # noqa: N801 - used like a function: ``with hold(guards):``
    """Context manager holding the eager locks of ``guards`` (global order, re-entrant).

    Raises :class:`LockOrderError` before taking anything if the calling thread already
    holds a lock that sorts after one it would newly take.
    """

    __slots__ = ("_guards", "_taken")

    def __init__(self, guards: Iterable[Guard]) -> None:
        self._guards = _sorted_unique(guards)
        self._taken: list[Guard] = []

    def __enter__(self) -> hold:
        me = threading.get_ident()
        held = _held()
        new = [g for g in self._guards if g._owner != me]
        if new and held:
            _check_order(held, new[0])
        taken = self._taken
        try:
            for g in self._guards:
                if g._owner == me:
                    g._depth += 1
                else:
                    g._enter_new(me)
                    held.append(g)
                taken.append(g)
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        held = _held()
        for g in reversed(self._taken):
            last = g._depth == 1
            g._exit()
            if last:
                held.remove(g)
        self._taken = []

    def __exit__(self, *exc: object) -> None:
        self._release()


# ---------------------------------------------------------------------- graph sections


def held_in_graph(guard: Guard) -> list[Any] | None:
    """The write-op list of the transaction being traced that holds ``guard``, if any.

    A write traced inside ``safevars.transaction`` (in the transaction's own graph or a
    ``tf.cond``/``tf.while_loop`` body nested in it) runs inside the transaction's
    critical sections, so it must not lock again.
    """
    for guards, writes in _enclosing_sections():
        if guard in guards:
            return writes
    return None


def _enclosing_sections() -> list[tuple[frozenset[Guard], list[Any]]]:
    """(guards, write-op list) of the sections being traced around the current graph.

    Innermost first: sections traced in this graph or in a graph enclosing it (a
    ``tf.cond``/``tf.while_loop`` body, a nested ``tf.function``).
    """
    stack = _graph_held()
    if not stack:
        return []
    chain = []
    g = ops.get_default_graph()
    while g is not None:
        chain.append(g)
        g = getattr(g, "outer_graph", None)
    return [
        (guards, writes)
        for txn_graph, guards, writes in reversed(stack)
        if any(txn_graph is c for c in chain)
    ]


def graph_section(
    guards: Sequence[Guard], fn: Callable[[], Any], after: Any = ()
) -> Any:
    """Traces ``fn`` inside the critical sections of ``guards`` (global order).

    Args:
      guards: The guards to hold while ``fn``'s ops run.
      fn: Traces the section's ops; called once.
      after: Tensors (any nest, composites included) the section waits for before it
        takes its first lock, so that computing them (gradients, the value to write)
        does not hold the lock.

    Returns ``fn()``'s result, made to depend on the release of every lock. The locks are
    released only after every op ``fn`` created has run (not only its outputs, which is
    all ``tf.CriticalSection.execute`` waits for).
    """
    ordered = _sorted_unique(guards)
    switched = [g for g in ordered if g.ensure_runtime()]
    try:
        result = _traced_section(ordered, fn, after)
    except BaseException:
        for g in switched:  # A failed trace changes nothing, not even the lock mode.
            g.undo_runtime()
        raise
    for g in ordered:
        g.graph_uses += 1
    return result


def _traced_section(ordered: list[Guard], fn: Callable[[], Any], after: Any) -> Any:
    """The ops of one section: lock every new guard, run ``fn``, release them all.

    The mutexes of the guards' ``tf.CriticalSection`` s are taken with the same ops
    ``CriticalSection.execute`` uses (``MutexLock``, then ``ConsumeMutexLock`` once the
    section's ops have run), but flat: one after another in the global order, and all
    released together after the body. Nesting one ``execute`` per guard would chain
    every release behind the inner ones (three ops per level on the critical path).
    Re-entry needs no check here: a guard already held by a section being traced in an
    enclosing graph (``held_in_graph``) is not locked again. A section traced inside
    another may add only guards that sort after the ones held (as eagerly), and every
    section takes its first lock only once ``after`` is computed: a lock taken while
    the section still waits for a value that another section produces could otherwise
    deadlock against a graph doing the same the other way round (``a.assign(b.update(f))``
    in one thread, ``b.assign(a.update(g))`` in another; measured here: it hung).
    """
    graph = ops.get_default_graph()
    enclosing = _enclosing_sections()
    held: set[Guard] = set().union(*(guards for guards, _ in enclosing))
    new = [g for g in ordered if g not in held]
    if not new:
        return fn()
    if held:
        top = max(held, key=lambda g: g.order)
        if new[0].order < top.order:  # Same rule as eager hold(): no lock out of order.
            raise LockOrderError(
                f"A section traced inside a section holding {top.name!r} takes the lock "
                f"of {new[0].name!r}, which comes earlier in safevars' global lock "
                "order; two such graphs running at once could deadlock. Name every "
                "variable up front: safevars.transaction([a, b, ...], fn)."
            )
    writes: list[Any] = []
    stack = _graph_held()
    inputs = [
        x for x in tf.nest.flatten(after, expand_composites=True) if isinstance(x, tf.Tensor)
    ]
    with tf.device(_section_device(ordered)):
        locks: list[tf.Tensor] = []
        for guard in new:
            with tf.control_dependencies(locks[-1:] if locks else inputs):
                locks.append(gen_resource_variable_ops.mutex_lock(guard.cs._handle))
        existing = set(graph.get_operations())
        stack.append((graph, frozenset(ordered), writes))
        try:
            with tf.control_dependencies(locks):
                result = fn()
        finally:
            stack.pop()
        created = [op for op in graph.get_operations() if op not in existing]
        released = []
        with tf.control_dependencies(created):
            for guard, lock in zip(new, locks):
                with ops.colocate_with(guard.cs._handle):
                    released.append(gen_resource_variable_ops.consume_mutex_lock(lock))
        with tf.control_dependencies(released):
            leaves = [
                tf.identity(x) if isinstance(x, tf.Tensor) else x
                for x in tf.nest.flatten(result)
            ]
    return tf.nest.pack_sequence_as(result, leaves)


def _section_device(ordered: list[Guard]) -> str | None:
    """Where a section's ops run: the parameter server holding every guarded variable.

    A section's ops default to the calling worker's device, so each read, computation
    and write of a variable on a parameter server would be a separate round trip while
    the lock is held. When every guarded variable lives on one parameter-server task,
    the section's ops are placed there instead (one round trip, the lock held for less
    time): measured with 3 workers and 1 PS, ``update`` went from 1.72x to 0.77x the
    time of an unlocked read-then-write (which pays the round trips without a lock).
    Ops that ``fn`` places explicitly keep their device. Anywhere else (one machine,
    mirrored copies, variables on several tasks), None: TensorFlow places the ops.
    """
    devices = {g.device for g in ordered}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if on_parameter_server(device) else None
