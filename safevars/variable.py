"""SafeVariable: a drop-in ``tf.Variable`` with locked writes, versions and snapshots.

The problem: ``v.assign(v.read_value() + 1)`` is two operations. Between them another
thread, another ``tf.function`` or another parameter-server worker may write ``v``, and
its update is lost silently (8 threads × 2,000 such updates ended at 2,392 instead of
16,000 on a 2-core machine with TensorFlow 2.21).

The fix: :class:`SafeVariable` is a transparent proxy (``wrapt.ObjectProxy``) around a
real ``tf.Variable``. It is an instance of ``tf.Variable`` to every ``isinstance`` check,
converts to a tensor, takes part in gradients, checkpoints, SavedModels and Keras
optimizers, and every write (``assign*``, ``scatter_*``, slice assignment) goes through
the variable's :class:`~safevars.locking.Guard`: one lock, one version counter.

NOTES:
  What is *not* guaranteed:

  * Writes made on the wrapped variable directly (``v.__wrapped__.assign(...)``, or by
    code holding the original ``tf.Variable`` that was passed to :func:`wrap`) bypass the
    lock and the version. Wrap a variable before sharing it.
  * A plain read (``v.read_value()``, ``v + 1``) is atomic for *one* variable but may
    interleave with a multi-variable transaction; use :meth:`SafeVariable.snapshot` or
    :func:`safevars.snapshot` for consistent reads of several variables.
  * ``v.assign(v.read_value() + 1)`` is still two operations: use
    ``v.update(lambda x: x + 1)`` or ``with safevars.locked(v): ...``.
  * Passing a SafeVariable as an *argument* of a ``tf.function`` gives the function a
    plain variable inside; capture it by closure (the usual Keras pattern) to keep the
    locks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf
import wrapt

from safevars._tf_internal import (
    ds_values,
    gen_resource_variable_ops,
    object_identity,
    ops,
    resource_variable_ops,
    tensor_conversion_registry,
    tensor_getitem_override,
)
from safevars.distribute import check_strategy, merge_context, merged_update, merged_write
from safevars.errors import (
    DTypeMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    NotCallableError,
    ShapeMismatchError,
    UnsupportedStrategyError,
)
from safevars.locking import Guard, LockStatistics, check_timeout, hold
from safevars.sections import graph_section, held_in_graph
from safevars.snapshot import Snapshot, take_snapshots

__all__ = ["SafeVariable", "as_safe_variables", "wrap", "writes_counted_by_caller"]

# One guard per wrapped tf.Variable, so that wrap(v) twice still excludes itself.
_GUARDS: dict[int, Guard] = {}
_GUARDS_LOCK = threading.Lock()


def _guard_for(variable: tf.Variable, version: int = 0) -> Guard:
    key = id(variable)
    with _GUARDS_LOCK:
        guard = _GUARDS.get(key)
        if guard is None:
            guard = Guard(variable, version)
            _GUARDS[key] = guard
            weakref.finalize(variable, _GUARDS.pop, key, None)
        return guard


# safevars.audit() watches ResourceVariable's methods; while an audit is active, writes
# take those methods instead of calling the kernels directly (the audit flips this).
_direct_kernel_writes = True

# The write kernels behind ResourceVariable.assign, assign_add and assign_sub: the op
# function (slow path) and the op name (for Guard.write_counted's fast path).
_KERNELS = {
    "assign": (gen_resource_variable_ops.assign_variable_op, "AssignVariableOp"),
    "assign_add": (gen_resource_variable_ops.assign_add_variable_op, "AssignAddVariableOp"),
    "assign_sub": (gen_resource_variable_ops.assign_sub_variable_op, "AssignSubVariableOp"),
}

_INT32_LIMIT = 2**31

_SCATTER_METHODS = (
    "scatter_add",
    "scatter_sub",
    "scatter_update",
    "scatter_max",
    "scatter_min",
    "scatter_mul",
    "scatter_div",
    "scatter_nd_add",
    "scatter_nd_sub",
    "scatter_nd_update",
    "scatter_nd_max",
    "scatter_nd_min",
    "batch_scatter_update",
)


# ---------------------------------------------------------------------- who counts a write


class _CountFrame:
    """One open :func:`writes_counted_by_caller` context: its guards, and those written."""

    __slots__ = ("guards", "written")

    def __init__(self, guards: Iterable[Guard]) -> None:
        self.guards = set(guards)
        self.written: set[Guard] = set()


_counting = threading.local()  # .frames: the open contexts of this thread, outermost first
# Contexts open in any thread: while none is, a write skips the thread-local lookup (the
# common case; an eager scalar write costs about 10 us in all).
_open_frames = [0]
_open_frames_lock = threading.Lock()


def _writes_to_count(guard: Guard, writes: int) -> int:
    """The versions a write through a SafeVariable adds itself: ``writes``, or 0 when an
    enclosing :func:`writes_counted_by_caller` of this thread counts that variable."""
    if not _open_frames[0]:
        return writes
    frames = getattr(_counting, "frames", None)
    if not frames:
        return writes
    for frame in frames:
        if guard in frame.guards:
            frame.written.add(guard)
            return 0
    return writes


@contextlib.contextmanager
def writes_counted_by_caller(guards: Iterable[Guard]) -> Iterator[set[Guard]]:
    """Inside, writes through the SafeVariables of ``guards`` are locked but not counted.

    For code that makes one logical update out of several writes and counts it itself:
    :class:`~safevars.SafeOptimizer` (one version per step, however many writes Keras
    makes), and :mod:`safevars.creator_scope` (one version per
    ``strategy.extended.update``, however many replica copies it writes).

    Args:
      guards: The guards whose writes the caller counts.

    Yields:
      The set of those guards written so far through a SafeVariable (filled as the
      writes happen); the caller adds their versions (``Guard.bump_eager`` eagerly,
      ``Guard.bump_graph`` while tracing).

    Thread safety: applies to the calling thread only (eager writes and writes traced
    by it). When contexts nest, the outermost one that names a guard counts it.

    Modes: eager and while tracing a ``tf.function``.
    """
    frame = _CountFrame(guards)
    frames = getattr(_counting, "frames", None)
    if frames is None:
        frames = _counting.frames = []
    with _open_frames_lock:
        _open_frames[0] += 1
    try:
        frames.append(frame)
        yield frame.written
    finally:
        if frame in frames:
            frames.remove(frame)
        with _open_frames_lock:
            _open_frames[0] -= 1


# Graphs in which a transaction's body is being traced: graph -> [index of the first op
# of the outermost such body, how many are open]. Keyed by graph, not by thread: under
# MirroredStrategy, replica threads trace into one graph and merge_call runs writes in
# yet another thread.
_ORDERED: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
_ORDERED_LOCK = threading.Lock()


@contextlib.contextmanager
def program_order() -> Iterator[None]:
    """While tracing, writes through SafeVariables wait for every op traced before them.

    :func:`safevars.transaction` traces its ``fn`` inside this, so a run-time failure
    (a ``tf.debugging`` assertion, a failing kernel) stops every write that comes after
    it in ``fn``: writes before it are made (a graph transaction does not roll back).

    Modes: a no-op eagerly, where Python runs ``fn`` in order anyway.
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    with _ORDERED_LOCK:
        entry = _ORDERED.get(graph)
        if entry is None:
            _ORDERED[graph] = entry = [len(graph.get_operations()), 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _ORDERED_LOCK:
            entry[1] -= 1
            if not entry[1]:
                del _ORDERED[graph]


def _earlier_ops() -> list[Any]:
    """Ops of the current graph traced since the outermost :func:`program_order` began."""
    if not _ORDERED:
        return []
    graph = tf.compat.v1.get_default_graph()
    entry = _ORDERED.get(graph)
    return [] if entry is None else graph.get_operations()[entry[0] :]


class SafeVariable(wrapt.ObjectProxy):
    """A ``tf.Variable`` whose writes are locked and versioned and whose reads snapshot.

    ``SafeVariable(initial_value, **kwargs)`` takes exactly what ``tf.Variable`` takes
    and creates one (so inside ``strategy.scope()`` the strategy creates it);
    :func:`wrap` wraps an existing variable instead. ``isinstance(v, tf.Variable)`` holds,
    and every ``tf.Variable`` attribute not listed here is the wrapped variable's.

    Thread safety:
      ``assign``, ``assign_add``, ``assign_sub``, the ``scatter_*`` family, slice
      assignment (``v[0].assign(x)``), :meth:`update` and :meth:`compare_and_assign` are
      atomic with respect to each other and to :func:`safevars.locked`,
      :func:`safevars.transaction` and :func:`safevars.snapshot` on the same variable, in
      any thread. Each completed write adds exactly 1 to :attr:`version`. Plain reads
      take no lock and never wait.

    Modes:
      Eagerly, the lock is a re-entrant per-variable ``threading.Lock`` and the version a
      Python ``int`` (the cost is one uncontended lock acquisition). The first time the
      variable is written, versioned or snapshotted inside a ``tf.function`` it switches
      to run-time mode for good: graph writes run inside a ``tf.CriticalSection`` placed
      on the variable's device, eager writes take the same mutex (so eager threads and
      running graphs exclude each other), and the version lives in an int64 resource
      variable. Run-time mode makes eager writes dearer (a ``MutexLock`` op each).
      Under ``tf.distribute`` see :mod:`safevars.distribute`.
    """

    # ------------------------------------------------------------------ construction

    def __init__(self, initial_value: Any = None, **kwargs: Any) -> None:
        check_strategy()
        variable = tf.Variable(initial_value, **kwargs)
        if isinstance(variable, SafeVariable):  # created inside safevars.scope()
            variable = variable.__wrapped__
        super().__init__(variable)
        self._self_init(variable, 0)

    @classmethod
    def _from_variable(cls, variable: tf.Variable, version: int = 0) -> SafeVariable:
        proxy = cls.__new__(cls)
        wrapt.ObjectProxy.__init__(proxy, variable)
        proxy._self_init(variable, version)
        return proxy

    def _self_init(self, variable: tf.Variable, version: int) -> None:
        # Cached: every write reads them, and the wrapped variable's never change.
        self._self_guard = _guard_for(variable, version)
        self._self_static_shape = _static_shape(variable)
        self._self_dtype = variable.dtype
        # Writes inside strategy.run are merged across replicas first, except for a
        # sync-on-read variable (Keras metrics): each replica writes its own copy.
        self._self_mirrored = isinstance(
            variable, ds_values.DistributedVariable
        ) and not isinstance(variable, ds_values.SyncOnReadVariable)
        # A Python number the op converts itself (float32 <- float, int32 <- int).
        self._self_number_kind = {tf.float32: float, tf.int32: int}.get(variable.dtype)
        # For a plain eager resource variable the write kernels are called directly:
        # ResourceVariable.assign* adds only graph bookkeeping that is empty eagerly, and
        # its Python cost would dominate a scalar write (see the eager benchmark).
        plain = (
            type(variable) is resource_variable_ops.ResourceVariable
            and variable._cached_value is None
            and isinstance(variable.handle, ops.EagerTensor)
        )
        self._self_handle = variable.handle if plain else None
        self._self_validate_shape = bool(
            plain and variable._validate_shape and variable.shape.is_fully_defined()
        )

    # ------------------------------------------------------------------ identity

    def ref(self) -> object_identity.Reference:
        """A hashable reference to this SafeVariable (``ref().deref()`` is ``self``)."""
        return object_identity.Reference(self)

    experimental_ref = ref

    def __repr__(self) -> str:
        inner = repr(self.__wrapped__)
        return f"<safevars.SafeVariable version={self._self_guard.version()} {inner[1:]}"

    def __copy__(self) -> SafeVariable:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SafeVariable:
        """An independent SafeVariable with the same value and version and a new lock."""
        snap = self.snapshot()
        with tf.init_scope():
            twin = copy.deepcopy(self.__wrapped__, memo)
            twin.assign(snap.value)
        clone = type(self)._from_variable(twin, int(snap.version))
        memo[id(self)] = clone
        return clone

    def __reduce_ex__(self, protocol: int) -> Any:
        """Pickles like a plain ``tf.Variable``: value, name, dtype, trainable, constraint.

        The value and the version are taken together (a snapshot); the unpickled
        SafeVariable starts from that version, with a lock of its own (locks are
        per process and never shared with the original). Like a plain variable, only an
        eager, non-distributed variable pickles.
        """
        wrapped = self.__wrapped__
        if type(wrapped) is not resource_variable_ops.ResourceVariable:
            return wrapped.__reduce_ex__(protocol)  # raises where plain TensorFlow does
        snap = self.snapshot()
        return (
            functools.partial(
                _unpickle,
                initial_value=snap.numpy(),
                version=snap.version,
                trainable=wrapped.trainable,
                name=wrapped._shared_name,
                dtype=wrapped.dtype,
                constraint=wrapped.constraint,
            ),
            (),
        )

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int | tf.Tensor:
        """Number of completed writes (restored from checkpoints).

        Returns:
          Eagerly, a Python ``int``. Inside a ``tf.function``, an int64 scalar tensor read
          when the graph runs (reading it there switches the variable to run-time mode).
        """
        return self._self_guard.version()

    def statistics(self) -> LockStatistics:
        """A frozen record of this variable's lock state and write count, for debugging."""
        return self._self_guard.statistics()

    @property
    def guard(self) -> Guard:
        """The :class:`~safevars.locking.Guard` (lock and version) of this variable."""
        return self._self_guard

    # ------------------------------------------------------------------ writes

    def _write(self, op: Callable[[], Any], read_value: bool, after: Any = ()) -> Any:
        """Runs the write ``op`` under the lock and counts it (eager or graph).

        In a graph the lock is taken once ``after`` (the value to write) is computed.
        """
        guard = self._self_guard
        if tf.executing_eagerly():
            result = guard.call_locked(op, writes=_writes_to_count(guard, 1))
            return self if read_value else result
        writes = held_in_graph(guard)
        if writes is not None:
            return self._graph_write_body(op, writes)
        out = graph_section([guard], lambda: self._graph_write_body(op, None), after)
        return out if read_value else out.op

    def _graph_write_body(
        self, op: Callable[[], Any], writes: list[Any] | None, count: int = 1
    ) -> Any:
        with tf.control_dependencies(_earlier_ops()):
            written = op()
        written = written.op if isinstance(written, tf.Tensor) else written
        guard = self._self_guard
        count = _writes_to_count(guard, count)
        bumped = guard.bump_graph(written, count) if count else written
        if writes is not None:
            writes.append(bumped)
        with tf.control_dependencies([bumped]):
            return self.__wrapped__.read_value()

    def _checked(self, value: Any, argument: str) -> Any:
        """``value`` converted to the variable's dtype, its shape checked, or raises.

        Called on every write, so it keeps to cached attributes and cheap checks.
        """
        dtype = self._self_dtype
        expected = self._self_static_shape
        if type(value) is self._self_number_kind and expected == ():
            # v.assign_add(1.0): the op converts a Python number (to float32 or int32,
            # the variable's dtype here) more cheaply than tf.convert_to_tensor does. An
            # int outside int32 would reach the op as int64: it goes the slow way, which
            # wraps it around as plain TensorFlow does (assign(2**40) writes 0).
            if type(value) is float or -_INT32_LIMIT <= value < _INT32_LIMIT:
                return value
        if isinstance(value, tf.Tensor) and value.dtype == dtype:
            tensor = value
        else:
            try:
                tensor = tf.convert_to_tensor(value, dtype=dtype)
            except (TypeError, ValueError) as e:
                raise DTypeMismatchError(
                    f"{argument}={_short(value)} cannot be converted to this variable's "
                    f"dtype {dtype.name} ({e}). Cast it first, for example "
                    f"tf.cast(x, {dtype!r})."
                ) from None
        if expected is not None:
            shape_tuple = getattr(tensor, "_shape_tuple", None)  # EagerTensor: no TensorShape
            if shape_tuple is not None:
                got = shape_tuple()
            else:
                got = None if tensor.shape.rank is None else tuple(tensor.shape.as_list())
            if got is not None and got != expected and not _shapes_fit(expected, got):
                raise ShapeMismatchError(
                    f"{argument} has shape {list(got)} but variable "
                    f"{self.__wrapped__.name!r} has shape {list(expected)}. Reshape the "
                    "value, or create the variable with shape=tf.TensorShape(None) to "
                    "allow any shape."
                )
        return tensor

    def assign(
        self,
        value: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Assigns a new value, atomically, and adds 1 to :attr:`version`.

        Args:
          value: A tensor (or convertible) of the variable's shape and dtype.
          use_locking: Accepted for compatibility; the write is always locked.
          name: Optional op name.
          read_value: If True, return the variable (eagerly) or the new value (graph).

        Raises:
          DTypeMismatchError: ``value`` does not convert to the variable's dtype (also a
            ``TypeError`` and a ``ValueError``, as plain TensorFlow raises either).
          ShapeMismatchError: ``value``'s shape differs from the variable's (also a
            ``ValueError`` and a ``tf.errors.InvalidArgumentError``).

        Python integers convert as plain TensorFlow converts them: into an ``int32``
        variable, ``2**40`` wraps around (writes 0), as ``tf.Variable.assign`` does.

        Thread safety: atomic with respect to every safevars operation on this variable.

        Modes: eagerly returns ``self`` (or ``None`` with ``read_value=False``); in a
        ``tf.function`` returns the value written (or the op), ordered after the write.
        """
        return self._assign_op("assign", value, "value", use_locking, name, read_value)

    def assign_add(
        self,
        delta: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Adds ``delta`` atomically and adds 1 to :attr:`version`. See :meth:`assign`."""
        return self._assign_op("assign_add", delta, "delta", use_locking, name, read_value)

    def assign_sub(
        self,
        delta: Any,
        use_locking: bool | None = None,
        name: str | None = None,
        read_value: bool = True,
    ) -> Any:
        """Subtracts ``delta`` atomically and adds 1 to :attr:`version`. See :meth:`assign`."""
        return self._assign_op("assign_sub", delta, "delta", use_locking, name, read_value)

    def _assign_op(
        self,
        method: str,
        value: Any,
        argument: str,
        use_locking: bool | None,
        name: str | None,
        read_value: bool,
    ) -> Any:
        """The one write path of ``assign``, ``assign_add`` and ``assign_sub``."""
        tensor = self._checked(value, argument)
        wrapped = self.__wrapped__
        ctx = merge_context(wrapped) if self._self_mirrored else None
        if ctx is not None:  # Inside strategy.run: merge replicas, then one locked write.
            return merged_write(
                ctx,
                wrapped,
                lambda v: self._assign_op(method, v, argument, use_locking, name, read_value),
                tensor,
            )
        handle = self._self_handle
        if handle is not None and _direct_kernel_writes and tf.executing_eagerly():
            kernel, op_name = _KERNELS[method]
            attrs = ("validate_shape", self._self_validate_shape) if method == "assign" else ()
            guard = self._self_guard
            writes = _writes_to_count(guard, 1)
            guard.call_locked(
                lambda: guard.write_counted(kernel, op_name, (handle, tensor), attrs, writes)
            )
            return self if read_value else None
        wrapped_method = getattr(wrapped, method)
        return self._write(
            lambda: wrapped_method(tensor, use_locking, name, read_value=False),
            read_value,
            after=tensor,
        )

    def _strided_slice_assign(
        self,
        begin,
        end,
        strides,
        value,
        name,
        begin_mask,
        end_mask,
        ellipsis_mask,
        new_axis_mask,
        shrink_axis_mask,
    ):
        wrapped = self.__wrapped__
        return self._write(
            lambda: wrapped._strided_slice_assign(
                begin=begin,
                end=end,
                strides=strides,
                value=value,
                name=name,
                begin_mask=begin_mask,
                end_mask=end_mask,
                ellipsis_mask=ellipsis_mask,
                new_axis_mask=new_axis_mask,
                shrink_axis_mask=shrink_axis_mask,
            ),
            read_value=True,
        )

    def __getitem__(self, slice_spec: Any) -> tf.Tensor:
        # The slice's ``.assign`` must come back to this proxy, not the wrapped variable.
        return tensor_getitem_override._slice_helper_var(self, slice_spec)

    def update(
        self,
        fn: Callable[[tf.Tensor], Any],
        name: str | None = None,
        timeout: float | None = None,
    ) -> tf.Tensor:
        """Atomic read-modify-write: writes ``fn(current_value)`` and returns it.

        Args:
          fn: Called with the current value (a tensor); returns the new value, of the
            variable's shape and dtype. Eagerly it may run Python code; in a graph it is
            traced once.
          name: Optional name scope.
          timeout: Eagerly, seconds to wait for the lock at most (None: no limit).

        Returns:
          The value written (a tensor).

        Raises:
          NotCallableError: ``fn`` is not callable.
          LockTimeoutError: the lock was not free within ``timeout``; nothing written.
          DTypeMismatchError, ShapeMismatchError: ``fn``'s result does not fit; nothing is
            written and the version does not change.
          Exception: whatever ``fn`` raises propagates unchanged, with nothing written
            (in a ``tf.function``, also a run-time failure of an op ``fn`` created).

        Thread safety: no other safevars write, transaction or snapshot of this variable
        can happen between the read and the write; adds exactly 1 to :attr:`version`.

        Modes: eagerly under the variable's lock; in a ``tf.function`` inside its
        ``tf.CriticalSection``, so the exclusion holds when the graph runs, and the write
        runs only after every op ``fn`` created has succeeded (a ``tf.debugging``
        assertion in ``fn`` that fails at run time writes nothing and counts nothing). Inside
        ``strategy.run`` on a mirrored variable, every replica's ``fn`` is applied in
        replica order inside one critical section (one version each) and each replica
        gets back the value its own ``fn`` wrote; see :mod:`safevars.distribute`.
        ``timeout`` applies to eager waits; a ``MutexLock`` op in a running graph cannot
        time out.
        """
        timeout = check_timeout(timeout)
        if not callable(fn):
            raise NotCallableError(
                f"update(fn) needs a callable taking the current value, got {_short(fn)}. "
                "Pass for example lambda x: x + 1."
            )
        ctx = merge_context(self.__wrapped__) if self._self_mirrored else None
        if ctx is not None:  # Inside strategy.run: every replica's fn, in replica order.
            return merged_update(ctx, lambda fns: self._update_all(fns, name), fn)
        return self._update_all([fn], name, timeout)[0]

    def _update_all(
        self,
        fns: list[Callable[[tf.Tensor], Any]],
        name: str | None = None,
        timeout: float | None = None,
    ) -> list[tf.Tensor]:
        """Applies ``fns`` in order as one critical section; one version per function."""
        wrapped = self.__wrapped__
        guard = self._self_guard

        def apply_in_order() -> list[tf.Tensor]:
            value, results = wrapped.read_value(), []
            for fn in fns:
                value = self._checked(fn(value), "the result of fn")
                results.append(value)
            return results

        if tf.executing_eagerly():
            handle = self._self_handle if _direct_kernel_writes else None

            def read_modify_write() -> list[tf.Tensor]:
                results = apply_in_order()
                writes = _writes_to_count(guard, len(fns))
                if handle is not None:
                    kernel, op_name = _KERNELS["assign"]
                    guard.write_counted(
                        kernel,
                        op_name,
                        (handle, results[-1]),
                        ("validate_shape", self._self_validate_shape),
                        writes=writes,
                    )
                else:
                    wrapped.assign(results[-1], read_value=False)
                    if writes:
                        guard.bump_eager(writes)
                return results

            return guard.call_locked(read_modify_write, timeout=timeout)

        def body() -> list[tf.Tensor]:
            graph = tf.compat.v1.get_default_graph()
            first = len(graph.get_operations())
            results = apply_in_order()
            # The write waits for every op fn created, not only for its result: a
            # run-time assertion in fn that fails writes nothing (and counts nothing).
            with tf.control_dependencies(graph.get_operations()[first:]):
                written = self._graph_write_body(
                    lambda: wrapped.assign(results[-1], read_value=False),
                    held_in_graph(guard),
                    count=len(fns),
                )
            with tf.control_dependencies([written]):
                return [tf.identity(r) for r in results]

        if held_in_graph(guard) is not None:
            return body()
        with tf.name_scope(name or "safevars_update"):
            return graph_section([guard], body)

    def compare_and_assign(
        self, value: Any, expected_version: int | tf.Tensor, timeout: float | None = None
    ) -> bool | tf.Tensor:
        """Writes ``value`` only if :attr:`version` still equals ``expected_version``.

        Args:
          value: The value to write, of the variable's shape and dtype.
          expected_version: The version the caller last saw (an ``int``, or an integer
            tensor inside a ``tf.function``).
          timeout: Eagerly, seconds to wait for the lock at most (None: no limit).

        Returns:
          Whether it wrote: a Python ``bool`` eagerly, a bool tensor in a ``tf.function``.

        Raises:
          InvalidArgumentError: ``expected_version`` is not a Python ``int`` (or NumPy
            integer) nor an integer scalar tensor (a float, a string, a ``bool`` or a
            tensor of another shape is refused, never truncated), or it is negative.
          DTypeMismatchError, ShapeMismatchError: ``value`` does not fit the variable.
          LockTimeoutError: the lock was not free within ``timeout``; nothing written.

        Thread safety: the comparison and the write are one atomic step.

        Modes: eagerly under the lock; in a graph inside the critical section.
        """
        timeout = check_timeout(timeout)
        expected_version = _version_argument(expected_version, "expected_version")
        tensor = self._checked(value, "value")
        wrapped = self.__wrapped__
        if self._self_mirrored and merge_context(wrapped) is not None:
            raise UnsupportedStrategyError(
                "compare_and_assign on a mirrored variable inside strategy.run is not "
                "supported: replicas would race on one expected version. Call it outside "
                "strategy.run (cross-replica context), or use update(fn) in the replicas."
            )
        guard = self._self_guard
        if tf.executing_eagerly():
            with hold([guard], timeout):  # The comparison and the write under one lock.
                if guard.version() != expected_version:
                    return False
                guard.call_locked(
                    lambda: wrapped.assign(tensor, read_value=False),
                    writes=_writes_to_count(guard, 1),
                )
                return True

        def body() -> tf.Tensor:
            expected = tf.cast(expected_version, tf.int64)
            current = guard.version_var.read_value()

            def write() -> tf.Tensor:
                self._graph_write_body(lambda: wrapped.assign(tensor, read_value=False), None)
                return tf.constant(True)

            return tf.cond(tf.equal(current, expected), write, lambda: tf.constant(False))

        if held_in_graph(guard) is not None:
            return body()
        return graph_section([guard], body)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, timeout: float | None = None) -> Snapshot:
        """An immutable :class:`~safevars.Snapshot` of value and version, taken together.

        Args:
          timeout: Eagerly, seconds to wait at most when the snapshot has to wait for a
            writer (None: no limit); :class:`~safevars.LockTimeoutError` after that.

        Thread safety: value and version belong to the same instant; later writes never
        change the snapshot. Readers do not wait for other readers eagerly (they retry
        if a writer intervened).

        Modes: in a ``tf.function`` the snapshot's ``value`` and ``version`` are tensors
        read inside the variable's critical section.
        """
        return take_snapshots([self], timeout)[0]

    # ------------------------------------------------------------------ checkpoints

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        guard = self._self_guard
        guard.sync_version_var()
        children = dict(self.__wrapped__._trackable_children(save_type, **kwargs))
        children["safevars_version"] = guard.version_var
        return children

    def _export_to_saved_model_graph(
        self,
        object_map: Any = None,
        tensor_map: Any = None,
        options: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        # The SavedModel maps the *proxy* to the exported copy of the wrapped variable.
        wrapped = self.__wrapped__
        handles = wrapped._export_to_saved_model_graph(
            object_map=object_map, tensor_map=tensor_map, options=options, **kwargs
        )
        object_map[self] = object_map[wrapped]
        return handles


for _method in _SCATTER_METHODS:

    def _make(method: str) -> Callable[..., Any]:
        def scatter(self: SafeVariable, *args: Any, **kwargs: Any) -> Any:
            if self._self_mirrored and merge_context(self.__wrapped__) is not None:
                raise UnsupportedStrategyError(
                    f"{method} on a mirrored variable inside strategy.run is not "
                    "supported by safevars. Call it outside strategy.run (cross-replica "
                    "context) or use assign_add/update, which merge the replicas first."
                )
            wrapped_method = getattr(self.__wrapped__, method)

            def checked_write() -> Any:
                check = _index_check(self, method, args, kwargs)
                with tf.control_dependencies([] if check is None else [check]):
                    return wrapped_method(*args, **kwargs)

            return self._write(checked_write, read_value=True)

        scatter.__name__ = method
        scatter.__qualname__ = f"SafeVariable.{method}"
        scatter.__doc__ = (
            f"``tf.Variable.{method}``, atomically, adding 1 to :attr:`version`.\n\n"
            "Raises:\n  IndexOutOfRangeError: an index lies outside the variable; "
            "nothing is written (plain TensorFlow writes the rows before the bad "
            "index). In a ``tf.function`` the check is an assertion the write waits "
            "for: ``tf.errors.InvalidArgumentError`` at run time, nothing written.\n\n"
            "Thread safety: atomic with respect to every safevars operation on this "
            "variable.\n\nModes: as :meth:`assign`."
        )
        return scatter

    setattr(SafeVariable, _method, _make(_method))
del _method


def _to_tensor(
    value: SafeVariable,
    dtype: tf.DType | None = None,
    name: str | None = None,
    as_ref: bool = False,
) -> tf.Tensor:
    # TensorFlow looks conversion functions up by type(value); the proxy's type is not a
    # tf.Variable subclass, so it needs its own entry (a read of the wrapped variable,
    # recorded on gradient tapes like any variable read).
    return value.__wrapped__._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)


