"""What a GradientAccumulator holds, and what its parts rely on one another for.

Every variable's gradients live in one flat vector: a :class:`_Slot` per variable says
where (offset and size), with its dtype and, for a SafeVariable, its guard (whose
version the staleness check reads). A deterministic accumulator stores each
contribution as one block of ``_CHUNK``-element buffer rows, laid out by a
:class:`_Layout` so that large gradients are written straight from the caller's tensor
(no copy into a contribution vector first); with such gradients the first pending
contributions are not copied at all but kept by reference (:class:`_References`), and
the buffer holds the ones after them. A contribution on its way from ``add`` to
the commit is a :class:`_Part`. Python structures (the variables, their nesting, the
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

from safevars._tf_internal import gen_resource_variable_ops, resource_variable_ops
from safevars._validation import short
from safevars.errors import DTypeMismatchError, InvalidArgumentError
from safevars.locking import Guard

_NARROW_FLOATS = (tf.float16, tf.bfloat16, tf.float32)
# Elements per row of a deterministic accumulator's buffer.
_CHUNK = 1024
# Gradients of at least this many elements are stored with a scatter of their own,
# straight from the gradient tensor; smaller ones (and the large ones' last partial
# row) are packed into one block first, where one copy costs less than an op each.
_DIRECT = 64 * 1024


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
    (always the case for deterministic accumulators, which store whole rows). For a
    deterministic accumulator ``values`` is a tuple of ``[rows, width]`` pieces, in
    the order of :attr:`_Layout.firsts`, or (after an all-gather) the whole block as
    one flat vector of ``chunks * width`` elements.
    """

    elements: tf.Tensor | None
    values: tf.Tensor
    finite: bool | tf.Tensor
    version_kind: str
    version: Any


class _Layout(NamedTuple):
    """How a deterministic accumulator lays out one contribution in its buffer.

    A contribution occupies ``chunks`` consecutive buffer rows of ``width`` elements
    (its *block*). A gradient of at least ``_DIRECT`` elements fills whole rows of its
    own (``direct``), reshaped in place; the remaining values (small gradients and the
    large ones' last ``size % _CHUNK``) are concatenated, zero-padded to whole rows and
    placed after them (``packed``). Only the padding is extra memory: fewer than
    ``_CHUNK`` elements per contribution, none when no gradient is stored directly (then
    a block is one row of the whole contribution).
    """

    width: int  # elements per buffer row
    chunks: int  # rows per contribution
    direct: tuple[tuple[int, int, int], ...]  # (slot position, first row, rows)
    packed: tuple[tuple[int, int, int], ...]  # (slot position, first element, length)
    packed_first: int  # row where the packed values start
    packed_rows: int
    # Per slot: (start in the flattened block, length) of its values, in element order.
    segments: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def firsts(self) -> tuple[int, ...]:
        """The first row of each piece of a contribution (direct ones, then packed)."""
        return tuple(d[1] for d in self.direct) + (self.packed_first,)


def _flat_layout(slots: tuple[_Slot, ...]) -> _Layout:
    """The running sum's layout: each slot's values at its offset (no blocks)."""
    segments = tuple(((s.offset, s.size),) for s in slots)
    return _Layout(
        width=0,
        chunks=0,
        direct=(),
        packed=(),
        packed_first=0,
        packed_rows=0,
        segments=segments,
    )


