"""What a GradientAccumulator holds, and what its parts rely on one another for.

Every variable's gradients live in one flat vector: a :class:`_Slot` per variable says
where (offset and size), with its dtype and, for a SafeVariable, its guard (whose
version the staleness check reads). A contribution on its way from ``add`` to the
commit is a :class:`_Part`. Python structures (the variables, their nesting, the
compiled helpers) live in an untracked :class:`_Helpers`, because ``tf.Module`` would
wrap them.

The trackable state itself (the rows buffer or running sum, and the counters of
:mod:`.statistics`) is made by ``GradientAccumulator.__init__`` in
:mod:`.gradient_accumulator`. :class:`_AccumulatorBase` declares those attributes, and
the methods one mixin of the package calls in another, so that every file type-checks
on its own; at run time it is an empty class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import tensorflow as tf

from safevars._validation import short
from safevars.errors import DTypeMismatchError, InvalidArgumentError
from safevars.locking import Guard

_NARROW_FLOATS = (tf.float16, tf.bfloat16, tf.float32)


class _Slot(NamedTuple):
    """One variable's place in the flat state."""

    position: int  # in the flattened ``variables``
    name: str
    shape: tuple[int, ...]
    size: int
    offset: int
    dtype: tf.DType
    guard: Guard | None


class _Part(NamedTuple):
    """One contribution, ready to commit (all tensors computed outside the lock).

    ``values`` is a flat float32 (or float64) vector; ``elements`` holds the element
    each value belongs to, or is None when ``values`` covers every element in order
    (always the case for deterministic accumulators, which store whole rows).
    """

    elements: tf.Tensor | None
    values: tf.Tensor
    finite: bool | tf.Tensor
    version_kind: str
    version: Any


class _Helpers:
    """Untracked holder of the model variables, their structure and eager helpers."""

    # The compiled helpers, set by GradientAccumulator.__init__ right after this holder
    # is made (``reduce`` only for a deterministic accumulator, the only one using it).
    prepare: Callable[..., Any]
    finish: Callable[..., Any]
    reduce: Callable[..., Any]

    def __init__(self, variables: list[Any], structure: Any) -> None:
        self.variables = variables
        self.structure = structure
        self.remote_functions: dict[str, Callable[..., Any]] = {}
        # The strategy in whose scope the accumulator was created, if any.
        self.strategy: tf.distribute.Strategy | None = (
            tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        )


class _AccumulatorBase:
    """Declarations shared by the mixins of :class:`GradientAccumulator` (no behaviour).

    The attributes are set by ``GradientAccumulator.__init__``; the methods under
    ``TYPE_CHECKING`` are defined by the mixin named beside them.
    """

    name: str  # tf.Module's
    _reduction: str
    _num_required: int | None
    _max_staleness: int | None
    _on_stale: str
    _deterministic: bool
    _nonfinite: str
    _helpers: _Helpers
    _slots: tuple[_Slot, ...]
    _size: int
    _sum_dtype: tf.DType
    _state: Any  # a ResourceVariable: the rows buffer or the running sum
    _counters: Any  # a ResourceVariable: the int64 counters (statistics.py)
    _guard: Guard
    _remote: bool
    _arrived: threading.Condition
    _arrivals: int

    if TYPE_CHECKING:

        @property
        def count(self) -> int | tf.Tensor: ...  # gradient_accumulator.py

        def _strategy(self) -> tf.distribute.Strategy | None: ...  # placement.py

        def _run_remote(self, key: str, fn: Callable[..., Any], *args: Any) -> Any: ...

        def _compute(
            self, gradients: Any, version: Any
        ) -> tuple[tuple, _Part, Any]: ...  # contributions.py

        def _check(
            self, entries: tuple, elements: Any, values: Any, finite: Any, in_range: Any
        ) -> tuple[Any, Any, Any]: ...

        def _commit(self, parts: list[_Part]) -> int | tf.Tensor: ...  # commit.py

        def _merge_add(self, strategy: tf.distribute.Strategy, part: tuple) -> Any: ...

        def _add_across_workers(  # replicas.py
            self, ctx: tf.distribute.ReplicaContext, gradients: Any, version: Any
        ) -> Any: ...


def _slot(index: int, variable: Any, offset: int) -> _Slot:
    """Checks one variable and describes its place in the flat state."""
    backing = getattr(variable, "value", None)
    if not isinstance(variable, tf.Variable) and isinstance(backing, tf.Variable):
        variable = backing  # keras.Variable under the TensorFlow backend
    if not isinstance(variable, tf.Variable):
        raise InvalidArgumentError(
            f"variables[{index}] is {short(variable)}, not a variable. Pass the "
            "variables the gradients are for (e.g. model.trainable_variables)."
        )
    shape = variable.shape
    name = getattr(variable, "name", f"variables[{index}]")
    if not shape.is_fully_defined():
        raise InvalidArgumentError(
            f"variable {name!r} has shape {shape}; the accumulator needs fully defined "
            "shapes to size its state."
        )
    dtype = tf.as_dtype(variable.dtype)
    if dtype not in _NARROW_FLOATS and dtype != tf.float64:
        raise DTypeMismatchError(
            f"variable {name!r} has dtype {dtype.name}; gradients can be accumulated for "
            "float16, bfloat16, float32 and float64 variables only."
        )
    guard = getattr(variable, "_self_guard", None)
    dims = tuple(int(d) for d in shape.as_list())
    return _Slot(
        position=index,
        name=name,
        shape=dims,
        size=int(np.prod(dims, dtype=np.int64)),
        offset=offset,
        dtype=dtype,
        guard=guard if isinstance(guard, Guard) else None,
    )