tensor_conversion_registry.register_tensor_conversion_function(SafeVariable, _to_tensor)


def _unpickle(version: int, **kwargs: Any) -> SafeVariable:
    # As plain TensorFlow unpickles: a ResourceVariable made directly, so neither a
    # strategy nor a creator scope (safevars.scope) is involved.
    variable = resource_variable_ops.ResourceVariable(**kwargs)
    return SafeVariable._from_variable(variable, version)


def _version_argument(value: Any, argument: str) -> int | tf.Tensor:
    """A version argument as an ``int`` (eagerly) or an int64 tensor (graph), or raises.

    Versions are integers: a float (``2.9``) or a string (``"1"``) is refused, never
    truncated or parsed.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"{argument} must be >= 0, got {int(value)}.")
        return int(value)
    if isinstance(value, tf.Tensor):
        if not value.dtype.is_integer:
            raise InvalidArgumentError(
                f"{argument} must be an integer version (an int, or an integer tensor), "
                f"got a {value.dtype.name} tensor {_short(value)}. Versions are never "
                "rounded: pass the int read from .version or a snapshot."
            )
        rank = value.shape.rank
        if rank is not None and rank != 0:
            raise InvalidArgumentError(
                f"{argument} must be a scalar version, got a tensor of shape "
                f"{value.shape.as_list()}: {_short(value)}. Pass one version."
            )
        if isinstance(value, ops.EagerTensor):
            return _version_argument(int(value.numpy()), argument)
        if rank is None:
            value = tf.ensure_shape(value, [])
        return tf.cast(value, tf.int64)
    raise InvalidArgumentError(
        f"{argument} must be an int (a version read from .version or a snapshot) or an "
        f"integer scalar tensor, got {_short(value)}."
    )


def _index_check(variable: SafeVariable, method: str, args: tuple, kwargs: dict) -> Any:
    """Checks the indices of a scatter before it writes anything.

    Plain TensorFlow's scatter kernels write the rows before a bad index and then fail;
    safevars checks every index first. Eagerly a bad index raises
    :class:`~safevars.IndexOutOfRangeError`; in a graph the check is an assertion op
    (returned) that the write waits for. Arguments the wrapped method itself refuses
    (not ``IndexedSlices``, non-integer indices) are left to it, so its error is plain
    TensorFlow's.
    """
    if method.startswith("scatter_nd"):
        indices = kwargs.get("indices", args[0] if args else None)
    else:
        delta = kwargs.get("sparse_delta", args[0] if args else None)
        if not isinstance(delta, tf.IndexedSlices):
            return None
        indices = delta.indices
    try:
        indices = tf.convert_to_tensor(indices)
    except (TypeError, ValueError):
        return None
    rank = indices.shape.rank
    if not indices.dtype.is_integer or rank is None:
        return None
    wrapped = variable.__wrapped__
    eager = tf.executing_eagerly()
    shape = variable._self_static_shape
    if shape is None or None in shape:
        shape = tf.shape(wrapped.read_value(), out_type=indices.dtype)
        if eager:
            shape = tuple(shape.numpy().tolist())
    if method.startswith("scatter_nd"):
        depth = indices.shape[-1] if rank else None
        if depth is None:
            return None
        limit = shape[:depth]
    elif method == "batch_scatter_update":
        if rank < 1:
            return None
        limit = shape[rank - 1]
    else:
        if variable.shape.rank == 0:
            return None
        limit = shape[0]
    name = wrapped.name
    if eager:  # The same test in NumPy: a few microseconds instead of four kernels.
        values, bound = indices.numpy(), np.asarray(limit)
        if values.size == 0 or ((values >= 0) & (values < bound)).all():
            return None
        raise IndexOutOfRangeError(
            f"{method} on variable {name!r} of shape {wrapped.shape.as_list()}: indices "
            f"{_short(values.tolist())} reach outside it (each must lie in "
            f"[0, {bound.tolist()})). Nothing was written. Drop or clip the "
            "out-of-range indices."
        )
    limit = tf.cast(limit, indices.dtype)
    inside = tf.reduce_all(tf.logical_and(indices >= 0, indices < limit))
    return tf.debugging.Assert(
        inside,
        [
            (
                f"safevars IndexOutOfRangeError: {method} on variable {name!r}: an index lies "
                "outside the variable; nothing was written. indices:"
            ),
            indices,
        ],
        summarize=16,
    )


def _backing(variable: Any) -> Any:
    """The ``tf.Variable`` a variable-like object stores its value in, or None."""
    if isinstance(variable, tf.Variable):
        return variable
    for attribute in ("_value", "value"):  # keras.Variable under the TensorFlow backend
        backing = getattr(variable, attribute, None)
        if isinstance(backing, tf.Variable):
            return backing
    return None


def _weights_of(obj: Any) -> list[Any] | None:
    """The variables of a Keras layer or model (``weights``) or a ``tf.Module``, or None."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(obj, keras.layers.Layer):
        return list(obj.weights)
    if isinstance(obj, tf.Module) and not isinstance(obj, tf.Variable):
        return list(obj.variables)
    return None


