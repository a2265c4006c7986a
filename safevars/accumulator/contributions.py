"""``add``: from the caller's gradients to one checked, flat contribution.

Everything here runs outside the lock. The gradients are matched to the variables'
structure, each is checked (shape, dtype, sparse indices) and flattened into one
float32 (or float64) vector, the optional ``version`` is normalized for the staleness
check, and the value checks (non-finite values, indices in range) raise eagerly or
become run-time assertions the commit waits for. The result, a
:class:`~safevars.accumulator.state._Part`, is committed by :mod:`.commit`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import nest  # flatten_up_to (not in tf.nest)
from safevars._validation import short
from safevars.accumulator.replicas import (
    _holds_distributed,
    _per_replica,
    _replica_context,
    _spans_workers,
)
from safevars.accumulator.state import _NARROW_FLOATS, _AccumulatorBase, _concat, _Part, _Slot
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
    assertion_text,
)
from safevars.snapshot import Snapshot


class _Contributions(_AccumulatorBase):
    """``add`` and the checks and arithmetic of a contribution before its commit."""

    def add(self, gradients: Any, *, version: Any = None) -> int | tf.Tensor:
        """Adds one contribution (one gradient per variable), atomically.

        Args:
          gradients: Same structure as ``variables``. Each entry is a dense tensor (or
            array) of the variable's shape, a ``tf.IndexedSlices`` (embedding gradients;
            duplicate indices add up), or ``None`` (no gradient: adds zeros for that
            variable). Dtypes float16, bfloat16 or float32 (float64 only for float64
            variables); they are accumulated in float32. In cross-replica context a
            ``PerReplica`` result of ``strategy.run`` adds one contribution per replica.
          version: What the gradients were computed from, for the staleness check: None
            (never stale), an ``int`` compared with :attr:`version`, or the structure of
            ``variables`` holding ``safevars.Snapshot`` objects or per-variable ints
            (each compared with its SafeVariable's ``.version``; the staleness is the
            largest lag). Ignored without ``max_staleness``.

        Returns:
          The number of contributions accumulated by this call: 1, or 0 if it was
          dropped as stale or skipped as non-finite; inside ``strategy.run`` the number
          over all replicas. Eagerly an ``int``, in a ``tf.function`` an int64 tensor.

        Raises:
          InvalidArgumentError: ``gradients`` does not match ``variables`` in structure,
            a sparse gradient's indices are out of range, or ``version`` is malformed.
          ShapeMismatchError: a gradient's shape differs from its variable's.
          DTypeMismatchError: a gradient's dtype is not accepted.
          StaleGradientError: ``on_stale="raise"`` and the contribution is too stale.
          NonFiniteGradientError: ``nonfinite="raise"`` and a gradient holds NaN or Inf.
          AccumulatorFullError: with ``max_pending``, the add would leave more than that
            pending (inside a ``tf.function``: a run-time failure naming it).

        Nothing of a call that raises is accumulated and no statistic changes. (Inside a
        ``tf.function`` with ``lock_span="step"`` and no ``max_pending``, a deterministic
        accumulator's buffer may have doubled its capacity for a refused add: memory
        only.)

        Thread safety: the staleness decision and the commit of the contribution and of
        the statistics form one atomic step with respect to ``add``, ``take`` and
        ``reset`` in every thread and running graph.

        Modes: eager, inside ``tf.function`` (the commit runs in the critical section)
        and inside ``strategy.run`` (one ``merge_call``: the replicas' contributions are
        committed together, in replica order).
        """
        return self._add(gradients, version, take=False)

    def add_and_take(self, gradients: Any, *, version: Any = None) -> Any:
        """Adds one contribution and takes every pending one, it included, atomically.

        What ``add(gradients, version=version)`` then ``take()`` return, as one step: no
        ``add``, ``take`` or ``reset`` of another thread or running graph comes between
        them, and the lock is taken once. It is the K-th micro-step of gradient
        accumulation, where Keras' ``gradient_accumulation_steps`` applies the update::

            acc = safevars.GradientAccumulator(model.trainable_variables, max_pending=4)
            # micro-steps 1..3: acc.add(grads); micro-step 4:
            optimizer.apply(acc.add_and_take(grads), model.trainable_variables)

        Inside a ``tf.function``, a deterministic accumulator with ``max_pending``, no
        staleness policy and ``nonfinite`` not "skip" reads this contribution where it
        is and never stores it: when every pending contribution is kept by reference
        (``max_pending`` at most ``max(num_required, 4)`` and a gradient of at least
        65,536 elements) the reduction of each large gradient starts as soon as that
        gradient is computed, while the backward pass computes the others
        (docs/history.md); when none is (small models: one buffer row per contribution) one
        compiled call reduces it with the buffer's rows. Otherwise it is stored, then
        the pending ones are reduced, in the same section. The result is the same bits
        either way.

        Args:
          gradients: As for :meth:`add`.
          version: As for :meth:`add`.

        Returns:
          As :meth:`take`: the mean (or sum) of every pending contribution, this one
          included unless it was refused (dropped as stale or skipped as non-finite).

        Raises:
          AccumulatorTimeoutError: with ``num_required``, fewer than that many would be
            pending with this contribution (inside a ``tf.function``, a run-time failure
            naming it). Nothing is added or taken: this does not wait (use :meth:`add`
            and ``take(timeout=...)`` for that).
          Others: as :meth:`add` (the contribution's checks, ``max_pending``). Nothing
            of a call that raises is added or taken.

        Thread safety: one atomic step with respect to ``add``, ``take`` and ``reset`` in
        every thread and running graph.

        Modes: as :meth:`add`; inside ``strategy.run`` every replica gets the same
        result (one ``merge_call`` adds the replicas' contributions and takes).
        """
        self._refuse_num_required_under_xla("add_and_take()", "add() and take_if_ready()")
        return self._add(gradients, version, take=True)

    def _add(self, gradients: Any, version: Any, take: bool) -> Any:
        """``add`` (the number accepted) or, with ``take``, ``add_and_take``."""
        self._leaves(gradients)  # the structure first: a clean error, nothing changed
        strategy = self._strategy()
        replica = _replica_context()
        if replica is not None:
            if _spans_workers(strategy):
                return self._add_across_workers(replica, gradients, version, take)
            part = self._prepare(gradients, version)
            return replica.merge_call(self._merge_add, args=(tuple(part), take))
        owner = strategy if strategy is not None else self._helpers.strategy
        if owner is not None and _spans_workers(owner) and _holds_distributed(gradients, version):
            # This worker holds only its own replicas' values: add them in replica
            # context, where every worker's are gathered.
            with owner.scope():
                results = owner.run(lambda g, v: self._add(g, v, take), args=(gradients, version))
            return owner.experimental_local_results(results)[0]
        return self._commit([self._prepare(g, version) for g in _per_replica(gradients)], take)

    def _prepare(self, gradients: Any, version: Any) -> _Part:
        """Validates one contribution and computes its tensors (outside the lock)."""
        entries, part, in_range = self._compute(gradients, version)
        elements, values, finite = self._check(
            entries, part.elements, part.values, part.finite, in_range
        )
        return part._replace(elements=elements, values=values, finite=finite)

    def _leaves(self, gradients: Any) -> list[Any]:
        """The gradients in the variables' order, or InvalidArgumentError (never a raw
        KeyError or TypeError from tf.nest: a dict given for a list, unsortable keys)."""
        try:
            return nest.flatten_up_to(self._helpers.structure, gradients, check_types=False)
        except (TypeError, ValueError, KeyError) as e:
            raise InvalidArgumentError(
                f"gradients must have the structure of the variables "
                f"({len(self._slots)} entries: {[s.name for s in self._slots]}); got "
                f"{short(gradients)} ({type(e).__name__}: {e})."
            ) from None

    def _compute(self, gradients: Any, version: Any) -> tuple[tuple, _Part, Any]:
        """Static checks and the tensors of one contribution, before the value checks.

        Returns:
          ``(entries, part, in_range)``: ``part.finite`` is None (not checked) or a bool
          tensor; ``in_range`` is None or a bool vector, one per sparse gradient.
        """
        leaves = self._leaves(gradients)
        entries = tuple(self._entry(slot, g) for slot, g in zip(self._slots, leaves))
        version_kind, version_value = self._normalize_version(version)
        math = self._helpers.prepare if tf.executing_eagerly() else self._prepare_math
        elements, values, finite, in_range = math(entries)
        return entries, _Part(elements, values, finite, version_kind, version_value), in_range

    def _check(
        self, entries: tuple, elements: Any, values: Any, finite: Any, in_range: Any
    ) -> tuple[Any, Any, Any]:
        """The value checks of ``add``: eagerly raise, in a graph assert before the commit.

        ``finite`` and ``in_range`` hold one contribution's flags, or several
        contributions' along a leading axis (gathered from every worker).

        Returns:
          ``(elements, values, finite)``: the tensors made to depend on the checks, and
          ``finite`` as True (nothing to skip), or the flags to skip by.
        """
        eager = tf.executing_eagerly()
        if in_range is not None:
            if eager:
                flags = np.asarray(in_range).reshape(-1, in_range.shape[-1]).all(axis=0)
                bad = [i for i, ok in enumerate(np.ravel(flags).tolist()) if not ok]
                if bad:
                    slot = self._slots[_sparse_slot(entries, bad[0])]
                    raise InvalidArgumentError(
                        f"the tf.IndexedSlices gradient for {slot.name!r} has indices "
                        f"outside [0, {slot.shape[0]}), the variable's first dimension."
                    )
            else:
                check = tf.debugging.Assert(
                    tf.reduce_all(in_range),
                    [
                        assertion_text(
                            InvalidArgumentError,
                            "a tf.IndexedSlices gradient has indices outside its variable's "
                            "first dimension",
                        )
                    ],
                )
                elements, values = _after(check, (elements, values))
        if self._nonfinite == "propagate":
            return elements, values, True
        if eager:
            flags = np.asarray(finite)
            if self._nonfinite == "raise":
                if not flags.all():
                    raise NonFiniteGradientError(
                        "a gradient holds NaN or Inf (nonfinite='raise'); nothing was "
                        "accumulated. Pass nonfinite='skip' to drop such contributions."
                    )
                return elements, values, True
            return elements, values, bool(flags) if flags.ndim == 0 else flags
        if self._nonfinite == "raise":
            check = tf.debugging.Assert(
                tf.reduce_all(finite),
                [
                    assertion_text(
                        NonFiniteGradientError,
                        "a gradient holds NaN or Inf (nonfinite=raise); nothing was accumulated",
                    )
                ],
            )
            elements, values = _after(check, (elements, values))
            return elements, values, True
        return elements, values, finite

    def _entry(self, slot: _Slot, gradient: Any) -> tuple | None:
        """A validated (kind, tensors...) tuple for one gradient, or None."""
        if gradient is None:
            return None
        if isinstance(gradient, tf.distribute.DistributedValues):
            raise InvalidArgumentError(
                f"the gradient for {slot.name!r} is a {type(gradient).__name__}; pass "
                "either the whole PerReplica structure in cross-replica context or each "
                "replica's own gradients inside strategy.run."
            )
        if isinstance(gradient, tf.IndexedSlices):
            return self._sparse_entry(slot, gradient)
        tensor = self._as_tensor(slot, gradient, "gradient")
        expected = tf.TensorShape(slot.shape)
        if not tensor.shape.is_compatible_with(expected):
            raise ShapeMismatchError(
                f"the gradient for {slot.name!r} has shape {tensor.shape} but the variable "
                f"has shape {list(slot.shape)}."
            )
        if not tensor.shape.is_fully_defined():
            tensor = tf.ensure_shape(tensor, expected)
        return ("dense", tensor)

    def _sparse_entry(self, slot: _Slot, gradient: tf.IndexedSlices) -> tuple:
        if not slot.shape:
            raise ShapeMismatchError(
                f"a tf.IndexedSlices gradient was given for the scalar variable "
                f"{slot.name!r}; sparse gradients need a variable of rank >= 1."
            )
        values = self._as_tensor(slot, gradient.values, "IndexedSlices values")
        row = tf.TensorShape(slot.shape[1:])
        if values.shape.rank is not None and not values.shape[1:].is_compatible_with(row):
            raise ShapeMismatchError(
                f"the tf.IndexedSlices gradient for {slot.name!r} has values of shape "
                f"{values.shape}; rows must have shape {list(slot.shape[1:])}."
            )
        dense_shape = gradient.dense_shape
        if dense_shape is not None:
            static = tf.get_static_value(dense_shape)
            if static is not None and tuple(int(d) for d in static) != slot.shape:
                raise ShapeMismatchError(
                    f"the tf.IndexedSlices gradient for {slot.name!r} has dense_shape "
                    f"{list(static)} but the variable has shape {list(slot.shape)}."
                )
        try:
            indices = tf.convert_to_tensor(gradient.indices)
        except (TypeError, ValueError):
            indices = None
        if (
            indices is None
            or indices.dtype not in (tf.int32, tf.int64)
            or (indices.shape.rank is not None and indices.shape.rank != 1)
        ):
            raise InvalidArgumentError(
                f"the tf.IndexedSlices gradient for {slot.name!r} needs 1-D int32/int64 "
                f"indices, got {short(gradient.indices)}."
            )
        return ("sparse", values, indices)

    def _as_tensor(self, slot: _Slot, value: Any, what: str) -> tf.Tensor:
        allowed = _NARROW_FLOATS + ((tf.float64,) if slot.dtype == tf.float64 else ())
        if not isinstance(value, tf.Tensor):
            try:
                value = tf.convert_to_tensor(value, dtype=slot.dtype)
            except (TypeError, ValueError) as e:
                raise DTypeMismatchError(
                    f"the {what} for {slot.name!r} ({short(value)}) does not convert to "
                    f"the variable's dtype {slot.dtype.name} ({e})."
                ) from None
        if value.dtype not in allowed:
            raise DTypeMismatchError(
                f"the {what} for {slot.name!r} has dtype {value.dtype.name}; accepted: "
                f"{[d.name for d in allowed]} (accumulated in "
                f"{self._sum_dtype.name}). Cast it first."
            )
        return value

    def _normalize_version(self, version: Any) -> tuple[str, Any]:
        if version is None or self._max_staleness is None:
            return "none", None
        if _is_int_version(version):
            return "int", _version_value(version, "version")
        try:
            leaves = nest.flatten_up_to(self._helpers.structure, version, check_types=False)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                "version must be None, an int (compared with accumulator.version) or the "
                "structure of the variables holding Snapshots or ints; got "
                f"{short(version)}."
            ) from None
        values = []
        for slot, leaf in zip(self._slots, leaves):
            if slot.guard is None:
                raise InvalidArgumentError(
                    f"per-variable versions need SafeVariables, but {slot.name!r} is a "
                    "plain variable. Wrap the variables with safevars.wrap(), or pass an "
                    "int version compared with accumulator.version."
                )
            leaf = leaf.version if isinstance(leaf, Snapshot) else leaf
            values.append(_version_value(leaf, f"version for {slot.name!r}"))
        return "each", tuple(values)

    def _prepare_math(self, entries: tuple) -> tuple:
        """Flat values (and element ids if sparse) and the checks of one contribution.

        Deterministic accumulators store whole rows, so sparse gradients are made dense
        here (duplicate indices summed in index order: a function of the contribution).
        """
        by_element = not self._deterministic and any(
            e is not None and e[0] == "sparse" for e in entries
        )
        values_list, elements_list, in_range = [], [], []
        for slot, entry in zip(self._slots, entries):
            if entry is None:
                if not by_element:
                    values_list.append(tf.zeros([slot.size], self._sum_dtype))
                continue
            if entry[0] == "dense":
                values_list.append(tf.reshape(tf.cast(entry[1], self._sum_dtype), [-1]))
                if by_element:
                    elements_list.append(
                        tf.range(slot.offset, slot.offset + slot.size, dtype=tf.int64)
                    )
                continue
            _, rows, indices = entry
            rows = tf.cast(rows, self._sum_dtype)
            indices = tf.cast(indices, tf.int64)
            valid = (indices >= 0) & (indices < slot.shape[0])
            in_range.append(tf.reduce_all(valid))
            if not by_element:
                # Out-of-range ids (refused by the check above) become -1, which the
                # segment sum drops, so the check and not this op reports them.
                ids = tf.where(valid, indices, tf.constant(-1, tf.int64))
                dense = tf.math.unsorted_segment_sum(rows, ids, slot.shape[0])
                values_list.append(tf.reshape(dense, [-1]))
                continue
            row_size = slot.size // slot.shape[0]
            starts = slot.offset + indices * row_size
            elements_list.append(
                tf.reshape(starts[:, None] + tf.range(row_size, dtype=tf.int64)[None], [-1])
            )
            values_list.append(tf.reshape(rows, [-1]))
        checks = tf.stack(in_range) if in_range else None
        if self._deterministic:
            pieces = self._block_pieces(values_list)
            finite = None
            if self._nonfinite != "propagate":
                finite = tf.reduce_all(
                    tf.stack([tf.reduce_all(tf.math.is_finite(p)) for p in pieces])
                )
            return None, pieces, finite, checks
        values = tf.concat(values_list, 0) if values_list else tf.zeros([0], self._sum_dtype)
        elements = None
        if by_element:
            elements = tf.concat(elements_list, 0) if elements_list else tf.zeros([0], tf.int64)
        finite = (
            tf.reduce_all(tf.math.is_finite(values)) if self._nonfinite != "propagate" else None
        )
        return elements, values, finite, checks

    def _block_pieces(self, flats: list[tf.Tensor]) -> tuple[tf.Tensor, ...]:
        """One contribution's ``[rows, width]`` pieces in its block (see ``_Layout``).

        A large gradient's whole rows are a reshape of it (no copy); the rest is packed
        into one zero-padded piece, the only copy.
        """
        layout = self._layout
        pieces = []
        for position, _, rows in layout.direct:
            flat = flats[position]
            if rows * layout.width < self._slots[position].size:
                flat = flat[: rows * layout.width]
            pieces.append(tf.reshape(flat, [rows, layout.width]))
        packed = [
            flats[p] if first == 0 and length == self._slots[p].size else flats[p][first:]
            for p, first, length in layout.packed
        ]
        padding = layout.packed_rows * layout.width - sum(p[2] for p in layout.packed)
        if padding:
            packed.append(tf.zeros([padding], tf.float32))
        pieces.append(tf.reshape(_concat(packed), [layout.packed_rows, layout.width]))
        return tuple(pieces)


def _sparse_slot(entries: tuple, position: int) -> int:
    """Index of the slot holding the ``position``-th sparse entry."""
    sparse = [i for i, e in enumerate(entries) if e is not None and e[0] == "sparse"]
    return sparse[position]


def _after(check: Any, tensors: tuple) -> tuple:
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), tensors)


def _is_int_version(version: Any) -> bool:
    if isinstance(version, (bool, np.bool_)):
        return False
    if isinstance(version, (int, np.integer)):
        return True
    return isinstance(version, tf.Tensor) and version.shape.rank == 0


def _version_value(value: Any, what: str) -> int | tf.Tensor:
    if isinstance(value, tf.Tensor):
        if not value.dtype.is_integer:
            raise InvalidArgumentError(f"{what} must be an integer, got {value.dtype.name}.")
        if tf.executing_eagerly():
            value = int(value.numpy())
        else:
            return tf.cast(value, tf.int64)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"{what} must be an int, a scalar integer tensor or a Snapshot, got {short(value)}."
        )
    if value < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {value}.")
    return int(value)
