"""How a SafeVariable writes: locked, counted, checked, one path eager and in a graph.

:class:`_Writes` holds SafeVariable's write methods. Each write runs under the
variable's :class:`~safevars.locking.Guard` and adds to its version (unless enclosing
code counts it, :mod:`~safevars.variable.write_counting`); eagerly, a plain resource
variable's ``assign*`` calls the write kernel directly (``_KERNELS``), with the version
counted by the same C call chain (:meth:`~safevars.locking.Guard.write_counted`).
``_direct_kernel_writes`` turns that fast path off while :func:`safevars.audit` watches
``ResourceVariable``'s methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars._tf_internal import ds_values, gen_resource_variable_ops, tensor_getitem_override
from safevars._validation import short
from safevars.distribute import merge_context, merged_update, merged_write
from safevars.errors import (
    DTypeMismatchError,
    NotCallableError,
    ShapeMismatchError,
    UnsupportedStrategyError,
)
from safevars.locking import check_timeout, hold
from safevars.sections import defer_count, graph_section, held_in_graph
from safevars.variable.checks import _shapes_fit, _version_argument
from safevars.variable.write_counting import _writes_to_count
from safevars.variable.write_order import _earlier_ops, record_count

if TYPE_CHECKING:
    from safevars.locking import Guard

    class _SafeVariableFields:
        """What the mixins use of SafeVariable (set by ``SafeVariable._self_init``)."""

        __wrapped__: Any
        _self_guard: Guard
        _self_static_shape: tuple[int | None, ...] | None
        _self_dtype: tf.DType
        _self_mirrored: bool
        _self_number_kind: type[float] | type[int] | None
        _self_handle: Any
        _self_validate_shape: bool
        shape: tf.TensorShape  # The wrapped variable's (the proxy forwards it).

        def _unread(self, write: Any) -> Any: ...

else:
    _SafeVariableFields = object  # Nothing at run time: no attribute shadows the proxy's.


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


def _write_op(written: Any) -> Any:
    """The op of what a traced write returned, for the version count to wait for.

    A tensor's op; for a variable, its ``op`` too: ``ResourceVariable.scatter_*`` return
    an unread variable (``_lazy_read``) whose ``op`` is the scatter (its handle may be
    the eager handle the function captured, which has no graph). Anything else (an op,
    a group of a distributed variable's updates, ``None``) as it is.
    """
    if isinstance(written, (tf.Tensor, tf.Variable)):
        return written.op
    return written


class _Writes(_SafeVariableFields):
    """The writes of :class:`~safevars.SafeVariable` (a mixin, no state of its own).

    ``assign``, ``assign_add``, ``assign_sub``, slice assignment, :meth:`update` and
    :meth:`compare_and_assign`, and the one locked, counted write path under them
    (:meth:`_write`, eager fast path in :meth:`_assign_op`); see the class docstring of
    SafeVariable for the guarantees.
    """

    __slots__ = ()

    def _write(self, op: Callable[[], Any], read_value: bool, after: Any = ()) -> Any:
        """Runs the write ``op`` under the lock and counts it (eager or graph).

        In a graph the lock is taken once ``after`` (the value to write) is computed.
        With ``read_value``, returns the variable to be read after the write
        (:meth:`~safevars.SafeVariable._unread`), as plain TensorFlow does; nothing is
        read unless the caller reads it.
        """
        guard = self._self_guard
        if tf.executing_eagerly():
            result = guard.call_locked(op, writes=_writes_to_count(guard, 1))
            return self._unread(None) if read_value else result
        writes = held_in_graph(guard)
        if writes is not None:
            done = self._graph_write_body(op, writes)
        else:
            body = functools.partial(self._graph_write_body, op, None, own=True)
            done = graph_section([guard], body, after)
        return self._unread(done) if read_value else done

    def _graph_write_body(
        self,
        op: Callable[[], Any],
        writes: list[Any] | None,
        count: int = 1,
        own: bool = False,
    ) -> Any:
        """The write and its version count, traced in the section; returns the count's
        op (or the write's, when the section counts it). It reads nothing: a read would
        be one more op in every function that writes, and would make the next write of a
        large variable copy its buffer. ``own``: the section's whole body is this write,
        so the section may count it (:func:`safevars.sections.defer_count`: joined writes
        of a variable then share one count)."""
        guard = self._self_guard
        with tf.control_dependencies(_earlier_ops(guard)):
            written = _write_op(op())
        count = _writes_to_count(guard, count)
        if count and own and defer_count(guard, written, count):
            bumped = written  # the section counts it after this body
        else:
            bumped = guard.bump_graph(written, count) if count else written
        record_count(guard, bumped)
        if writes is not None:
            writes.append(bumped)
        return bumped

    def _checked(self, value: Any, argument: str, replaces: bool = True) -> Any:
        """``value`` converted to the variable's dtype, its shape checked, or raises.

        ``replaces``: the value replaces the variable's (``assign``, ``update``), rather
        than being added to it (``assign_add``/``assign_sub``, which never broadcast).
        A shape error keeps the words plain TensorFlow uses for the same mistake
        ("... are incompatible", "shapes must be equal"), which code and TensorFlow's own
        tests match. Called on every write, so it keeps to cached attributes and cheap
        checks.
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
                    f"{argument}={short(value)} cannot be converted to this variable's "
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
                name = self.__wrapped__.name
                if replaces:
                    raise ShapeMismatchError(
                        f"{argument} has shape {list(got)} but variable {name!r} has shape "
                        f"{list(expected)}: the shape {tf.TensorShape(got)} and the "
                        f"variable's shape {tf.TensorShape(expected)} are incompatible. "
                        "Reshape the value, or create the variable with "
                        "shape=tf.TensorShape(None) to allow any shape."
                    )
                raise ShapeMismatchError(
                    f"{argument} has shape {list(got)} but variable {name!r} has shape "
                    f"{list(expected)}: shapes must be equal ({argument} is not "
                    f"broadcast). Reshape the {argument}, for example "
                    f"tf.broadcast_to({argument}, tf.shape(variable))."
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
          read_value: If True, return the variable unread, as ``tf.Variable`` does;
            otherwise ``None`` eagerly, the write's op in a graph.

        Raises:
          DTypeMismatchError: ``value`` does not convert to the variable's dtype (also a
            ``TypeError`` and a ``ValueError``, as plain TensorFlow raises either).
          ShapeMismatchError: ``value``'s shape differs from the variable's (also a
            ``ValueError`` and a ``tf.errors.InvalidArgumentError``).

        Python integers convert as plain TensorFlow converts them: into an ``int32``
        variable, ``2**40`` wraps around (writes 0), as ``tf.Variable.assign`` does.

        Thread safety: atomic with respect to every safevars operation on this variable.

        Modes: eagerly and in a ``tf.function`` alike, with ``read_value=True`` it
        returns what ``tf.Variable.assign`` returns, the variable unread: a
        :class:`~safevars.SafeVariable` sharing this one's lock and version (writes
        through it are locked and counted; eagerly its ``name`` is ``"UnreadVariable"``,
        as plain TensorFlow's), whose reads come after this write. Nothing is read
        unless it is used. A read gives the value the variable has *then*: another
        thread's later write may be in it. For the value this call wrote, use
        :meth:`update` (it returns it) or read inside :func:`safevars.locked`.
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
        tensor = self._checked(value, argument, replaces=method == "assign")
        wrapped = self.__wrapped__
        ctx = merge_context(wrapped) if self._self_mirrored else None
        if ctx is not None:  # Inside strategy.run: merge replicas, then one locked write.
            return merged_write(
                ctx,
                wrapped,
                lambda v: self._merged_assign(method, v, argument, use_locking, name, read_value),
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
            return self._unread(None) if read_value else None
        if type(tensor) in (int, float) and not tf.executing_eagerly():
            # A Python number (see _checked) becomes a constant here, outside the section:
            # made inside, it would be one more op the lock makes ready (a root of the
            # section, safevars.sections.gate), one per write.
            tensor = tf.constant(tensor, self._self_dtype)
        wrapped_method = getattr(wrapped, method)
        return self._write(
            lambda: wrapped_method(tensor, use_locking, name, read_value=False),
            read_value,
            after=tensor,
        )

    def _merged_assign(
        self,
        method: str,
        value: Any,
        argument: str,
        use_locking: bool | None,
        name: str | None,
        read_value: bool,
    ) -> Any:
        """The write :func:`~safevars.distribute.merged_write` makes in cross-replica
        context: ``value`` merged, or, for aggregation ``NONE``, each replica's own
        (``PerReplica``), which the wrapped variable's write hands each copy."""
        if not isinstance(value, ds_values.PerReplica):
            return self._assign_op(method, value, argument, use_locking, name, read_value)
        wrapped_method = getattr(self.__wrapped__, method)
        done = self._write(
            lambda: wrapped_method(value, use_locking, name, read_value=False),
            read_value=False,
            after=[x for x in value.values if tf.is_tensor(x)],
        )
        if not read_value:
            return done
        if tf.executing_eagerly():
            return self._unread(None)
        with tf.control_dependencies([done]):  # each replica reads back its own copy
            return ds_values.PerReplica(tuple(c.read_value() for c in self.__wrapped__.values))

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
                f"update(fn) needs a callable taking the current value, got {short(fn)}. "
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
            current = guard.graph_version()

            def write() -> tf.Tensor:
                self._graph_write_body(lambda: wrapped.assign(tensor, read_value=False), None)
                return tf.constant(True)

            return tf.cond(tf.equal(current, expected), write, lambda: tf.constant(False))

        if held_in_graph(guard) is not None:
            return body()
        return graph_section([guard], body)


# A proxy forwards what its classes do not define: leave ``__slots__`` the wrapped
# variable's (the empty tuple only kept the mixin from adding ``__dict__``).
del _Writes.__slots__
