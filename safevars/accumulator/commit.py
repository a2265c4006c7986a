"""The commit of ``add``: one critical section, eager or in a graph.

Inside the accumulator's lock (a Python lock eagerly, a ``tf.CriticalSection`` in a
graph, the parameter server's through :mod:`.placement`) the staleness policy of
:mod:`safevars.staleness` decides each contribution (accept, drop, scale or refuse),
the accepted ones are copied to the next free rows of the buffer (growing it when full)
or added to the running sum, and the counters of :mod:`.statistics` change with them.
Decisions are Python values eagerly and tensors in a graph: one code path for both.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, cast

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars._tf_internal import gen_resource_variable_ops
from safevars.accumulator.placement import _as_tensors
from safevars.accumulator.state import _AccumulatorBase, _concat, _Layout, _Part
from safevars.accumulator.statistics import _PENDING, _TAKES, _taken_delta
from safevars.errors import AccumulatorFullError, AccumulatorTimeoutError, assertion_text
from safevars.locking import Guard, hold
from safevars.sections import graph_inputs, graph_section, record_xla_preparation, step_span
from safevars.staleness import refuse_stale, scale_stale, version_lag


class _Commit(_AccumulatorBase):
    """The state change of ``add`` and the buffer it writes to."""

    def _commit(self, parts: list[_Part], take: bool = False) -> Any:
        """Decides and commits contributions in one critical section.

        Returns the number accepted, or with ``take`` (``add_and_take``) the reduced
        gradients of every pending contribution, taken in the same section.
        """
        if not tf.executing_eagerly():
            # The lock waits for every tensor of the contributions (after=parts), or with
            # lock_span="step" only for what may wait or take locks (safevars.sections.step_span).
            early = None
            if self._lock_span == "step":
                early = step_span.opening(tf.compat.v1.get_default_graph())
            if early is None:
                result = graph_section(
                    [self._guard], lambda: self._commit_body(parts, take=take), parts
                )
                return self._finish(*result) if take else result

            def body() -> Any:
                # The lock is taken early. The growth check runs at once, while the
                # function still computes the gradients: it reads only the pending count
                # and the capacity, and as an If kernel it costs a function call, which
                # on the critical path after the last gradient made the 26K model's
                # micro-step about 6% slower. It may grow the buffer for an add that is
                # then refused: capacity only, no value or counter. Every other state
                # change (counters, rows) waits for the contributions: they depend on the
                # value checks, and a refused add must change nothing. With max_pending
                # the storage was made up front: no check.
                grows = self._deterministic and self._max_pending is None
                grown = self._grow_if_full(len(parts)) if grows else None
                # add_and_take reading this contribution where it is: its reductions wait
                # only for their own gradients (they change no state).
                direct = self._take_directly(parts) if take else None
                with tf.control_dependencies(graph_inputs(parts)):
                    return self._commit_body(parts, grown, take, direct)

            result = graph_section([self._guard], body, early)
            return self._finish(*result) if take else result
        taken = None
        if self._remote:
            name = "add_and_take" if take else "add"
            result = self._run_remote(
                name, lambda p: self._commit([_Part(*x) for x in p], take), _as_tensors(parts)
            )
            if take:
                return result
            accepted = int(result)
        else:
            with hold([self._guard]):
                accepted = self._commit_body(parts, take=take)
                taken = self._take_locked(0) if take else None
        if accepted:  # wake the eager takes waiting on the current event
            arrived, self._arrival = self._arrival, threading.Event()
            arrived.set()
        if taken is not None:
            return self._finish(*taken)
        return int(accepted)

    def _take_directly(self, parts: list[_Part]) -> tuple[Any, tf.Tensor] | None:
        """For a traced ``add_and_take``: the reduction of the pending contributions and
        this one, read where it is (never stored), as ``(state, pending before)``; or
        None where the generic path (store, then take) must run.

        It applies when no contribution is decided at run time and the pending ones are
        all in one kind of storage: a deterministic accumulator with ``max_pending``,
        either at most the blocks kept by reference (after the room check, every
        pending block is one of them: :meth:`_reduce_with`) or with none kept by
        reference and one-row blocks (every pending block is a row of the buffer:
        :meth:`_reduce_rows_with`); no staleness policy and no ``nonfinite="skip"``, one
        contribution in its pieces, outside XLA (whose compiled calls run the generic
        path, checked before the call).
        """
        if not self._deterministic or len(parts) != 1 or tfi.in_xla_context():
            return None
        limit, references = self._max_pending, self._references
        if limit is None or (references and limit > references):
            return None
        if not references and self._layout.chunks != 1:
            return None
        if self._max_staleness is not None or self._nonfinite == "skip":
            return None
        values = parts[0].values
        if not isinstance(values, tuple):  # one flat block, gathered across workers
            return None
        pending = self._counters[_PENDING]
        if not references:  # one-row blocks: one piece
            return self._reduce_rows_with(values[0], pending), pending
        return self._reduce_with(values, pending), pending

    def _commit_body(
        self,
        parts: list[_Part],
        grown: tf.Tensor | None = None,
        take: bool = False,
        direct: tuple[Any, tf.Tensor] | None = None,
    ) -> Any:
        """The state change of ``add``. Runs with the lock held (eager or graph).

        ``grown``: the result of :meth:`_grow_if_full` when the section ran it already
        (a graph add whose lock opens early); None to check in :meth:`_store_rows`.
        ``take`` (``add_and_take``): with ``num_required``, refuse before anything changes
        if fewer would be pending; in a graph also take (:meth:`_take_body`), or with
        ``direct`` (:meth:`_take_directly`) count the reduction made from this contribution
        without storing it, and return ``(state, pending)`` for :meth:`_finish`.
        """
        eager = tf.executing_eagerly()
        checks: list[Any] = []
        kept: list[tuple[_Part, Any, Any, Any]] = []  # (part, accept, scale, staleness)
        accepted, dropped, rejected, scaled = [], [], [], []
        for part in parts:
            staleness = self._staleness(part)
            stale: Any = False
            if staleness is not None:
                stale = staleness > self._max_staleness
            if (
                self._on_stale == "raise"
                and staleness is not None
                and self._max_staleness is not None  # always, when staleness is not None
            ):
                # Eagerly raises StaleGradientError; in a graph, an assertion to run first.
                check = refuse_stale(staleness, self._max_staleness, "accumulated")
                if check is not None:
                    checks.append(check)
                stale = False
            finite = part.finite
            drop = stale if self._on_stale == "drop" else False
            accept = _and(_not(drop), finite)
            accepted.append(accept)
            dropped.append(drop)
            rejected.append(_and(_not(drop), _not(finite)))
            scale = _and(accept, stale) if self._on_stale == "scale" else False
            scaled.append(scale)
            if accept is not False:
                kept.append((part, accept, scale, staleness))
        if self._max_pending is not None:
            room = self._check_room(_total(accepted), len(kept))
            if room is not None:
                checks.append(room)
        if take and self._num_required:
            enough = self._check_enough(_total(accepted), self._num_required)
            if enough is not None:
                checks.append(enough)
        with tf.control_dependencies(checks):
            if direct is None:
                self._apply(kept, grown)
            n = _total(accepted)
            delta = [n, n, _total(dropped), _total(rejected), _total(scaled), 0, 0, 0]
            if eager and not any(isinstance(d, tf.Tensor) for d in delta):
                if any(delta):
                    self._counters.assign_add(delta, read_value=False)
            else:
                delta = tf.stack([tf.cast(d, tf.int64) for d in delta])
                if direct is None:
                    self._counters.assign_add(delta, read_value=False)
            if not eager:
                n = tf.cast(n, tf.int64)  # made to depend on the commit
        if eager or not take:
            return n
        if direct is not None:
            # The add's counters and the take's in one update, after the reduction:
            # this contribution is not stored, so counting it as pending before the
            # reduction ran would leave a count without its block if the step failed in
            # between (another op of the step failing, the reduction itself). Only the
            # update waits for the reduction: the change is computed beside it.
            state, before = direct
            pending = before + n  # n is 1: no run-time refusal on this path
            delta += _taken_delta(pending, 1)
            with tf.control_dependencies(checks + tf.nest.flatten(state)):
                self._counters.assign_add(delta, read_value=False)
            return state, pending
        with tf.control_dependencies([n]):  # after the commit's counters (ordered too)
            state, pending, _ = self._take_body(conditional=False, required=0)
        return state, pending

    def _check_enough(self, accepted: int | tf.Tensor, required: int) -> Any:
        """``add_and_take`` with ``num_required``: refuses unless that many would be
        pending with this contribution (lock held, before anything changes). Eagerly
        raises AccumulatorTimeoutError; in a graph returns the assertion the commit waits
        for."""
        if tf.executing_eagerly():
            pending = int(self._counters.numpy()[_PENDING]) + int(accepted)
            if pending < required:
                raise AccumulatorTimeoutError(
                    f"add_and_take() found {pending} contributions pending with this one "
                    f"but num_required={required}; nothing was added. Use add() and "
                    "take(timeout=...) to wait for the others."
                )
            return None
        total = self._counters[_PENDING] + tf.cast(accepted, tf.int64)
        return tf.raw_ops.Assert(
            condition=total >= required,
            data=[
                assertion_text(
                    AccumulatorTimeoutError, "add_and_take() inside a tf.function found"
                ),
                total,
                "contributions pending with this one but num_required =",
                tf.constant(required, tf.int64),
                "(nothing was added)",
            ],
        )

    def _check_room(self, accepted: int | tf.Tensor, count: int) -> Any:
        """With ``max_pending``: refuses an add that would leave more than that pending
        (lock held, before anything changes). Eagerly raises AccumulatorFullError; in a
        graph returns the assertion the commit waits for. Inside an XLA-compiled function,
        which drops assertions, the check runs before the call instead, for the
        ``count`` contributions it may add (:meth:`_prepare_rows`); returns None then."""
        if not tf.executing_eagerly() and tfi.in_xla_context():
            if not self._deterministic:  # a deterministic add records it with its rows
                record_xla_preparation(
                    self, self._prepare_rows, count, "GradientAccumulator.add()"
                )
            return None
        return self._room_for(accepted, "the add would add")

    def _room_for(self, count: int | tf.Tensor, what: str) -> Any:
        """Refuses unless ``count`` more contributions fit within ``max_pending`` (lock
        held): eagerly raises AccumulatorFullError (``what`` names the ``count``) and
        returns None; in a graph returns the assertion."""
        limit = cast(int, self._max_pending)
        if tf.executing_eagerly():
            pending = int(self._counters.numpy()[_PENDING])
            if pending + int(count) > limit:
                raise AccumulatorFullError(_full_message(pending, int(count), limit, what))
            return None
        return _room_assertion(self._counters[_PENDING], count, limit)

    def _staleness(self, part: _Part) -> Any:
        if part.version_kind == "none" or self._max_staleness is None:
            return None
        if part.version_kind == "int":
            return version_lag(self._version_now(), part.version)
        # Every slot has a guard: _normalize_version refuses per-variable versions otherwise.
        guards = [cast(Guard, slot.guard) for slot in self._slots]
        lags = [version_lag(guards[i].version(), v) for i, v in enumerate(part.version)]
        if all(isinstance(x, int) for x in lags):
            return max(lags)
        return tf.reduce_max(tf.stack([tf.cast(x, tf.int64) for x in lags]))

    def _apply(
        self, kept: list[tuple[_Part, Any, Any, Any]], grown: tf.Tensor | None = None
    ) -> None:
        """Adds the accepted contributions to the state (lock held)."""
        if not kept:
            return
        if self._deterministic:
            self._store_rows(kept, grown)
            return
        dense, sparse_elements, sparse_values = [], [], []
        for part, accept, scale, staleness in kept:
            values = scale_stale(part.values, staleness, scale)
            if isinstance(accept, tf.Tensor):
                values = tf.where(accept, values, tf.zeros_like(values))
            if part.elements is None:
                dense.append(values)
            else:
                sparse_elements.append(part.elements)
                sparse_values.append(values)
        if dense:
            total = dense[0]
            for d in dense[1:]:
                total = total + d
            self._state.assign_add(total, read_value=False)
        if sparse_values:
            gen_resource_variable_ops.resource_scatter_add(
                self._state.handle, _concat(sparse_elements), _concat(sparse_values)
            )

    def _store_rows(
        self, kept: list[tuple[_Part, Any, Any, Any]], grown: tf.Tensor | None = None
    ) -> None:
        """Copies the accepted contributions to the next free blocks, growing if full.

        Each contribution is one block of ``_Layout.chunks`` buffer rows, written piece
        by piece (see ``_Layout``): one scatter per piece, straight from the gradients.
        Contributions refused at run time (a bool tensor) go to blocks behind the
        accepted ones, past the new pending count, where they are ignored. In a graph
        the writes wait for ``grown`` (:meth:`_grow_if_full` for at least as many
        contributions, run earlier in the section), or for a growth check of their own.
        """
        layout = self._layout
        blocks = [
            _pieces(scale_stale_each(part.values, staleness, scale), layout)
            for part, _, scale, staleness in kept
        ]
        accepts = [accept for _, accept, _, _ in kept]
        count = len(kept)
        offsets: list[Any] = list(range(count))
        if any(isinstance(a, tf.Tensor) for a in accepts):
            refused = tf.stack([tf.logical_not(tf.cast(a, tf.bool)) for a in accepts])
            order = tf.argsort(tf.cast(refused, tf.int32), stable=True)
            where = tf.cast(tf.math.invert_permutation(order), tf.int64)
            offsets = [where[k] for k in range(count)]
        if tf.executing_eagerly():
            if self._max_pending is not None:  # made up front, and _check_room ran
                pending = int(self._counters.numpy()[_PENDING])
            else:
                pending = self._grow_eagerly(count)
            self._write_blocks(blocks, pending, offsets)
            return
        pending = self._counters[_PENDING]
        if tfi.in_xla_context():
            # XLA cannot change the buffer's shape: the compiled call grows it first, under
            # the lock, for every contribution the function may add (sections).
            record_xla_preparation(
                self, self._prepare_rows, count, "GradientAccumulator(deterministic=True).add()"
            )
            self._write_blocks(blocks, pending, offsets)
            return
        if self._max_pending is not None:  # made up front, and _check_room ran
            self._write_blocks(blocks, pending, offsets)
            return
        if grown is None:
            grown = self._grow_if_full(count, pending)
        with tf.control_dependencies([grown]):
            self._write_blocks(blocks, pending, offsets)

    def _prepare_rows(self, count: int) -> Any:
        """Grows the buffer if ``count`` more contributions do not fit (lock held): before
        an XLA-compiled call whose adds may write that many. Eagerly it grows at once;
        in a graph it returns the growth check's output. With blocks kept by reference
        the buffer gets at least one block even when they all fit: XLA compiles the
        write to the buffer whichever block an add takes, and refuses a scatter into an
        empty one. With ``max_pending`` it first refuses the call if ``count`` more would
        not fit (eagerly AccumulatorFullError; in a graph an assertion the growth
        waits for); a running sum only checks."""
        minimum = self._layout.chunks if self._references else 0
        check = None
        if self._max_pending is not None:
            check = self._room_for(count, "the XLA-compiled call may add")
        if not self._deterministic:  # only the check (recorded with max_pending)
            return check
        if not tf.executing_eagerly():
            with tf.control_dependencies([] if check is None else [check]):
                return self._grow_if_full(count, minimum=minimum)
        self._grow_eagerly(count, minimum)
        return None

    def _grow_eagerly(self, count: int, minimum: int = 0) -> int:
        """Eagerly: grows the buffer if ``count`` more contributions do not fit (lock
        held), or to ``minimum`` rows; returns the pending count. Two eager ops, no
        slicing op: it runs at every eager add, and before every eager compiled call."""
        capacity = int(self._rows_shape().numpy()[0])
        pending = int(self._counters.numpy()[_PENDING])
        needed = max(self._rows_needed(pending, count), minimum)
        if needed > capacity:
            self._grow(capacity, needed)
        return pending

    def _grow_if_full(
        self, count: int, pending: tf.Tensor | None = None, minimum: int = 0
    ) -> tf.Tensor:
        """In a graph: grows the buffer if ``count`` more contributions do not fit (lock
        held; ``pending``: the pending count, if read already), or to ``minimum`` rows.
        One ``If`` kernel (see :func:`_keep_as_kernel`); returns its bool output."""
        if pending is None:
            pending = self._counters[_PENDING]
        capacity = self._rows_shape()[0]
        needed = self._rows_needed(pending, count)
        if minimum:
            needed = tf.maximum(needed, minimum)

        def grow() -> tf.Tensor:
            self._grow(capacity, needed)
            return tf.constant(True)

        grown = tf.cond(needed > capacity, grow, lambda: tf.constant(False))
        _keep_as_kernel(grown)
        return grown

    def _rows_needed(self, pending: Any, count: int) -> Any:
        """Buffer rows that ``pending`` and ``count`` more contributions need (an int
        eagerly, a tensor in a graph): the buffer holds the blocks past the ones kept by
        reference."""
        blocks = pending + (count - self._references) if self._references else pending + count
        return blocks * self._layout.chunks

    def _write_blocks(
        self, blocks: list[list[tuple[int, Any]]], pending: Any, offsets: list[Any]
    ) -> None:
        """Writes each contribution's pieces as block ``pending + offset`` (lock held):
        the blocks kept by reference first (:class:`.state._References`), then buffer
        block ``pending + offset - references``."""
        chunks = self._layout.chunks
        references = self._references
        eager = tf.executing_eagerly()
        xla = not eager and tfi.in_xla_context()
        limit = self._max_pending
        # With max_pending, whether blocks past the references may be written at all.
        past_references = limit is None or limit > references
        for pieces, offset in zip(blocks, offsets):
            if references:
                block = pending + offset if eager else tf.cast(pending, tf.int64) + offset
                if limit is not None and isinstance(offset, tf.Tensor):
                    # Refused at run time: past the pending ones, at most the spare.
                    block = tf.minimum(block, limit)
                if len(pieces) != len(self._helpers.references.shapes):
                    # One flat block (gathered from workers): cut into its pieces.
                    pieces = self._cut_block(pieces)
                base = (block - references) * chunks
                if eager and base >= 0:
                    self._scatter(pieces, base)
                    continue
                if xla:  # no gathered handle: one branch per block, the last the buffer's
                    self._helpers.references.write_switch(
                        block, [piece for _, piece in pieces], lambda: self._scatter(pieces, base)
                    )
                    continue
                self._helpers.references.write(block, [piece for _, piece in pieces])
                if not eager and past_references:  # past the references (else no row)
                    self._scatter(pieces, base, past=True)
                continue
            # No op for what adds nothing (offset 0, one row per block, a one-row piece):
            # each op of a traced add costs executor time at every call.
            base = tf.cast(pending, tf.int64)
            if not (isinstance(offset, int) and offset == 0):
                base += offset
            if limit is not None and isinstance(offset, tf.Tensor):
                base = tf.minimum(base, limit)  # refused at run time: at most the spare
            if chunks != 1:
                base *= chunks
            self._scatter(pieces, base)

    def _scatter(self, pieces: list[tuple[int, Any]], base: Any, past: bool = False) -> None:
        """Scatters ``pieces`` to the buffer rows from ``base``. ``past``: only where
        ``base`` is not negative (a block kept by reference writes no row), in a graph."""
        for first, piece in pieces:
            size = piece.shape[0]
            if past:
                size = tf.where(base >= 0, tf.constant(size, tf.int64), 0)
                piece = tf.slice(piece, tf.zeros([2], tf.int64), tf.stack([size, -1]))
                rows = tf.range(size, dtype=tf.int64) + (base + first)
            elif size == 1:
                rows = tf.reshape(base + first if first else base, [1])
            else:
                rows = tf.range(first, first + size, dtype=tf.int64) + base
            gen_resource_variable_ops.resource_scatter_update(self._state.handle, rows, piece)

    def _cut_block(self, pieces: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """A whole block (one ``[chunks, width]`` piece) as the pieces of the layout."""
        ((_, block),) = pieces
        sizes = [shape[0] for shape in self._helpers.references.shapes]
        return list(zip(self._layout.firsts, tf.split(block, sizes, axis=0)))

    def _rows_shape(self) -> tf.Tensor:
        """The state's shape (int64), without reading it.

        ``tf.shape(variable)`` reads the variable, and once a scatter has touched it a
        read copies all of it.
        """
        return gen_resource_variable_ops.variable_shape(self._state.handle, out_type=tf.int64)

    def _grow(self, capacity: int | tf.Tensor, needed: int | tf.Tensor) -> None:
        """Doubles the row buffer (or more, to ``needed`` rows), keeping its rows."""
        new = tf.maximum(tf.cast(capacity, tf.int64) * 2, tf.cast(needed, tf.int64))
        extra = tf.zeros(
            tf.stack([new - tf.cast(capacity, tf.int64), self._layout.width]), tf.float32
        )
        rows = gen_resource_variable_ops.resource_gather(
            self._state.handle, tf.range(tf.cast(capacity, tf.int64)), dtype=tf.float32
        )
        self._state.assign(tf.concat([rows, extra], 0), read_value=False)

    def _version_now(self) -> int | tf.Tensor:
        guards = [s.guard for s in self._slots if s.guard is not None]
        if guards:
            versions = [g.version() for g in guards]
            if all(isinstance(v, int) for v in versions):
                return max(versions)
            return tf.reduce_max(tf.stack([tf.cast(v, tf.int64) for v in versions]))
        takes = self._counters[_TAKES]
        return int(takes) if tf.executing_eagerly() else takes


def _full_message(pending: int, count: int, limit: int, what: str) -> str:
    return (
        f"{pending} contributions are pending and {what} {count}: more than "
        f"max_pending={limit}. Nothing was accumulated; take() or reset() makes room, or "
        "pass a larger max_pending (None: no limit)."
    )


def _room_assertion(pending: tf.Tensor, count: int | tf.Tensor, limit: int) -> tf.Operation:
    """In a graph: fails unless ``pending + count <= limit`` (see ``_check_room``).

    One ``Assert`` kernel: ``tf.debugging.Assert`` wraps it in a ``tf.cond`` (to skip
    formatting its message when it holds), a function call at every ``add``, which is
    what ``max_pending`` saves.
    """
    total = pending + tf.cast(count, tf.int64)
    return tf.raw_ops.Assert(
        condition=total <= limit,
        data=[
            assertion_text(AccumulatorFullError, "an add inside a tf.function would leave"),
            total,
            "contributions pending, more than max_pending =",
            tf.constant(limit, tf.int64),
            "(nothing was accumulated; take() or reset() makes room)",
        ],
    )


def _keep_as_kernel(result: tf.Tensor) -> None:
    """Keeps the ``tf.cond`` that made ``result`` one ``If`` op at run time.

    TensorFlow lowers a ``tf.cond`` in a ``tf.function`` to ``Switch``/``Merge`` ops,
    and its executor then visits every op of the branch not taken (as dead) at every
    run: for the growth check of an ``add``, about 15 ops of a branch that almost never
    runs, ~15 µs per ``add`` of the 26K-parameter benchmark model (one core). As an
    ``If`` kernel the untaken branch costs one function call of a constant.
    """
    op = result.op
    for _ in range(4):  # the cond's output is an Identity of the If op's
        if op.type in ("If", "StatelessIf"):
            tfi.keep_cond_as_kernel(op)
            return
        if not op.inputs:
            return
        op = op.inputs[0].op


def _not(x: Any) -> Any:
    return tf.logical_not(x) if isinstance(x, tf.Tensor) else not x


def _and(a: Any, b: Any) -> Any:
    if isinstance(a, tf.Tensor) or isinstance(b, tf.Tensor):
        if a is False or b is False:
            return False
        if a is True:
            return b
        if b is True:
            return a
        return tf.logical_and(a, b)
    return bool(a) and bool(b)


def _total(flags: Sequence[Any]) -> int | tf.Tensor:
    tensors = [tf.cast(f, tf.int64) for f in flags if isinstance(f, tf.Tensor)]
    constant = sum(1 for f in flags if f is True)
    if not tensors:
        return constant
    return tf.add_n(tensors) + constant


def scale_stale_each(values: Any, staleness: Any, scale: Any) -> Any:
    """:func:`scale_stale` of a tensor or of each piece of a tuple."""
    return tf.nest.map_structure(lambda v: scale_stale(v, staleness, scale), values)


def _pieces(values: Any, layout: _Layout) -> list[tuple[int, tf.Tensor]]:
    """A contribution's ``(first row, piece)`` pairs in its block.

    ``values`` is the tuple of :meth:`_block_pieces`, or the whole block as one flat
    vector (a contribution all-gathered across workers).
    """
    if isinstance(values, tuple):
        return list(zip(layout.firsts, values))
    return [(0, tf.reshape(values, [layout.chunks, layout.width]))]
