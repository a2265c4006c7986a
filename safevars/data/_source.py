"""The elements of a ShardedInput: what an element id is looked up in, and the checks.

A source is a number of elements (the ids are the elements), a nested structure of
tensors (element ``i`` is row ``i`` of each, one gather per batch, or per epoch of a
shard) or a ``tf.data.Dataset`` with random access (``tf.data.experimental.at``, one
element at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._validation import is_int
from safevars.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class Elements:
    """How an element id becomes an element: the source and the user's per-element map.

    Attributes:
      kind: ``"ids"`` (the id is the element), ``"tensors"`` (row ``id`` of every tensor of
        a nested structure) or ``"dataset"`` (``tf.data.experimental.at(dataset, id)``).
      source: The tensors or the dataset (``None`` for ids).
      map_fn: Optional function applied to every element after the lookup.
      with_weights: Deliver ``(element, weight)`` (weight 0.0 for a ``"pad"`` copy).
    """

    kind: str
    source: Any
    map_fn: Callable[..., Any] | None
    with_weights: bool

    def lookup_one(self, element_id: tf.Tensor) -> Any:
        if self.kind == "tensors":
            return tf.nest.map_structure(lambda t: tf.gather(t, element_id), self.source)
        if self.kind == "dataset":
            return tf.data.experimental.at(self.source, element_id)
        return element_id

    def row_bytes(self) -> int | None:
        """Bytes of one element as looked up, or None if a dtype has no fixed size
        (strings, variants) or the source is a dataset."""
        if self.kind == "ids":
            return 8
        if self.kind != "tensors":
            return None
        total = 0
        for tensor in tf.nest.flatten(self.source):
            if tensor.dtype.size == 0:
                return None
            total += tensor.dtype.size * tensor.shape[1:].num_elements()
        return total

    @property
    def vectorized(self) -> bool:
        """Whether a whole batch of ids can be looked up at once (one gather per tensor)."""
        return self.kind in ("tensors", "ids") and self.map_fn is None


def source_elements(source: Any, map_fn: Any, with_weights: bool) -> tuple[int, Elements]:
    """``(number of elements, Elements)`` of a ``source`` argument, or raises."""
    if isinstance(source, tf.data.Dataset):
        cardinality = int(source.cardinality())
        if cardinality < 0:
            kind = "infinite" if cardinality == tf.data.INFINITE_CARDINALITY else "unknown"
            raise InvalidArgumentError(
                f"source is a tf.data.Dataset of {kind} cardinality; ShardedInput needs the "
                "number of elements. Pass a finite dataset, or declare its size with "
                "dataset.apply(tf.data.experimental.assert_cardinality(n))."
            )
        if cardinality > 0:
            try:
                tf.data.experimental.at(source, 0)
            except (
                tf.errors.UnimplementedError,
                tf.errors.InvalidArgumentError,
                tf.errors.FailedPreconditionError,
            ) as e:
                raise InvalidArgumentError(
                    "source is a tf.data.Dataset without random access (reading element i "
                    f"failed: {type(e).__name__}). Use transformations that support it "
                    "(from_tensor_slices, range, map, batch, ...; add .cache() otherwise), "
                    "or pass the number of elements and map ids to elements yourself."
                ) from None
        return cardinality, Elements("dataset", source, map_fn, with_weights)
    if is_int(source):
        return int(source), Elements("ids", None, map_fn, with_weights)
    if isinstance(source, (bool, np.bool_, str, bytes)) or source is None:
        raise InvalidArgumentError(
            f"source must be a tf.data.Dataset, a number of elements or a nested structure "
            f"of tensors, got {source!r} of type {type(source).__name__}."
        )
    try:
        with tf.init_scope():
            tensors = tf.nest.map_structure(tf.convert_to_tensor, source)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"source must be a tf.data.Dataset, a number of elements or a nested structure "
            f"of tensors, got {type(source).__name__} that does not convert to tensors "
            f"({e}). Pass tf.data.Dataset.from_tensor_slices(...) style data."
        ) from None
    leading = {t.shape[0] if t.shape.rank else None for t in tf.nest.flatten(tensors)}
    if not leading or None in leading or len(leading) != 1:
        raise InvalidArgumentError(
            "source tensors must all have rank >= 1 and the same first dimension (the "
            f"elements, as for from_tensor_slices); got first dimensions {sorted(map(str, leading))}."
        )
    (first,) = leading
    assert first is not None  # refused above
    return int(first), Elements("tensors", tensors, map_fn, with_weights)