def as_safe_variables(structure: Any, argument: str) -> tuple[Any, list[SafeVariable]]:
    """``structure`` with every variable a SafeVariable and every layer its weights.

    Args:
      structure: A SafeVariable, ``tf.Variable``, ``keras.Variable``, Keras layer or
        model, ``tf.Module``, or a (nested) list, tuple or dict of them. A plain or
        Keras variable is wrapped with :func:`wrap` (so it gets the lock every other
        ``wrap`` of it shares); a layer, model or module becomes the list of its
        weights (``layer.weights``, the order of ``get_weights``/``set_weights``).
      argument: The argument's name, for error messages.

    Returns:
      The structure with those replacements, and its leaves (SafeVariables) in order.

    Raises:
      InvalidArgumentError: a leaf is something else, or the structure holds no
        variable at all (an unbuilt model has no weights yet).
    """
    if type(structure) is SafeVariable:
        return structure, [structure]

    def expand(leaf: Any) -> Any:
        weights = None if _backing(leaf) is not None else _weights_of(leaf)
        return leaf if weights is None else weights

    expanded = tf.nest.map_structure(expand, structure)
    leaves = tf.nest.flatten(expanded)
    if not leaves:
        raise InvalidArgumentError(
            f"{argument} holds no variable (an empty structure, or a Keras model that is "
            "not built yet: build it, for example by calling it once or giving it an "
            "Input, before locking or snapshotting it)."
        )
    converted = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, SafeVariable):
            converted.append(leaf)
            continue
        if _backing(leaf) is None:
            raise InvalidArgumentError(
                f"{argument}[{index}] is {type(leaf).__name__}, not a variable. Pass "
                "SafeVariables, tf.Variables or keras.Variables (wrapped on the fly with "
                "safevars.wrap), or a Keras layer or model (its weights)."
            )
        converted.append(wrap(leaf))
    return tf.nest.pack_sequence_as(expanded, converted), converted


