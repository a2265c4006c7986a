"""GradientAccumulator: thread-safe, deterministic accumulation of gradients.

The problem: accumulating gradients from several threads, micro-batches or replicas is a
read-modify-write per step (Keras 3's ``gradient_accumulation_steps`` reads the
accumulator, adds and assigns), so concurrent steps lose contributions; and a float32
running sum depends on the order contributions arrive in, so two runs that saw the same
gradients in a different order differ in their last bits (and then diverge).

The fix: :class:`GradientAccumulator` commits each ``add`` in one critical section (a
:class:`~safevars.locking.Guard`: a Python lock eagerly, a ``tf.CriticalSection`` once
used in a ``tf.function``), so ``add``, ``take`` and ``reset`` are atomic with respect
to each other. With ``deterministic=True`` (the default) the result is a function of the
*set* of contributions only, so the order of arrival cannot change a single bit.

How determinism is achieved, and what it costs in time, is told in
:mod:`safevars.accumulator.reproducible_sum`; where each part of the class lives, in
the docstring of :mod:`safevars.accumulator`.

Memory cost of ``deterministic=True``: **4 bytes per element per buffered contribution**,
that is ``4 * K`` bytes per gradient element to accumulate K micro-batches (Keras'
``gradient_accumulation_steps`` and ``deterministic=False`` keep 4: one float32 running
sum), plus, when some gradient has at least 65,536 elements, padding of fewer than
1,024 elements (4 KiB) per buffered contribution: such gradients are stored straight
from the gradient tensor into rows of 1,024 elements of their own, and the rest is
packed into whole rows after them (see ``_Layout`` in :mod:`.state`). The buffer
starts with room for ``max(num_required, 4)`` contributions, doubles when an ``add``
finds it full and keeps its size after ``take``. With such a gradient, those first
``max(num_required, 4)`` pending contributions are not copied into the buffer but kept
by reference (``_References`` in :mod:`.state`): a traced ``add`` hands the gradient
tensors themselves to variables of their own (no copy of the large ones; eagerly, or
when something else still holds the tensor, one copy), so the memory is the same, and
the buffer, empty at first, holds only the contributions pending beyond them (once
some have been, the last of them also stays referenced: one contribution's worth of
memory more at most). ``take`` copies nothing: it reads the
first ``2**ceil(log2(pending))`` contributions in place (at least 4; the whole buffer
beyond 1024 pending) and reduces them in O(contributions) per element; its only other
memory is the result and the compiled function's per-element temporaries. With
``deterministic=False`` the state is one float32 (float64 for float64 variables)
running sum per element, contributions are added in arrival order and the last bits
may depend on that order.

NOTES:
  What is *not* guaranteed:

  * ``deterministic=True`` covers float16, bfloat16 and float32 variables; float64
    variables need ``deterministic=False``. TensorFlow flushes float32 subnormals to
    zero on CPU; so does the accumulator.
  * Staleness is judged against the variables' versions when the contribution is
    committed; a concurrent optimizer step may commit a moment later. The decision is
    exact for the accumulator's own version (the number of ``take`` calls).
  * The buffer does not shrink: a burst of adds without ``take`` keeps its memory.
  * ``take`` of a deterministic accumulator runs an XLA-compiled function;
    TensorFlow builds without XLA's JIT cannot run it. It runs under the lock, so the
    first ``take`` for each power of two of pending rows also holds the lock while XLA
    compiles (a fraction of a second).
  * Inside a function compiled with XLA (``jit_compile=True``, Keras' choice on a GPU)
    the lock is taken around the compiled call (:mod:`safevars.sections`). A
    deterministic accumulator's buffer, whose shape XLA cannot change, grows before the
    call, under that lock, for every ``add`` the function makes (so a burst of adds in
    one compiled function reserves room for all of them); a block kept by reference
    is written through a ``tf.switch_case`` (a copy: XLA takes over no buffer), with at
    least one buffer block kept for the branch past them; ``take`` reduces every block
    of the buffer, masked by the pending count, and XLA recompiles the function when
    the buffer has grown. The bits are those of the same contributions outside XLA.
    An ``add`` inside a loop of the compiled function (``tf.while_loop``, AutoGraph
    loops, ``tf.map_fn``) is refused when traced: how many times it runs is known
    only when the loop does, so no room can be made for it first (call the compiled
    step from the loop instead).
    A traced ``take`` with ``num_required`` checks the pending count with a run-time
    assertion, which XLA drops: it is refused there (use ``take_if_ready``).
  * Under ``tf.distribute`` only the strategies of :mod:`safevars.distribute` are
    supported (see "Strategies" in :class:`GradientAccumulator`); under
    ``ParameterServerStrategy`` the accumulator must be created in the strategy's
    scope (or for variables on a parameter server), or the workers cannot reach it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import resource_variable_ops
from safevars._validation import check_bool, check_choice, check_int
from safevars.accumulator.commit import _Commit
from safevars.accumulator.contributions import _Contributions
from safevars.accumulator.placement import _Placement, _state_device
from safevars.accumulator.replicas import _Replicas
from safevars.accumulator.shared_reductions import shared_reduction
from safevars.accumulator.state import (
    _block_layout,
    _flat_layout,
    _Helpers,
    _References,
    _RowsVariable,
    _Slot,
    _slot,
)
from safevars.accumulator.statistics import _NUM_COUNTERS, _PENDING, AccumulatorStatistics
from safevars.accumulator.take import _Take
from safevars.distribute import check_strategy, on_parameter_server
from safevars.errors import DTypeMismatchError, InvalidArgumentError
from safevars.locking import Guard, check_timeout, hold, protect
from safevars.locking.saved_model import saved_guards
from safevars.sections import graph_section
from safevars.staleness import check_stale_policy

__all__ = ["GradientAccumulator"]

_MIN_ROWS = 4
_REDUCTIONS = ("mean", "sum")
_NONFINITE_POLICIES = ("propagate", "raise", "skip")
_LOCK_SPANS = ("step", "add")


class GradientAccumulator(_Contributions, _Replicas, _Commit, _Take, _Placement, tf.Module):
    """Accumulates gradients from threads, micro-batches or replicas; thread-safe.

    Example::

        acc = safevars.GradientAccumulator(model.trainable_variables, num_required=4)
        # in each of 4 worker threads, or for each of 4 micro-batches:
        acc.add(tape.gradient(loss, model.trainable_variables))
        # in the trainer:
        optimizer.apply(acc.take(timeout=60), model.trainable_variables)

    Args:
      variables: The variables the gradients are for: a ``tf.Variable``,
        ``keras.Variable`` or :class:`~safevars.SafeVariable`, or a (nested) list,
        tuple or dict of them. Shapes must be fully defined; dtypes float16, bfloat16,
        float32 (and float64 with ``deterministic=False``).
      reduction: "mean" (sum divided by the number of contributions) or "sum".
      num_required: If set, an eager ``take`` waits until this many contributions are
        pending (see :meth:`take`).
      max_staleness: If set, a contribution computed from parameters more than this many
        versions old is handled by ``on_stale``.
      on_stale: "drop" (counted in ``statistics().dropped_stale``), "raise"
        (:class:`~safevars.StaleGradientError`, nothing accumulated) or "scale" (the
        contribution is multiplied by ``1 / (staleness + 1)``, after Zhang et al.,
        "Staleness-aware Async-SGD", 2016; with ``max_staleness=0`` every late
        contribution is scaled, which is their rule). The mean still divides by the
        number of contributions.
      deterministic: If True, keep every pending contribution (4 bytes per element each)
        and reduce them in a canonical order at ``take``: the result is bitwise identical
        whatever order they arrive in. If False, a float32 running sum (4 bytes per
        element in all), order-dependent in its last bits.
      nonfinite: What to do with a contribution holding NaN or Inf: "propagate" (the
        default: accumulate it, as IEEE addition would), "raise"
        (:class:`~safevars.NonFiniteGradientError`, nothing accumulated) or "skip"
        (counted in ``statistics().rejected``).
      max_pending: If set, the most contributions that may be pending at once. An
        ``add`` that would leave more pending is refused before anything changes
        (:class:`~safevars.AccumulatorFullError` eagerly; inside a ``tf.function`` a
        run-time failure naming it, and before an XLA-compiled call that may add more
        than fit, when it is called); ``take`` or ``reset`` make room. A deterministic
        accumulator then allocates its storage for that many up front and never grows
        it, so a traced ``add`` has no growth check (an ``If`` kernel, a function call
        at every ``add``: docs/history.md). None (default): no limit; the storage
        grows as needed.
      lock_span: When an ``add`` traced in a ``tf.function`` takes the lock. ``"step"``
        (default): as early as the function allows, once every op traced before the
        ``add`` that may wait or take other locks (a Python function, an iterator, a
        call, control flow, another section) has run, so the ``MutexLock`` (which
        completes on the mutex's own thread) overlaps the gradient computation instead
        of following it; the lock is then held while the function computes the
        gradients it adds, and a deterministic accumulator's growth check (does the
        buffer have room?) runs meanwhile too. Other threads' ``add``/``take`` wait for
        it meanwhile; their own gradient computation does not. ``"add"``: once the
        contribution is computed, so the lock is held only for the commit. Eager calls
        take it for the commit only, either way. Under a ``tf.distribute`` strategy,
        inside another section or an XLA-compiled function, ``"step"`` behaves as
        ``"add"``.
      name: Name of the module and prefix of its state variables.

    Raises:
      InvalidArgumentError: an argument is out of range, or ``variables`` is empty or
        holds something that is not a variable with a fully defined shape.
      DTypeMismatchError: a variable's dtype is not supported (see ``deterministic``).

    Thread safety:
      ``add``, ``take``, ``take_if_ready`` and ``reset`` are atomic with respect to each
      other in every thread, eagerly and inside ``tf.function``s: a contribution is taken
      exactly once or discarded by ``reset``, never lost or counted twice. The gradient
      arithmetic of ``add`` runs outside the lock (with ``lock_span="step"`` a traced
      ``add`` holds it while its function computes the gradients, see ``lock_span``);
      the commit (a copy of the contribution into free buffer rows, or an
      ``assign_add``) holds it. ``take`` holds
      it while it reads the pending state: a deterministic accumulator reduces the rows
      in place then (one compiled pass, no copy); ``deterministic=False`` copies the
      running sum and divides after.

    Modes:
      Eagerly, the lock is a Python lock and errors are raised before anything changes.
      Inside a ``tf.function``, state changes run inside a ``tf.CriticalSection`` (from
      then on eager calls take the same mutex), and checks that depend on tensor values
      (staleness with ``on_stale="raise"``, ``nonfinite="raise"``, sparse indices,
      ``num_required`` in ``take``) fail when the graph runs, with a
      ``tf.errors.InvalidArgumentError`` whose message names the safevars error; nothing
      of that call is accumulated. Inside ``strategy.run`` every replica's contribution
      counts once; the state is one non-distributed copy, so ``take`` returns the
      cross-replica reduction.

    Strategies:
      ``MirroredStrategy``: one copy of the state on the first variable's device; the
      replicas' contributions are committed in one ``merge_call``, in replica order.
      ``MultiWorkerMirroredStrategy``: each worker keeps its own copy; inside
      ``strategy.run`` every replica's contribution (with its value checks and
      version) is all-gathered first, so every worker commits the same contributions
      in the same order and takes the same bits; a refused contribution fails every
      worker's step alike. ``ParameterServerStrategy``: create the accumulator in
      ``strategy.scope()`` on the coordinator (or for variables on a parameter server):
      its state and critical section live on the first variable's parameter server,
      so ``add`` in functions scheduled on any worker counts once, and eager calls on
      the coordinator run the same critical section as a ``tf.function``. Any other
      strategy, or a PS setup whose workers cannot reach the state, raises
      :class:`~safevars.UnsupportedStrategyError`.

    State (the buffered contributions or running sum, and the counters) is
    checkpointable: ``tf.train.Checkpoint(accumulator=acc)`` saves it, and resuming
    after a restore gives the same result as not stopping.
    """

    def __init__(
        self,
        variables: Any,
        *,
        reduction: str = "mean",
        num_required: int | None = None,
        max_staleness: int | None = None,
        on_stale: str = "drop",
        deterministic: bool = True,
        nonfinite: str = "propagate",
        lock_span: str = "step",
        max_pending: int | None = None,
        name: str = "gradient_accumulator",
    ) -> None:
        super().__init__(name=name)
        if tf.distribute.has_strategy():
            check_strategy()
        reduction = check_choice(reduction, "reduction", _REDUCTIONS)
        max_staleness, on_stale = check_stale_policy(max_staleness, on_stale)
        nonfinite = check_choice(nonfinite, "nonfinite", _NONFINITE_POLICIES)
        num_required = check_int(num_required, "num_required", 1, optional=True)
        max_pending = check_int(max_pending, "max_pending", 1, optional=True)
        if max_pending is not None and num_required is not None and num_required > max_pending:
            raise InvalidArgumentError(
                f"num_required={num_required} is more than max_pending={max_pending}: a "
                "take waiting for num_required contributions would never see them. Pass "
                "max_pending >= num_required."
            )
        deterministic = check_bool(deterministic, "deterministic")
        lock_span = check_choice(
            lock_span,
            "lock_span",
            _LOCK_SPANS,
            fix='"step" takes a traced add\'s lock as early as its function allows; "add" '
            "once its gradients are computed.",
        )
        self._reduction = reduction
        self._num_required = num_required
        self._max_staleness = max_staleness
        self._on_stale = on_stale
        self._deterministic = deterministic
        self._nonfinite = nonfinite
        self._lock_span = lock_span
        self._max_pending = max_pending

        leaves = tf.nest.flatten(variables)
        if not leaves:
            raise InvalidArgumentError(
                "variables must hold at least one variable, got an empty structure."
            )
        slots: list[_Slot] = []
        for index, variable in enumerate(leaves):
            slots.append(_slot(index, variable, sum(s.size for s in slots)))
        # Python structures live in an untracked holder: tf.Module would wrap them.
        self._helpers = _Helpers(leaves, tf.nest.map_structure(lambda _: 0, variables))
        self._slots = tuple(slots)
        self._size = sum(s.size for s in slots)
        self._layout = _block_layout(self._slots) if deterministic else _flat_layout(self._slots)
        if any(s.dtype == tf.float64 for s in self._slots):
            if deterministic:
                names = [s.name for s in self._slots if s.dtype == tf.float64]
                raise DTypeMismatchError(
                    f"deterministic=True supports float16, bfloat16 and float32 "
                    f"variables; {names} are float64. Pass deterministic=False to "
                    "accumulate them in float64 (in arrival order)."
                )
            self._sum_dtype = tf.float64
        else:
            self._sum_dtype = tf.float32

        device = _state_device(leaves[0])
        prefix = name
        helpers = self._helpers
        with tf.init_scope(), tf.device(device):
            # Direct ResourceVariable construction bypasses distribution strategies'
            # variable creators: the state is one copy even under strategy.scope().
            if deterministic:
                rows = max(num_required or 0, _MIN_ROWS)
                # With a gradient stored straight from its tensor (layout.direct), the
                # first ``rows`` pending contributions are kept by reference
                # (_References); the buffer holds the ones after them.
                references = rows if self._layout.direct else 0
                buffered = 0 if references else rows
                if max_pending is not None:  # storage for max_pending, made now
                    references = min(references, max_pending)
                    buffered = max_pending - references
                    if buffered and self._refuses_at_run_time():
                        # Where a traced add writes contributions refused when it runs
                        # (past the pending ones, never read): see commit._write_blocks.
                        buffered += 1
                helpers.references = _References(self._layout, references, prefix)
                # Declared with an unknown rank, not [None, elements]: TensorFlow 2.21
                # aborts a worker that receives a handle to a remote variable whose
                # shape has an unknown dimension (RemoteMgr builds a TensorShape from
                # it), which is how ParameterServerStrategy workers reach the state.
                # One block of layout.chunks rows of layout.width elements per contribution.
                self._state = _RowsVariable(
                    tf.zeros([buffered * self._layout.chunks, self._layout.width], tf.float32),
                    trainable=False,
                    name=f"{prefix}_rows",
                    shape=tf.TensorShape(None),
                )
                minimum_rows = buffered * self._layout.chunks if max_pending is not None else 0
                self._state._set_layout(self._layout, self._size, helpers.references, minimum_rows)
            else:
                helpers.references = _References(self._layout, 0, prefix)
                self._state = resource_variable_ops.ResourceVariable(
                    tf.zeros([self._size], self._sum_dtype),
                    trainable=False,
                    name=f"{prefix}_sum",
                )
            self._counters = resource_variable_ops.ResourceVariable(
                tf.zeros([_NUM_COUNTERS], tf.int64),
                trainable=False,
                name=f"{prefix}_counters",
            )
            self._guard = Guard(self._state)
            protect(self._guard, self._counters)  # Checkpoints save both under the lock.
        # State on a parameter server: eager calls (on the coordinator) run as
        # tf.functions, whose critical section runs there (see _run_remote).
        self._remote = on_parameter_server(self._state.device)
        # Set, and replaced by a fresh one, at each eager arrival (commit.py): what an
        # eager take waits on (take.py). An event, not a condition: an interrupt right
        # after a ``with condition:`` took its lock would leave the lock held for good.
        # Two arrivals at once may leave a take waiting on an event that neither sets:
        # it polls again within take's 50 ms anyway.
        self._arrival = threading.Event()
        helpers.prepare = tf.function(self._prepare_math, autograph=False, reduce_retracing=True)
        helpers.finish = tf.function(self._finish_math, autograph=False, reduce_retracing=True)
        if deterministic:
            helpers.reduce = self._shared_reduce()

    def _shared_reduce(self) -> Any:
        """``reduce(marker, count)`` of ``_reduce_rows``: the compiled reduction every
        accumulator of this layout shares (:mod:`.shared_reductions`), given this one's
        row buffer and blocks kept by reference."""
        layout, references = self._layout, self._helpers.references
        function = shared_reduction(
            layout.width,
            layout.chunks,
            layout.firsts,
            references.shapes,
            references.count,
            self._reduction,
            self._shared_dtype(),
        )
        state = self._state
        blocks = [piece for block in references.blocks for piece in block]

        def reduce(marker: tf.Tensor, count: tf.Tensor) -> Any:
            return function([state.handle, *(piece.handle for piece in blocks)], marker, count)

        return reduce

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        """For ``tf.saved_model.save`` also the version and lock its traced adds and
        takes capture (:func:`safevars.locking.saved_model.saved_guards`)."""
        children = dict(super()._trackable_children(save_type, **kwargs))
        if save_type == "savedmodel":
            children["safevars"] = saved_guards([self._guard])
        return children

    # ------------------------------------------------------------------ properties

    @property
    def reduction(self) -> str:
        """ "mean" or "sum"."""
        return self._reduction

    @property
    def num_required(self) -> int | None:
        """How many contributions an eager ``take`` waits for (None: no waiting)."""
        return self._num_required

    @property
    def deterministic(self) -> bool:
        """Whether results are bitwise independent of the order of arrival."""
        return self._deterministic

    @property
    def state_bytes(self) -> int:
        """Bytes of accumulation state now (eager).

        Deterministic: 4 bytes per element per contribution the buffer has room for (at
        least ``max(num_required, 4)``, and the most ever pending at once; with
        ``max_pending``, that many, plus one spare block when a traced ``add`` may
        refuse a contribution as it runs, see ``_refuses_at_run_time``), plus the
        padding of a contribution's last row (fewer than 1,024 elements, and only when
        some gradient has at least 65,536; then the first ``max(num_required, 4)`` are
        the blocks kept by reference, and the *sink* holding the last contribution
        pending beyond them is counted too). Otherwise 4 (8 for float64) per element.
        """
        buffer = int(np.prod(self._rows_shape().numpy())) * self._state.dtype.size
        if self._references:
            buffer += self._helpers.references.nbytes()
        return buffer

    def _refuses_at_run_time(self) -> bool:
        """Whether a traced ``add`` may refuse a contribution when it runs (a stale one
        dropped, a non-finite one skipped) rather than fail or accept it."""
        stale = self._max_staleness is not None and self._on_stale == "drop"
        return stale or self._nonfinite == "skip"

    @property
    def _references(self) -> int:
        """Pending blocks kept by reference (:class:`~.state._References`); 0 without a
        gradient of at least 65,536 elements, and for a running sum."""
        return self._helpers.references.count

    @property
    def count(self) -> int | tf.Tensor:
        """Contributions pending (accumulated and not yet taken).

        Returns:
          Eagerly an ``int``; inside a ``tf.function`` an int64 scalar tensor.

        Thread safety: a consistent value (one read of the counters), possibly stale by
        the time the caller uses it; use :meth:`take_if_ready` to act on it atomically.
        """
        value = self._counters[_PENDING]
        return int(value) if tf.executing_eagerly() else value

    @property
    def version(self) -> int | tf.Tensor:
        """The parameter version an ``int`` version given to :meth:`add` is compared with.

        The largest ``.version`` among the SafeVariables in ``variables`` (an optimizer
        step adds 1 to each), or, when none is a SafeVariable, the number of ``take``
        calls that took something so far (``statistics().takes``).

        Returns:
          Eagerly an ``int``; inside a ``tf.function`` an int64 scalar tensor.
        """
        return self._version_now()

    def statistics(self) -> AccumulatorStatistics:
        """A frozen :class:`AccumulatorStatistics` record, read at one instant.

        Thread safety: all fields belong to the same instant (read under the lock).

        Modes: eagerly Python ``int`` fields; inside a ``tf.function`` int64 tensors
        read inside the critical section.
        """
        if tf.executing_eagerly():
            if self._remote:
                values = self._run_remote("statistics", self.statistics)
                return AccumulatorStatistics(*(int(v) for v in values))
            with hold([self._guard]):
                values = self._counters.numpy().tolist()
            return AccumulatorStatistics(*values)
        counters = graph_section([self._guard], self._counters.read_value)
        return AccumulatorStatistics(*tf.unstack(counters))

    def locked(self, timeout: float | None = None) -> hold:
        """Holds the accumulator still: no ``add``, ``take`` or ``reset`` meanwhile.

        Example::

            with accumulator.locked():
                pending = accumulator.count     # and nothing arrives until the block ends

        ``tf.train.Checkpoint`` and Keras saving take this lock themselves while they
        save or restore the accumulator (its rows and counters are always a state that
        existed); use this for reading several things at one instant, or to pause
        contributions.

        Args:
          timeout: Seconds to wait for the lock at most (None: no limit).

        Returns:
          A context manager (``safevars.locked``'s kind).

        Raises:
          LockTimeoutError: the lock was not free within ``timeout``.

        Thread safety: exclusive with every safevars operation on the accumulator;
        re-entrant for the holding thread.

        Modes: eager only; on a parameter server, hold it from a scheduled or coordinator
        ``tf.function`` instead (an eager lock from the coordinator is refused).
        """
        return hold([self._guard], check_timeout(timeout))

    def __repr__(self) -> str:
        kind = "deterministic" if self._deterministic else "float"
        pending = self.count if tf.executing_eagerly() else "?"
        return (
            f"<safevars.GradientAccumulator {self.name!r} variables={len(self._slots)} "
            f"elements={self._size} reduction={self._reduction} {kind} pending={pending}>"
        )
