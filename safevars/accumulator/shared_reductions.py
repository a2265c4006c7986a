"""A deterministic accumulator's compiled reductions, shared by accumulators of one layout.

A deterministic accumulator reduces its pending rows with XLA-compiled functions:
``take``'s pass over the buffer (:meth:`~safevars.accumulator.take._Take._reduce_rows`)
and ``add_and_take``'s, with the contribution being added (:meth:`~safevars.accumulator.
take._Take._reduce_with`). Each accumulator used to trace and compile its own, closing
over its variables: an accumulator made again for the same model (a new optimizer, a
restarted training loop, one per experiment) traced them again and XLA compiled the same
computations again. Here the functions take the variables' handles as arguments instead,
so every accumulator with the same layout, reduction, dtype and ``max_pending`` calls the
same ones: one trace, and one compilation per shape, for all of them. The most recently
used :data:`KEPT` functions are kept; one an accumulator still uses lives on with it.

Measured in the accumulator tests (2026-11-30): 209 accumulators traced ``take``'s
reduction, with 64 distinct layouts among them; the ``tests/accumulator`` directory took
111 s and 173 CPU-seconds before, 83 s and 121 after (3 workers, 2 cores, quiet).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from safevars._tf_internal import gen_resource_variable_ops
from safevars.accumulator.reproducible_sum import _reproducible_sum

__all__ = ["KEPT", "divide", "piece_reduction", "rows_reduction", "shared_reduction"]

#: Reductions kept for accumulators made later (least recently used dropped first).
KEPT = 32

_FUNCTIONS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_LOCK = threading.Lock()


def divide(total: tf.Tensor, pending: tf.Tensor, reduction: str, shared: tf.DType | None) -> Any:
    """The flat sum ``total`` divided by ``pending`` for "mean", cast to ``shared`` (the
    variables' dtype if they all have one; a cast rounds each element alone, so casting
    the whole is the same)."""
    if reduction == "mean":
        total = total / tf.cast(tf.maximum(pending, 1), total.dtype)
    return total if shared is None else tf.cast(total, shared)


def shared_reduction(
    width: int,
    chunks: int,
    firsts: Sequence[int],
    shapes: Sequence[Sequence[int]],
    references: int,
    reduction: str,
    shared: tf.DType | None,
) -> Callable[[list[tf.Tensor], tf.Tensor, tf.Tensor], Any]:
    """The compiled reduction of a deterministic accumulator's pending rows.

    Args:
      width, chunks, firsts: The block layout (``_Layout``): elements per buffer row,
        rows per contribution, and the first row of each piece.
      shapes: ``[rows, width]`` of each piece of a block kept by reference.
      references: How many blocks are kept by reference (0: none).
      reduction: "mean" or "sum".
      shared: The variables' dtype if they all have one, else None.

    Returns:
      A ``tf.function`` (``jit_compile=True``) of ``handles`` (the row buffer's handle,
      then each block's pieces', block by block), ``marker`` (an empty ``[rows, 0]``
      float32 tensor: the rows to read, see ``_reduce_rows``) and ``count`` (int64, the
      pending contributions). It returns the flat reduced sum divided by :func:`divide`,
      or one such tensor per piece when blocks are kept by reference.
    """
    key = (width, chunks, tuple(firsts), tuple(map(tuple, shapes)), references, reduction, shared)
    function = _kept(key)
    if function is not None:
        return function
    sizes = [rows * width for rows, _ in shapes]

    def reduce_pending_rows(handles: list[tf.Tensor], marker: tf.Tensor, count: tf.Tensor) -> Any:
        # One contribution's block per row: [capacity, chunks * width].
        buffer = tf.reshape(_read(handles[0]), [-1, chunks * width])
        rows = buffer[: tf.shape(marker)[0]]  # or fewer, if the buffer is smaller
        if not references:
            return divide(_reproducible_sum(rows, count), count, reduction, shared)
        # Piece by piece, one result each: the blocks kept by reference are read where
        # they are. Concatenating their pieces first, or the results at the end, made
        # XLA copy them: the pass over the 1.3M-parameter benchmark model's 4 blocks
        # took 5.4-6.1 ms instead of 2.5 ms.
        pieces = len(shapes)
        out = []
        for k, first in enumerate(firsts):
            leading = [
                tf.reshape(_read(handles[1 + j * pieces + k]), [sizes[k]])
                for j in range(references)
            ]
            region = rows[:, first * width : first * width + sizes[k]]
            out.append(divide(_reproducible_sum(region, count, leading), count, reduction, shared))
        return tuple(out)

    handles = [tf.TensorSpec([], tf.resource)] * (1 + references * len(shapes))
    function = tf.function(
        reduce_pending_rows,
        autograph=False,
        jit_compile=True,
        input_signature=[
            handles,
            tf.TensorSpec([None, 0], tf.float32),
            tf.TensorSpec([], tf.int64),
        ],
    )
    return _keep(key, function)


def rows_reduction(
    width: int, most: int | None, reduction: str, shared: tf.DType | None
) -> Callable[[list[tf.Tensor], tf.Tensor, tf.Tensor], Any]:
    """``add_and_take``'s compiled reduction when no block is kept by reference.

    A ``tf.function`` (``jit_compile=True``) of ``handles`` (``[the row buffer's
    handle]``), ``count`` (int64: the pending contributions and the one added) and
    ``row`` (the contribution being added, a ``[1, width]`` row, not stored): the flat
    reduced sum of ``row`` and the buffer's first ``count - 1`` rows, divided by
    :func:`divide`. ``most``: the accumulator's ``max_pending``, a bound on ``count``
    known when tracing.
    """
    key = ("rows", width, most, reduction, shared)
    function = _kept(key)
    if function is not None:
        return function

    def reduce_rows_with(handles: list[tf.Tensor], count: tf.Tensor, row: tf.Tensor) -> Any:
        buffer = tf.reshape(_read(handles[0]), [-1, width])
        total = _reproducible_sum(buffer, count, [tf.reshape(row, [-1])], most)
        return divide(total, count, reduction, shared)

    return _keep(key, tf.function(reduce_rows_with, autograph=False, jit_compile=True))


def piece_reduction(
    blocks: int, most: int | None, reduction: str, shared: tf.DType | None
) -> Callable[[list[tf.Tensor], tf.Tensor, tf.Tensor], Any]:
    """``add_and_take``'s compiled reduction of one piece of the layout, blocks kept by
    reference.

    A ``tf.function`` (``jit_compile=True``) of ``handles`` (that piece of each of the
    ``blocks`` blocks kept by reference), ``count`` (int64: the pending contributions and
    the one added) and ``piece`` (that piece of the contribution being added, not
    stored): row 0 is ``piece``, rows 1.. the blocks (the first ``count - 1`` of them
    pending), reduced and divided by :func:`divide`; the order does not change a bit.
    """
    key = ("piece", blocks, most, reduction, shared)
    function = _kept(key)
    if function is not None:
        return function

    def reduce_piece_with(handles: list[tf.Tensor], count: tf.Tensor, piece: tf.Tensor) -> Any:
        leading = [tf.reshape(piece, [-1])]
        size = leading[0].shape[0]
        leading += [
            tf.reshape(_read(handle), [-1 if size is None else size]) for handle in handles
        ]
        none = tf.zeros([0, size], tf.float32)
        return divide(_reproducible_sum(none, count, leading, most), count, reduction, shared)

    return _keep(key, tf.function(reduce_piece_with, autograph=False, jit_compile=True))


def _read(handle: tf.Tensor) -> tf.Tensor:
    """A float32 variable's value, from its handle."""
    return gen_resource_variable_ops.read_variable_op(handle, tf.float32)


def _kept(key: tuple) -> Any:
    """The function kept for ``key`` (now the most recently used), or None."""
    with _LOCK:
        function = _FUNCTIONS.get(key)
        if function is not None:
            _FUNCTIONS.move_to_end(key)
        return function


def _keep(key: tuple, function: Any) -> Any:
    """Keeps ``function`` for ``key`` (or returns the one another thread kept first),
    dropping the least recently used past :data:`KEPT`."""
    with _LOCK:
        function = _FUNCTIONS.setdefault(key, function)
        _FUNCTIONS.move_to_end(key)
        while len(_FUNCTIONS) > KEPT:
            _FUNCTIONS.popitem(last=False)
    return function