def wrap(variable: tf.Variable | Any) -> SafeVariable:
    """Wraps an existing ``tf.Variable`` (or a Keras variable's backing variable).

    Args:
      variable: A ``tf.Variable`` (resource or distributed), a ``keras.Variable`` (its
        backing ``tf.Variable`` is wrapped; a Keras variable created inside
        :func:`safevars.scope` returns the SafeVariable it is backed by) or a
        SafeVariable (returned as is).

    Returns:
      A :class:`SafeVariable` sharing the variable's storage. Wrapping the same variable
      twice gives proxies that share one lock and one version.

    Raises:
      InvalidArgumentError: ``variable`` is not a variable.

    Thread safety: writes made through the original object (not the returned proxy) are
    neither locked nor counted.
    """
    if isinstance(variable, SafeVariable):
        return variable
    backing = _backing(variable)
    if isinstance(backing, SafeVariable):
        return backing  # a keras.Variable created inside safevars.scope()
    if backing is not None:
        variable = backing  # a keras.Variable under the TensorFlow backend
    if not isinstance(variable, tf.Variable):
        raise InvalidArgumentError(
            f"wrap(variable) needs a tf.Variable or keras.Variable, got {_short(variable)}. "
            "To create a new variable use safevars.SafeVariable(initial_value)."
        )
    return SafeVariable._from_variable(variable)


def _static_shape(variable: tf.Variable) -> tuple[int | None, ...] | None:
    shape = variable.shape
    return None if shape.rank is None else tuple(shape.as_list())


def _shapes_fit(expected: tuple[int | None, ...], got: tuple[int | None, ...]) -> bool:
    if len(expected) != len(got):
        return False
    return all(e is None or g is None or e == g for e, g in zip(expected, got))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
