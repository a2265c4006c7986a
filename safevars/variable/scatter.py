"""The ``scatter_*`` methods of SafeVariable, and the index check that makes them safe.

Plain TensorFlow's scatter kernels write the rows before a bad index and then fail;
every ``scatter_*`` of a SafeVariable checks all its indices first (:func:`_index_check`:
eagerly in NumPy, in a graph as an assertion the write waits for), so a bad index writes
nothing. The methods are made once per name (``_SCATTER_METHODS``) on the mixin
:class:`_Scatter`, which :class:`~safevars.SafeVariable` inherits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._validation import short
from safevars.distribute import merge_context
from safevars.errors import IndexOutOfRangeError, UnsupportedStrategyError, assertion_text
from safevars.variable.writes import _Writes

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


def _make(method: str) -> Callable[..., Any]:
    def scatter(self: _Writes, *args: Any, **kwargs: Any) -> Any:
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


class _Scatter:
    """The ``scatter_*`` methods of :class:`~safevars.SafeVariable` (a mixin, no state)."""

    __slots__ = ()


for _method in _SCATTER_METHODS:
    setattr(_Scatter, _method, _make(_method))
del _method
# A proxy forwards what its classes do not define: leave ``__slots__`` the wrapped
# variable's (the empty tuple only kept the mixin from adding ``__dict__``).
del _Scatter.__slots__


def _index_check(variable: _Writes, method: str, args: tuple, kwargs: dict) -> Any:
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
            f"{short(values.tolist())} reach outside it (each must lie in "
            f"[0, {bound.tolist()})). Nothing was written. Drop or clip the "
            "out-of-range indices."
        )
    limit = tf.cast(limit, indices.dtype)
    inside = tf.reduce_all(tf.logical_and(indices >= 0, indices < limit))
    return tf.debugging.Assert(
        inside,
        [
            assertion_text(
                IndexOutOfRangeError,
                f"{method} on variable {name!r}: an index lies outside the variable; "
                "nothing was written. indices:",
            ),
            indices,
        ],
        summarize=16,
    )
