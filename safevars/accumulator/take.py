"""``take``, ``take_if_ready`` and ``reset``: the pending contributions out, atomically.

An eager ``take`` waits (polling for contributions added by running graphs) until
``num_required`` are pending; in a graph it does not wait but asserts. Under the lock it
reads the pending state and resets the counters: a deterministic accumulator reduces
its rows there, in place, with :mod:`.reproducible_sum`; a running sum is copied and
divided after the lock is released. ``reset`` discards the pending contributions.
"""

from __future__ import annotations

import time
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars._tf_internal import gen_resource_variable_ops
from safevars.accumulator.replicas import _replica_context
from safevars.accumulator.reproducible_sum import (
    _MARKER_TABLE,
    _marker_shapes,
)
from safevars.accumulator.shared_reductions import divide, piece_reduction, rows_reduction
from safevars.accumulator.state import _AccumulatorBase
from safevars.accumulator.statistics import (
    _DISCARDED,
    _NUM_COUNTERS,
    _PENDING,
    _TAKEN,
    _TAKES,
    _taken_delta,
)
from safevars.errors import AccumulatorTimeoutError, InvalidArgumentError, assertion_text
from safevars.locking import hold
from safevars.sections import graph_section

_POLL_SECONDS = 0.05


class _Take(_AccumulatorBase):
    """Taking (reduced and divided) and discarding the pending contributions."""

    def take(self, timeout: float | None = None) -> Any:
        """Returns the reduced gradients and resets, atomically.

        Args:
          timeout: With ``num_required``, how many seconds an eager ``take`` waits for
            that many contributions (None: as long as it takes). Ignored otherwise.

        Returns:
          The structure of ``variables`` holding one dense tensor per variable, in the
          variable's dtype: the mean (or sum) of the pending contributions; zeros when
          none is pending. Sparse contributions come back dense.

        Raises:
          AccumulatorTimeoutError: fewer than ``num_required`` contributions arrived
            before the timeout; the pending contributions are kept.

        Thread safety: reading the pending contributions (or the running sum) and
        resetting is one atomic step with respect to ``add``, ``take`` and ``reset`` in
        every thread and running graph; each contribution is taken by exactly one
        ``take``. A deterministic accumulator reduces the rows under the lock (in
        place, without copying them); a running sum is divided after the lock is
        released.

        Modes: eagerly it blocks (polling at most every 50 ms for contributions added
        by running graphs). Inside a ``tf.function`` it does not wait: with fewer than
        ``num_required`` pending it fails at run time (``tf.errors.InvalidArgumentError``
        naming AccumulatorTimeoutError) and keeps them; use :meth:`take_if_ready` with
        ``tf.cond`` instead. Inside an XLA-compiled function, which drops that
        run-time check, a ``take`` with ``num_required`` is refused when traced
        (:class:`~safevars.InvalidArgumentError` naming :meth:`take_if_ready`; nothing
        changes). Inside ``strategy.run`` one replica-synchronous take returns the same
        result to every replica.
        """
        self._refuse_num_required_under_xla("take()", "take_if_ready()")
        self._strategy()
        replica = _replica_context()
        if replica is not None:
            return replica.merge_call(lambda _: self.take(timeout))
        if tf.executing_eagerly():
            return self._take_eager(timeout)
        return self._take_graph(conditional=False)[1]

    def _refuse_num_required_under_xla(self, what: str, instead: str) -> None:
        """``what`` with ``num_required`` inside an XLA-compiled function: refused when
        traced (nothing changes). The check that enough are pending is a run-time
        assertion, which XLA drops ("Ignoring Assert operator"): it would go ahead with
        fewer."""
        if self._num_required and not tf.executing_eagerly() and tfi.in_xla_context():
            raise InvalidArgumentError(
                f"{what} with num_required={self._num_required} cannot run inside an "
                "XLA-compiled function (jit_compile=True): XLA drops the run-time check "
                "that enough contributions are pending, and it would go ahead with "
                f"fewer. Use {instead} (with tf.cond on its flag), or num_required=0."
            )

    def _take_now(self, required: int) -> Any | None:
        """Eager: takes if ``required`` are pending (and at least one, if required > 0);
        returns the reduced gradients, or None if it took nothing."""
        if self._remote:
            if not required:
                return self._run_remote("take", lambda: self._take_graph(False)[1])
            ready, grads = self._run_remote(
                f"take_if_ready_{required}", lambda: self._take_graph(True, required)
            )
            return grads if bool(ready) else None
        with hold([self._guard]):
            taken = self._take_locked(required)
        return None if taken is None else self._finish(*taken)

    def take_if_ready(self) -> tuple[bool | tf.Tensor, Any]:
        """Takes only if at least ``num_required`` (or 1) contributions are pending.

        Returns:
          ``(taken, gradients)``. Eagerly ``(True, gradients)`` or ``(False, None)``.
          Inside a ``tf.function`` ``taken`` is a bool tensor and ``gradients`` are
          zeros when it is False (branch on it with ``tf.cond``).

        Thread safety: the check and the take are one atomic step, so of two callers
        racing for the same contributions exactly one gets them.

        Modes: eager and ``tf.function``; inside ``strategy.run`` as :meth:`take`.
        """
        self._strategy()
        replica = _replica_context()
        if replica is not None:
            return replica.merge_call(lambda _: self.take_if_ready())
        if not tf.executing_eagerly():
            return self._take_graph(conditional=True)
        grads = self._take_now(self._num_required or 1)
        return (False, None) if grads is None else (True, grads)

    def _take_eager(self, timeout: float | None) -> Any:
        required = self._num_required or 0
        deadline = None if timeout is None else time.monotonic() + max(float(timeout), 0.0)
        while True:
            arrival = self._arrival  # set by any arrival from now on (commit.py)
            grads = self._take_now(required)
            if grads is not None:
                return grads
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise AccumulatorTimeoutError(
                    f"take(timeout={timeout}) waited for {required} contributions "
                    f"(num_required) but only {self.count} arrived; they are kept for "
                    "the next take."
                )
            wait = _POLL_SECONDS if remaining is None else min(remaining, _POLL_SECONDS)
            arrival.wait(wait)

    def _take_locked(self, required: int) -> tuple[Any, int] | None:
        """Eager: reads the pending state and resets it if ``required`` are pending.

        Returns ``(state, pending)`` for :meth:`_finish`, or None. A deterministic
        accumulator's state is already reduced (see :meth:`_reduce_rows`).
        """
        pending = int(self._counters[_PENDING])
        if pending < required or (required and pending == 0):
            return None
        if self._deterministic:
            state = self._reduce_rows(pending)
        else:
            state = self._state.read_value()
            with tf.control_dependencies([state]):
                self._state.assign(
                    tf.zeros(self._state.shape, self._state.dtype), read_value=False
                )
        delta = [0] * _NUM_COUNTERS
        delta[_PENDING], delta[_TAKEN], delta[_TAKES] = -pending, pending, int(pending > 0)
        self._counters.assign_add(delta, read_value=False)
        return state, pending

    def _reduce_rows(self, pending: int | tf.Tensor) -> tf.Tensor:
        """The reduced pending contributions, flat (lock held; deterministic).

        One XLA-compiled function reads the row buffer in place (no copy), reduces its
        first ``pending`` blocks with :func:`_reproducible_sum`, divides and casts
        (:meth:`_divide`); :meth:`_finish` cuts the result into the variables' tensors
        outside it (slices of one tensor, without copies: cutting inside the compiled
        function made XLA write every piece out separately, which cost as much as the
        reduction). It reads the blocks kept by reference (:class:`.state._References`)
        and the first ``rows`` rows of the buffer, ``rows``
        the power of two at or above the pending blocks in it (at least ``_GROUP`` of
        :mod:`.reproducible_sum`): the shape of an empty ``[rows, 0]`` tensor passed to
        it, so one trace serves every count and XLA compiles once per power of two that
        occurs (XLA needs static shapes).
        Past :data:`_MARKER_TABLE` pending rows it reads the whole buffer.
        """
        references = self._references
        if not tf.executing_eagerly() and tfi.in_xla_context():
            # XLA compiles static shapes: every block of the buffer, whose shape is a
            # constant of the compiled function (recompiled when the buffer grows).
            rows = gen_resource_variable_ops.variable_shape(self._state.handle, out_type=tf.int64)
            marker = tf.zeros(tf.stack([rows[0] // self._layout.chunks, 0]), tf.float32)
            return self._helpers.reduce(marker, tf.cast(pending, tf.int64))
        if isinstance(pending, tf.Tensor) and tf.get_static_value(pending) is None:
            pending = tf.cast(pending, tf.int64)
            buffered = tf.maximum(pending - references, 0)
            shape = tf.gather(_marker_shapes(), tf.minimum(buffered, _MARKER_TABLE))
        else:
            count = (
                int(tf.get_static_value(pending))
                if isinstance(pending, tf.Tensor)
                else int(pending)
            )
            shape = _marker_shapes()[min(max(count - references, 0), _MARKER_TABLE)]
            pending = tf.constant(count, tf.int64)
        return self._helpers.reduce(tf.zeros(shape, tf.float32), pending)

    def _reduce_with(self, pieces: tuple[tf.Tensor, ...], pending: tf.Tensor) -> tuple:
        """``add_and_take``'s reduction, lock held (:meth:`_Commit._take_directly`): for
        each piece of the layout, ``pieces[k]`` (the contribution being added, which is
        not stored) and piece ``k`` of the first ``pending`` blocks kept by reference,
        reduced and divided as ``take`` does (:mod:`.shared_reductions`). One
        XLA-compiled call per piece, waiting only for that piece: a large gradient's
        reduction runs while the backward pass computes the others (Keras adds each
        gradient as it comes, too)."""
        count = tf.cast(pending, tf.int64) + 1
        return tuple(self._piece_reducer(k)(count, piece) for k, piece in enumerate(pieces))

    def _reduce_rows_with(self, piece: tf.Tensor, pending: tf.Tensor) -> tf.Tensor:
        """``add_and_take``'s reduction with no block kept by reference, lock held
        (:meth:`_Commit._take_directly`): ``piece`` (the contribution being added, one
        ``[1, width]`` row, not stored) and the first ``pending`` rows of the buffer,
        reduced and divided as ``take`` does, flat. One compiled call that reads the
        contribution where the gradients were packed: no scatter of it into the buffer,
        and no second pass over it from there."""
        function = rows_reduction(
            self._layout.width, self._max_pending, self._reduction, self._shared_dtype()
        )
        return function([self._state.handle], tf.cast(pending, tf.int64) + 1, piece)

    def _piece_reducer(self, k: int) -> Any:
        """The compiled reduction of piece ``k`` for :meth:`_reduce_with`: the shared
        function given piece ``k`` of each block kept by reference."""
        references = self._helpers.references
        function = piece_reduction(
            references.count, self._max_pending, self._reduction, self._shared_dtype()
        )
        handles = [block[k].handle for block in references.blocks]
        return lambda count, piece: function(handles, count, piece)

    def _take_graph(self, conditional: bool, required: int | None = None) -> tuple[tf.Tensor, Any]:
        if required is None:
            required = self._num_required or (1 if conditional else 0)
        state, pending, ready = graph_section(
            [self._guard], lambda: self._take_body(conditional, required)
        )
        if conditional and not self._deterministic:
            grads = tf.cond(
                ready,
                lambda: tuple(tf.nest.flatten(self._finish(state, pending))),
                self._zeros,
            )
            return ready, tf.nest.pack_sequence_as(self._helpers.structure, list(grads))
        return ready, self._finish(state, pending)

    def _take_body(self, conditional: bool, required: int) -> tuple[Any, tf.Tensor, tf.Tensor]:
        """The state change of a traced take (lock held): ``(state, pending, taken)``,
        ``state`` for :meth:`_finish` (zeros if nothing was taken, ``conditional``)."""
        pending = self._counters[_PENDING]
        ready = pending >= max(required, 1) if conditional else tf.constant(True)
        checks = []
        if required and not conditional:
            checks.append(
                tf.debugging.Assert(
                    pending >= required,
                    [
                        assertion_text(
                            AccumulatorTimeoutError, "take() inside a tf.function found"
                        ),
                        pending,
                        "contributions pending but num_required =",
                        required,
                        "(they are kept)",
                    ],
                )
            )
        with tf.control_dependencies(checks):
            if not self._deterministic:
                state = self._state.read_value()
            elif conditional:
                state = tf.cond(ready, lambda: self._reduce_rows(pending), self._flat_zeros)
            else:
                state = self._reduce_rows(pending)

        def reset() -> tf.Tensor:
            with tf.control_dependencies(tf.nest.flatten(state)):
                if not self._deterministic:
                    self._state.assign(
                        tf.zeros(self._state.shape, self._state.dtype), read_value=False
                    )
                delta = _taken_delta(pending, tf.cast(pending > 0, tf.int64))
                self._counters.assign_add(delta, read_value=False)
                return tf.constant(True)

        if conditional:
            done = tf.cond(ready, reset, lambda: tf.constant(False))
        else:
            done = reset()
        return state, pending, done

    def _rows(self) -> tf.Tensor:
        """A deterministic accumulator's blocks in the row layout: the ones kept by
        reference, then the buffer's rows (what a checkpoint saves; a copy)."""
        return self._state._row_layout()

    def _zeros(self) -> tuple[tf.Tensor, ...]:
        return tuple(tf.zeros(s.shape, s.dtype) for s in self._slots)

    def _flat_zeros(self) -> tf.Tensor | tuple[tf.Tensor, ...]:
        """What ``_reduce_rows`` returns, for nothing taken."""
        dtype, width = self._result_dtype(), self._layout.width
        if self._references:
            shapes = self._helpers.references.shapes
            return tuple(tf.zeros([rows * width], dtype) for rows, _ in shapes)
        return tf.zeros([self._layout.chunks * width], dtype)

    def _finish(self, state: Any, pending: int | tf.Tensor) -> Any:
        """Reduced gradients from a state read by take (outside the lock).

        A deterministic accumulator's state was reduced (and divided) under the lock
        already; it is only cut into the variables' tensors.
        """
        if self._deterministic:
            flat = self._cut(state)
        else:
            pending = tf.convert_to_tensor(pending, tf.int64)
            math = self._helpers.finish if tf.executing_eagerly() else self._finish_math
            flat = math(state, pending)
        return tf.nest.pack_sequence_as(self._helpers.structure, list(flat))

    def _finish_math(self, state: tf.Tensor, pending: tf.Tensor) -> tuple:
        return self._cut(self._divide(state, pending))

    def _shared_dtype(self) -> tf.DType | None:
        """The variables' dtype if they all have the same one, else ``None``."""
        dtypes = {slot.dtype for slot in self._slots}
        return dtypes.pop() if len(dtypes) == 1 else None

    def _result_dtype(self) -> tf.DType:
        """The dtype of a deterministic :meth:`_divide`'s result: the variables' one if
        they share it, else float64 (each slot is cast once, in :meth:`_cut`)."""
        shared = self._shared_dtype()
        return tf.float64 if shared is None else shared

    def _divide(self, total: tf.Tensor, pending: tf.Tensor) -> tf.Tensor:
        """The flat sum divided for "mean", cast to the variables' dtype if they share
        one (a cast rounds each element alone, so casting the whole is the same)."""
        return divide(total, pending, self._reduction, self._shared_dtype())

    def _cut(self, total: tf.Tensor | tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, ...]:
        """The flat result cut into one tensor per variable, in its dtype. ``total`` is
        one flat tensor, or (blocks kept by reference) one per piece of the layout."""
        if isinstance(total, tuple):
            starts = [first * self._layout.width for first in self._layout.firsts]

            def part(start: int, length: int) -> tf.Tensor:
                k = max(i for i, s in enumerate(starts) if s <= start)
                return total[k][start - starts[k] : start - starts[k] + length]

        else:

            def part(start: int, length: int) -> tf.Tensor:
                return total[start : start + length]

        out = []
        for slot, segments in zip(self._slots, self._layout.segments):
            parts = [part(start, length) for start, length in segments]
            piece = parts[0] if len(parts) == 1 else tf.concat(parts, 0)
            out.append(tf.reshape(tf.cast(piece, slot.dtype), slot.shape))
        return tuple(out)

    # ------------------------------------------------------------------ reset

    def reset(self) -> tf.Operation | None:
        """Discards every pending contribution (counted in ``statistics().discarded``).

        Returns:
          None eagerly; inside a ``tf.function`` the op that resets.

        Thread safety: atomic with respect to ``add``, ``take`` and ``reset``.

        Modes: eager, ``tf.function`` (in the critical section) and ``strategy.run``
        (once for all replicas).
        """
        self._strategy()
        replica = _replica_context()
        if replica is not None:
            return replica.merge_call(lambda _: self.reset())

        def body() -> tf.Tensor:
            pending = self._counters[_PENDING]
            with tf.control_dependencies([pending]):
                if not self._deterministic:  # buffered rows past pending are ignored
                    self._state.assign(
                        tf.zeros(self._state.shape, self._state.dtype), read_value=False
                    )
                delta = tf.one_hot(_DISCARDED, _NUM_COUNTERS, dtype=tf.int64) * pending
                delta -= tf.one_hot(_PENDING, _NUM_COUNTERS, dtype=tf.int64) * pending
                self._counters.assign_add(delta, read_value=False)
            return pending

        if tf.executing_eagerly():
            if self._remote:
                self._run_remote("reset", self.reset)
                return None
            with hold([self._guard]):
                body()
            return None
        return graph_section([self._guard], body).op