def _block_layout(slots: tuple[_Slot, ...]) -> _Layout:
    """The block layout of a deterministic accumulator's contributions.

    Rows are ``_CHUNK`` elements wide if some gradient is stored directly; otherwise a
    block is one row holding the whole contribution (no padding).
    """
    width = _CHUNK if any(s.size >= _DIRECT for s in slots) else max(sum(s.size for s in slots), 1)
    direct, packed = [], []
    row = 0
    for slot in slots:
        rows = slot.size // _CHUNK if slot.size >= _DIRECT else 0
        if rows:
            direct.append((slot.position, row, rows))
            row += rows
        if slot.size > rows * _CHUNK:
            packed.append((slot.position, rows * _CHUNK, slot.size - rows * _CHUNK))
    packed_elements = sum(p[2] for p in packed)
    packed_rows = max(-(-packed_elements // width), 1)
    segments: list[list[tuple[int, int]]] = [[] for _ in slots]
    for position, first, rows in direct:
        segments[position].append((first * width, rows * width))
    start = row * width
    for position, _, length in packed:
        segments[position].append((start, length))
        start += length
    return _Layout(
        width=width,
        chunks=row + packed_rows,
        direct=tuple(direct),
        packed=tuple(packed),
        packed_first=row,
        packed_rows=packed_rows,
        segments=tuple(tuple(s) for s in segments),
    )


def _block_columns(layout: _Layout, size: int) -> np.ndarray:
    """For each element of a flattened block, the element of the contribution it holds
    (``size`` for padding): a block is ``gather(contribution, columns)``."""
    columns = np.full(layout.chunks * layout.width, size, np.int64)
    offset = 0
    for segments in layout.segments:
        for start, length in segments:
            columns[start : start + length] = np.arange(offset, offset + length)
            offset += length
    return columns


class _RowsVariable(resource_variable_ops.ResourceVariable):
    """A deterministic accumulator's buffer, which also restores pre-block checkpoints.

    Up to safevars 0.1 a pending contribution was one row of all ``size`` elements; with
    the block layout (:func:`_block_layout`) a model with a large gradient stores it as
    ``chunks`` rows of ``width``. A checkpoint written with contributions pending in the
    old layout is converted when restored (every row becomes its block), so training
    resumes with the same pending contributions and the same result.
    """

    def _set_layout(
        self, layout: _Layout, size: int, references: _References, minimum_rows: int = 0
    ) -> None:
        self._safevars_layout = layout
        self._safevars_size = size
        self._safevars_references = references
        # With max_pending: the rows made up front, which a restore keeps (zero-padded).
        self._safevars_minimum_rows = minimum_rows

    def _row_layout(self) -> tf.Tensor:
        """The pending blocks in the row layout: the ones kept by reference, then the
        buffer's rows (a copy)."""
        references = self._safevars_references
        if not references.count:
            return self.read_value()
        return tf.concat([references.rows(), self.read_value()], 0)

    def _serialize_to_tensors(self) -> dict[str, Any]:
        saved = super()._serialize_to_tensors()
        if not self._safevars_references.count:
            return saved
        return {next(iter(saved)): self._row_layout()}

    def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> Any:
        key = next(iter(restored_tensors))
        rows = restored_tensors[key]
        layout, size = self._safevars_layout, self._safevars_size
        width = layout.width
        if size != width:  # the layouts differ only with blocks of several rows

            def to_blocks() -> tf.Tensor:
                # Built only here: the table is as long as a contribution.
                columns = _block_columns(layout, size)
                padded = tf.pad(rows, [[0, 0], [0, 1]])  # column ``size``: the padding
                return tf.reshape(tf.gather(padded, columns, axis=1), [-1, width])

            if rows.shape.rank == 2 and rows.shape[1] is not None:
                rows = to_blocks() if rows.shape[1] == size else rows
            else:  # a graph-mode restore: the shape is known when it runs
                rows = tf.cond(tf.shape(rows)[-1] == size, to_blocks, lambda: rows)
        rows = self._safevars_references.restore(rows)
        minimum = self._safevars_minimum_rows
        if minimum:  # a checkpoint with fewer rows (another max_pending, or none)
            missing = tf.maximum(minimum - tf.shape(rows, out_type=tf.int64)[0], 0)
            rows = tf.pad(rows, [[0, missing], [0, 0]])
        return super()._restore_from_tensors({key: rows})


class _References:
    """The first pending contributions of a deterministic accumulator, by reference.

    A contribution's block is written to the row buffer with a scatter: a copy of every
    element, single-threaded (about 0.3 ms per 1M elements on the 2-core development
    CPU, more than Keras' ``assign_add`` of the same gradient). When the layout stores
    some gradient straight from its tensor (``_Layout.direct``), the first ``count``
    pending contributions (blocks ``0 .. count - 1``) are instead kept as they are:
    block ``j`` is one variable per piece (:attr:`_Layout.firsts`), and an
    ``AssignVariableOp`` takes over the piece's buffer when nothing else holds it (in a
    traced ``add``; eagerly it copies). Blocks from ``count`` on go to the row buffer,
    at block ``j - count``. ``take`` reads these variables in place, as the first
    ``count`` rows of the reproducible sum (:mod:`.reproducible_sum`).

    A traced write picks its block's variable with a gather of their handles (no
    control flow): contributions past the references go to one more set of variables,
    the *sink*, which is never read and keeps the last such piece alive (one block of
    memory at most, none until a contribution goes past the references). XLA compiles
    no gathered handle: there a ``tf.switch_case`` picks it (:meth:`write_switch`).

    Checkpoints keep the row layout: the buffer's checkpoint value is these blocks
    followed by the buffer's rows (:class:`_RowsVariable`), so a checkpoint reads the
    same whichever way its blocks were stored. The variables are not tracked by the
    accumulator (``tf.Module``) for that reason.
    """

    def __init__(self, layout: _Layout, count: int, prefix: str) -> None:
        self.count = count
        self.layout = layout
        shapes = [[rows, layout.width] for _, _, rows in layout.direct]
        shapes.append([layout.packed_rows, layout.width])
        self.shapes = shapes if count else []

        def variable(shape: list[int], name: str, known: bool = True) -> Any:
            return resource_variable_ops.ResourceVariable(
                tf.zeros(shape, tf.float32),
                trainable=False,
                name=name,
                shape=None if known else tf.TensorShape(None),
            )

        self.blocks = [
            [variable(shape, f"{prefix}_block{j}_{k}") for k, shape in enumerate(self.shapes)]
            for j in range(count)
        ]
        self.sink = [
            variable([0, layout.width], f"{prefix}_sink_{k}", known=False)
            for k in range(len(self.shapes))
        ]
        self._writers: dict[int, Callable[..., Any]] = {}

    def write(self, block: int | tf.Tensor, pieces: list[tf.Tensor]) -> None:
        """Keeps ``pieces`` (in :attr:`_Layout.firsts` order) as block ``block`` (lock
        held): eagerly one of the references; in a graph any block, and the pieces of
        one past the references go to the sink."""
        if isinstance(block, int):
            self._keep(block, pieces)
            return
        index = tf.minimum(block, self.count)
        for k, piece in enumerate(pieces):
            # Where the variables are: the assignment runs where its handle is made.
            with tf.device(self.sink[k].device):
                self._writer(k)(index, piece)

    def write_switch(
        self, block: tf.Tensor, pieces: list[tf.Tensor], past: Callable[[], Any]
    ) -> None:
        """:meth:`write` inside an XLA-compiled function, which compiles no gathered
        handle: a ``tf.switch_case`` with a branch assigning each reference block and a
        last one, ``past()``, for a block past them (it writes the buffer). XLA copies
        the pieces (no buffer is taken over there)."""

        def keep(j: int) -> Callable[[], tf.Tensor]:
            def branch() -> tf.Tensor:
                self._keep(j, pieces)
                return tf.constant(True)

            return branch

        def beyond() -> tf.Tensor:
            past()
            return tf.constant(True)

        index = tf.cast(tf.minimum(block, self.count), tf.int32)
        tf.switch_case(index, [keep(j) for j in range(self.count)] + [beyond])

    def _keep(self, j: int, pieces: list[tf.Tensor]) -> None:
        """Assigns ``pieces`` to the variables of reference block ``j``."""
        for variable, piece in zip(self.blocks[j], pieces):
            variable.assign(piece, read_value=False)

    def _writer(self, k: int) -> Callable[..., Any]:
        """A function assigning piece ``k`` to the variable of block ``index``.

        A function of its own so that its call op has every one of these variables as
        an input: TensorFlow's automatic control dependencies then order it with the
        other reads and writes of them (the take's reduction, in a section joined to
        the add's, :mod:`safevars.sections.coarsening`). An ``AssignVariableOp`` on a
        gathered handle alone is invisible to them; under ParameterServerStrategy a
        take then read blocks before the add wrote them. Grappler inlines the call.
        """
        if k not in self._writers:
            variables = [block[k] for block in self.blocks] + [self.sink[k]]

            def write(index: tf.Tensor, piece: tf.Tensor) -> tf.Tensor:
                handles = tf.stack([v.handle for v in variables])
                gen_resource_variable_ops.assign_variable_op(tf.gather(handles, index), piece)
                return index

            self._writers[k] = tf.function(write, autograph=False)
        return self._writers[k]

    def rows(self) -> tf.Tensor:
        """The blocks as ``[count * chunks, width]`` buffer rows (a copy)."""
        pieces = [v.read_value() for block in self.blocks for v in block]
        return _concat(pieces) if pieces else tf.zeros([0, self.layout.width], tf.float32)

    def restore(self, rows: tf.Tensor) -> tf.Tensor:
        """Assigns the blocks from the first ``count * chunks`` rows of ``rows`` (zeros
        where it has fewer); returns the rest of the rows."""
        if not self.count:
            return rows
        chunks = self.layout.chunks
        needed = self.count * chunks
        have = tf.shape(rows, out_type=tf.int64)[0]
        padded = tf.pad(rows, [[0, tf.maximum(needed - have, 0)], [0, 0]])
        assigns = []
        for j, block in enumerate(self.blocks):
            first = j * chunks
            for k, variable in enumerate(block):
                rows_k = self.shapes[k][0]
                assigns.append(variable.assign(padded[first : first + rows_k], read_value=False))
                first += rows_k
        with tf.control_dependencies([a for a in assigns if a is not None]):
            return tf.identity(padded[needed:])

    def nbytes(self) -> int:
        """Bytes held now: the blocks and the sink (eager)."""
        total = sum(int(np.prod(v.shape)) for block in self.blocks for v in block)
        for v in self.sink:
            shape = gen_resource_variable_ops.variable_shape(v.handle, out_type=tf.int64)
            total += int(np.prod(shape.numpy()))
        return 4 * total


def _concat(tensors: list[tf.Tensor]) -> tf.Tensor:
    """``tf.concat`` along axis 0, without an op for a single tensor."""
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 0)


class _Helpers:
    """Untracked holder of the model variables, their structure and eager helpers."""

    # The compiled helpers, set by GradientAccumulator.__init__ right after this holder
    # is made (``reduce`` only for a deterministic accumulator, the only one using it).
    prepare: Callable[..., Any]
    finish: Callable[..., Any]
    reduce: Callable[..., Any]
    # A deterministic accumulator's first blocks, kept by reference (none: count 0).
    references: _References

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
    _lock_span: str
    _max_pending: int | None
    _helpers: _Helpers
    _slots: tuple[_Slot, ...]
    _size: int
    _layout: _Layout  # deterministic: the block layout; otherwise one segment per slot
    _sum_dtype: tf.DType
    _state: Any  # a ResourceVariable: the rows buffer or the running sum
    _counters: Any  # a ResourceVariable: the int64 counters (statistics.py)
    _guard: Guard
    _remote: bool
    _arrival: threading.Event  # set at the next eager arrival (gradient_accumulator.py)

    if TYPE_CHECKING:

        @property
        def count(self) -> int | tf.Tensor: ...  # gradient_accumulator.py

        @property
        def _references(self) -> int: ...  # gradient_accumulator.py

        def _refuses_at_run_time(self) -> bool: ...  # gradient_accumulator.py

        def _strategy(self) -> tf.distribute.Strategy | None: ...  # placement.py

        def _run_remote(self, key: str, fn: Callable[..., Any], *args: Any) -> Any: ...

        def _compute(
            self, gradients: Any, version: Any
        ) -> tuple[tuple, _Part, Any]: ...  # contributions.py

        def _check(
            self, entries: tuple, elements: Any, values: Any, finite: Any, in_range: Any
        ) -> tuple[Any, Any, Any]: ...

        def _commit(self, parts: list[_Part], take: bool = False) -> Any: ...  # commit.py

        def _take_locked(self, required: int) -> tuple[Any, int] | None: ...  # take.py

        def _refuse_num_required_under_xla(self, what: str, instead: str) -> None: ...

        def _take_body(
            self, conditional: bool, required: int
        ) -> tuple[Any, tf.Tensor, tf.Tensor]: ...

        def _reduce_with(self, pieces: tuple[tf.Tensor, ...], pending: tf.Tensor) -> tuple: ...

        def _reduce_rows_with(self, piece: tf.Tensor, pending: tf.Tensor) -> tf.Tensor: ...

        def _finish(self, state: Any, pending: int | tf.Tensor) -> Any: ...

        def _merge_add(
            self, strategy: tf.distribute.Strategy, part: tuple, take: bool = False
        ) -> Any: ...

        def _add_across_workers(  # replicas.py
            self,
            ctx: tf.distribute.ReplicaContext,
            gradients: Any,
            version: Any,
            take: bool = False,
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
