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

How determinism is achieved (``deterministic=True``):
  ``add`` stores each contribution as one float32 row of a ``[capacity, elements]``
  buffer (float16 and bfloat16 widen to float32 exactly), at the next free row: one
  copy, no arithmetic. ``take`` reduces the pending rows with a two-level *reproducible
  summation* (after Demmel and Nguyen, "Fast Reproducible Floating-Point Summation",
  ARITH 2013): for each element, with ``M`` the largest magnitude among its values (a
  maximum does not depend on order), every value is split exactly into a multiple of a
  grid ``q1`` derived from ``M`` and the count, a multiple of a finer grid ``q2`` and a
  remainder below ``q2``. The multiples are integers small enough that their float64
  sums are exact in any order; the remainders (below ``2**-87 * M`` in total for up to
  64 contributions) are dropped. ``sum1 * q1 + sum2 * q2`` is then rounded once, divided
  by the count once and rounded once to the variable's dtype. Every step is exact or a
  single IEEE rounding, so the result depends only on the multiset of contributions,
  not on their order, their rows, the summation order TensorFlow or XLA picks, or the
  device; and it is within float32 rounding of the exact mean unless the contributions
  cancel to below about ``2**-60`` of their largest value. The reduction is one
  XLA-compiled function (``jit_compile=True``) that reads the buffer in place, under
  the lock, and combines four rows at a time by elementwise ops, so that for up to
  four contributions it is a single vectorized pass (on the 2-core development CPU,
  launch included and measured with other processes running: about 60 µs for 26K
  elements, 2 ms for 1.3M); XLA does not change the result.

Memory cost of ``deterministic=True``: **4 bytes per element per buffered contribution**,
that is ``4 * K`` bytes per gradient element to accumulate K micro-batches (Keras'
``gradient_accumulation_steps`` and ``deterministic=False`` keep 4: one float32 running
sum). The buffer starts with ``max(num_required, 4)`` rows, doubles when an ``add``
finds it full and keeps its size after ``take``. ``take`` copies nothing: it reads the
first ``2**ceil(log2(pending))`` rows in place (at least 4; the whole buffer beyond
1024 pending) and reduces them in O(rows) per element; its only other memory is the
float32 result and the compiled function's per-element temporaries. With
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
  * ``take`` of a deterministic accumulator runs an XLA-compiled function; TensorFlow
    builds without XLA's JIT cannot run it. It runs under the lock (it reads the rows
    in place), so the first ``take`` for each power of two of pending rows also holds
    the lock while XLA compiles (a fraction of a second).
  * Under ``tf.distribute`` only the strategies of :mod:`safevars.distribute` are
    supported (see "Strategies" in :class:`GradientAccumulator`); under
    ``ParameterServerStrategy`` the accumulator must be created in the strategy's
    scope (or for variables on a parameter server), or the workers cannot reach it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from safevars._tf_internal import (  # nest: flatten_up_to (not in tf.nest)
    gen_resource_variable_ops,
    nest,
    resource_variable_ops,
)
from safevars._validation import check_bool, check_choice, check_int, short
from safevars.distribute import (
    SUPPORTED_STRATEGIES,
    check_strategy,
    is_parameter_server,
    on_parameter_server,
)
from safevars.errors import (
    AccumulatorTimeoutError,
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
    StaleGradientError,
    UnsupportedStrategyError,
    assertion_text,
    from_assertion,
)
from safevars.locking import Guard, check_timeout, graph_section, hold, protect
from safevars.snapshot import Snapshot
from safevars.staleness import check_stale_policy, refuse_stale, scale_stale, version_lag

__all__ = ["AccumulatorStatistics", "GradientAccumulator"]

_MIN_ROWS = 4
# Rows combined elementwise by the reduction (see _reproducible_sum).
_GROUP = 4
# Pending counts up to this read a power of two of rows at take, beyond it all rows.
_MARKER_TABLE = 1024
_LN2 = float(np.log(2.0))
_POWER_BITS = 1 << 52  # float64 bits of the exponent field's least significant bit
_EXPONENT_FIELD = 0x7FF << 52

# Counter positions in the int64 counters variable.
_PENDING, _ADDED, _DROPPED, _REJECTED, _SCALED, _TAKEN, _TAKES, _DISCARDED = range(8)
_NUM_COUNTERS = 8

_REDUCTIONS = ("mean", "sum")
_NONFINITE_POLICIES = ("propagate", "raise", "skip")
_NARROW_FLOATS = (tf.float16, tf.bfloat16, tf.float32)
_POLL_SECONDS = 0.05
# The errors the run-time assertions of the graph path stand for (errors.assertion_text).
_RUNTIME_ERRORS = (
    StaleGradientError,
    NonFiniteGradientError,
    AccumulatorTimeoutError,
    InvalidArgumentError,
)


class AccumulatorStatistics(NamedTuple):
    """A frozen record of what an accumulator has seen (see ``statistics()``).

    Invariant: ``added == pending + taken + discarded``.

    Attributes:
      pending: Contributions accumulated and not yet taken (``count``).
      added: Contributions accumulated since construction (or the checkpoint).
      dropped_stale: Contributions dropped as stale (``on_stale="drop"``).
      rejected: Contributions skipped as non-finite (``nonfinite="skip"``).
      scaled: Accumulated contributions that were scaled down as stale.
      taken: Contributions handed out by ``take``.
      takes: Calls of ``take`` that took something (also the accumulator's version).
      discarded: Contributions thrown away by ``reset``.
    """

    pending: int | tf.Tensor
    added: int | tf.Tensor
    dropped_stale: int | tf.Tensor
    rejected: int | tf.Tensor
    scaled: int | tf.Tensor
    taken: int | tf.Tensor
    takes: int | tf.Tensor
    discarded: int | tf.Tensor


class _Slot(NamedTuple):
    """One variable's place in the flat state."""

    index: int
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

    def __init__(self, variables: list[Any], structure: Any) -> None:
        self.variables = variables
        self.structure = structure
        self.prepare: Callable[..., Any] | None = None
        self.finish: Callable[..., Any] | None = None
        self.remote_functions: dict[str, Callable[..., Any]] = {}
        self.reduce: Callable[..., Any] | None = None
        # The strategy in whose scope the accumulator was created, if any.
        self.strategy: tf.distribute.Strategy | None = (
            tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        )


class GradientAccumulator(tf.Module):
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
      name: Name of the module and prefix of its state variables.

    Raises:
      InvalidArgumentError: an argument is out of range, or ``variables`` is empty or
        holds something that is not a variable with a fully defined shape.
      DTypeMismatchError: a variable's dtype is not supported (see ``deterministic``).

    Thread safety:
      ``add``, ``take``, ``take_if_ready`` and ``reset`` are atomic with respect to each
      other in every thread, eagerly and inside ``tf.function``s: a contribution is taken
      exactly once or discarded by ``reset``, never lost or counted twice. The gradient
      arithmetic of ``add`` runs outside the lock; only the commit (a row copy or an
      ``assign_add``) holds it. ``take`` holds it while it reads the pending state: a
      deterministic accumulator reduces the rows in place then (one compiled pass, no
      copy); ``deterministic=False`` copies the running sum and divides after.

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
        name: str = "gradient_accumulator",
    ) -> None:
        super().__init__(name=name)
        if tf.distribute.has_strategy():
            check_strategy()
        reduction = check_choice(reduction, "reduction", _REDUCTIONS)
        max_staleness, on_stale = check_stale_policy(max_staleness, on_stale)
        nonfinite = check_choice(nonfinite, "nonfinite", _NONFINITE_POLICIES)
        num_required = check_int(num_required, "num_required", 1, optional=True)
        deterministic = check_bool(deterministic, "deterministic")
        self._reduction = reduction
        self._num_required = num_required
        self._max_staleness = max_staleness
        self._on_stale = on_stale
        self._deterministic = deterministic
        self._nonfinite = nonfinite

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
        with tf.init_scope(), tf.device(device):
            # Direct ResourceVariable construction bypasses distribution strategies'
            # variable creators: the state is one copy even under strategy.scope().
            if deterministic:
                rows = max(num_required or 0, _MIN_ROWS)
                # Declared with an unknown rank, not [None, elements]: TensorFlow 2.21
                # aborts a worker that receives a handle to a remote variable whose
                # shape has an unknown dimension (RemoteMgr builds a TensorShape from
                # it), which is how ParameterServerStrategy workers reach the state.
                self._state = resource_variable_ops.ResourceVariable(
                    tf.zeros([rows, self._size], tf.float32),
                    trainable=False,
                    name=f"{prefix}_rows",
                    shape=tf.TensorShape(None),
                )
            else:
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
        self._arrived = threading.Condition()
        self._arrivals = 0
        helpers = self._helpers
        helpers.prepare = tf.function(self._prepare_math, autograph=False, reduce_retracing=True)
        helpers.finish = tf.function(self._finish_math, autograph=False, reduce_retracing=True)
        if deterministic:
            helpers.reduce = tf.function(
                self._reduce_math,
                autograph=False,
                jit_compile=True,
                input_signature=[
                    tf.TensorSpec([None, 0], tf.float32),
                    tf.TensorSpec([], tf.int64),
                ],
            )

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

        Deterministic: 4 × buffer rows per element (rows >= the most contributions ever
        pending at once, at least ``max(num_required, 4)``). Otherwise 4 (8 for float64)
        per element.
        """
        return int(np.prod(self._rows_shape().numpy())) * self._state.dtype.size

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

    def _strategy(self) -> tf.distribute.Strategy | None:
        """The current strategy (None outside any), checked for this accumulator.

        Raises:
          UnsupportedStrategyError: the strategy is not supported, or it is a
            ``ParameterServerStrategy`` and the state is not on a parameter server.
        """
        if not tf.distribute.has_strategy():
            return None
        strategy = check_strategy()
        if is_parameter_server(strategy) and not on_parameter_server(self._state.device):
            raise UnsupportedStrategyError(
                f"GradientAccumulator {self.name!r} keeps its state on "
                f"{self._state.device or 'this process'}, which ParameterServerStrategy "
                "workers cannot reach. Create it in strategy.scope() on the coordinator "
                "(or for variables that live on a parameter server): its state then "
                "lives on a parameter server, where every worker adds to it under one "
                f"lock. Supported: {', '.join(SUPPORTED_STRATEGIES)}."
            )
        return strategy

    def _run_remote(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` as a ``tf.function``: how eager calls reach state on a PS.

        The coordinator cannot take a parameter server's mutex eagerly (a ``MutexLock``
        sent from the coordinator while scheduled steps take the same mutex was seen to
        hang; :class:`~safevars.locking.Guard` refuses it), so it runs the graph path,
        whose critical section executes on the parameter server like the workers'. The
        run-time checks of that path come back as the safevars errors they name.
        """
        functions = self._helpers.remote_functions
        function = functions.get(key)
        if function is None:
            function = functions.setdefault(
                key, tf.function(fn, autograph=False, reduce_retracing=True)
            )
        try:
            return function(*args)
        except tf.errors.InvalidArgumentError as e:
            error = from_assertion(
                e,
                _RUNTIME_ERRORS,
                note=" (checked on the parameter server; nothing of the call took effect).",
            )
            if error is not None:
                raise error from None
            raise

    # ------------------------------------------------------------------ add

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
          Nothing of a call that raises is accumulated and no statistic changes.

        Thread safety: the staleness decision and the commit of the contribution and of
        the statistics form one atomic step with respect to ``add``, ``take`` and
        ``reset`` in every thread and running graph.

        Modes: eager, inside ``tf.function`` (the commit runs in the critical section)
        and inside ``strategy.run`` (one ``merge_call``: the replicas' contributions are
        committed together, in replica order).
        """
        self._leaves(gradients)  # the structure first: a clean error, nothing changed
        strategy = self._strategy()
        replica = _replica_context()
        if replica is not None:
            if _spans_workers(strategy):
                return self._add_across_workers(replica, gradients, version)
            part = self._prepare(gradients, version)
            return replica.merge_call(self._merge_add, args=(tuple(part),))
        owner = strategy if strategy is not None else self._helpers.strategy
        if _spans_workers(owner) and _holds_distributed(gradients, version):
            # This worker holds only its own replicas' values: add them in replica
            # context, where every worker's are gathered.
            with owner.scope():
                counts = owner.run(lambda g, v: self.add(g, version=v), args=(gradients, version))
            return owner.experimental_local_results(counts)[0]
        return self._commit([self._prepare(g, version) for g in _per_replica(gradients)])

    def _merge_add(self, strategy: tf.distribute.Strategy, part: tuple) -> Any:
        replicas = strategy.num_replicas_in_sync  # all local: no replica on other workers
        fields = [_local_values(x, replicas) for x in part]
        parts = [_Part(*(f[r] for f in fields)) for r in range(replicas)]
        return self._commit(parts)

    def _add_across_workers(
        self, ctx: tf.distribute.ReplicaContext, gradients: Any, version: Any
    ) -> Any:
        """``add`` in a replica of a strategy whose replicas span processes.

        Every replica's contribution, with its value-dependent flags (finite, sparse
        indices in range) and versions, is all-gathered first, so every worker checks
        and commits the same contributions in the same (replica) order: the workers'
        states stay equal, each contribution counts once in each, and a refused
        contribution fails every worker's step alike (none is left waiting in a
        collective).
        """
        entries, part, in_range = self._compute(gradients, version)
        replicas = ctx.num_replicas_in_sync
        sparse = 0 if in_range is None else int(in_range.shape[0])
        by_element = part.elements is not None
        if part.version_kind == "each":
            versions = tuple(part.version)
        elif part.version_kind == "int":
            versions = (part.version,)
        else:
            versions = ()
        finite = True if part.finite is None else part.finite
        ints = [tf.reshape(tf.cast(finite, tf.int64), [1])]
        if in_range is not None:
            ints.append(tf.cast(in_range, tf.int64))
        if by_element:
            ints.append(tf.reshape(tf.size(part.values, out_type=tf.int64), [1]))
        ints.extend(tf.reshape(tf.cast(v, tf.int64), [1]) for v in versions)
        local = [tf.concat(ints, 0)[None], part.values if by_element else part.values[None]]
        if by_element:
            local.append(part.elements)
        gathered = ctx.all_gather(local, axis=0)

        def merge(strategy: tf.distribute.Strategy, gathered: Any) -> Any:
            # Every local replica holds the same gathered tensors: use the first's.
            small, values, *rest = [strategy.experimental_local_results(x)[0] for x in gathered]
            elements = rest[0] if rest else None
            in_range = tf.cast(small[:, 1 : 1 + sparse], tf.bool) if sparse else None
            elements, values, finite = self._check(
                entries, elements, values, tf.cast(small[:, 0], tf.bool), in_range
            )
            column = 1 + sparse
            if by_element:
                lengths = small[:, column]
                value_parts = tf.split(values, lengths, num=replicas)
                element_parts = tf.split(elements, lengths, num=replicas)
                column += 1
            else:
                value_parts = tf.unstack(values, num=replicas)
                element_parts = [None] * replicas
            eager = tf.executing_eagerly()
            table = small.numpy() if eager else small
            finite_flags = (
                finite
                if finite is True
                else (
                    [bool(f) for f in np.asarray(finite).tolist()]
                    if eager
                    else tf.unstack(finite, num=replicas)
                )
            )
            parts = []
            for r in range(replicas):
                row = [table[r, column + i] for i in range(len(versions))]
                if eager:
                    row = [int(x) for x in row]
                if part.version_kind == "each":
                    version_r: Any = tuple(row)
                elif part.version_kind == "int":
                    version_r = row[0]
                else:
                    version_r = None
                parts.append(
                    _Part(
                        element_parts[r],
                        value_parts[r],
                        True if finite_flags is True else finite_flags[r],
                        part.version_kind,
                        version_r,
                    )
                )
            return self._commit(parts)

        return ctx.merge_call(merge, args=(tuple(gathered),))

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
                bad = [i for i, ok in enumerate(flags.tolist()) if not ok]
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
        values = tf.concat(values_list, 0) if values_list else tf.zeros([0], self._sum_dtype)
        elements = None
        if by_element:
            elements = tf.concat(elements_list, 0) if elements_list else tf.zeros([0], tf.int64)
        finite = (
            tf.reduce_all(tf.math.is_finite(values)) if self._nonfinite != "propagate" else None
        )
        checks = tf.stack(in_range) if in_range else None
        return elements, values, finite, checks

    # ------------------------------------------------------------------ commit

    def _commit(self, parts: list[_Part]) -> int | tf.Tensor:
        """Decides and commits contributions in one critical section."""
        if not tf.executing_eagerly():
            # The lock waits for every tensor of the contributions (after=parts).
            return graph_section([self._guard], lambda: self._commit_body(parts), parts)
        if self._remote:
            accepted = int(
                self._run_remote(
                    "add", lambda p: self._commit([_Part(*x) for x in p]), _as_tensors(parts)
                )
            )
        else:
            with hold([self._guard]):
                accepted = self._commit_body(parts)
        if accepted:
            with self._arrived:
                self._arrivals += 1
                self._arrived.notify_all()
        return int(accepted)

    def _commit_body(self, parts: list[_Part]) -> int | tf.Tensor:
        """The state change of ``add``. Runs with the lock held (eager or graph)."""
        eager = tf.executing_eagerly()
        checks: list[Any] = []
        kept: list[tuple[_Part, Any, Any, Any]] = []  # (part, accept, scale, staleness)
        accepted, dropped, rejected, scaled = [], [], [], []
        for part in parts:
            staleness = self._staleness(part)
            stale: Any = False
            if staleness is not None:
                stale = staleness > self._max_staleness
            if self._on_stale == "raise" and staleness is not None:
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
        with tf.control_dependencies(checks):
            self._apply(kept)
            n = _total(accepted)
            delta = [n, n, _total(dropped), _total(rejected), _total(scaled), 0, 0, 0]
            if eager and not any(isinstance(d, tf.Tensor) for d in delta):
                if any(delta):
                    self._counters.assign_add(delta, read_value=False)
            else:
                delta = tf.stack([tf.cast(d, tf.int64) for d in delta])
                self._counters.assign_add(delta, read_value=False)
            if not eager:
                return tf.cast(n, tf.int64)  # made to depend on the commit
        return n

    def _staleness(self, part: _Part) -> Any:
        if part.version_kind == "none" or self._max_staleness is None:
            return None
        if part.version_kind == "int":
            return version_lag(self._version_now(), part.version)
        lags = [version_lag(self._slots[i].guard.version(), v) for i, v in enumerate(part.version)]
        if all(isinstance(x, int) for x in lags):
            return max(lags)
        return tf.reduce_max(tf.stack([tf.cast(x, tf.int64) for x in lags]))

    def _apply(self, kept: list[tuple[_Part, Any, Any, Any]]) -> None:
        """Adds the accepted contributions to the state (lock held)."""
        if not kept:
            return
        if self._deterministic:
            self._store_rows(kept)
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

    def _store_rows(self, kept: list[tuple[_Part, Any, Any, Any]]) -> None:
        """Copies the accepted rows to the next free buffer rows, growing it if full.

        Rows refused at run time (a bool tensor) are moved behind the accepted ones, past
        the new pending count, where they are ignored.
        """
        rows = [scale_stale(part.values, staleness, scale) for part, _, scale, staleness in kept]
        block = rows[0][None] if len(rows) == 1 else tf.stack(rows)
        accepts = [accept for _, accept, _, _ in kept]
        if any(isinstance(a, tf.Tensor) for a in accepts):
            refused = tf.stack([tf.logical_not(tf.cast(a, tf.bool)) for a in accepts])
            block = tf.gather(block, tf.argsort(tf.cast(refused, tf.int32), stable=True))
        count = len(rows)
        if tf.executing_eagerly():
            pending = int(self._counters[_PENDING])
            capacity = int(self._rows_shape()[0])
            if pending + count > capacity:
                self._grow(capacity, pending + count)
            positions = tf.range(pending, pending + count, dtype=tf.int64)
            gen_resource_variable_ops.resource_scatter_update(self._state.handle, positions, block)
            return
        pending = self._counters[_PENDING]
        capacity = self._rows_shape()[0]
        needed = pending + count

        def grow() -> tf.Tensor:
            self._grow(capacity, needed)
            return tf.constant(True)

        grown = tf.cond(needed > capacity, grow, lambda: tf.constant(False))
        with tf.control_dependencies([grown]):
            positions = pending + tf.range(count, dtype=tf.int64)
            gen_resource_variable_ops.resource_scatter_update(self._state.handle, positions, block)

    def _rows_shape(self) -> tf.Tensor:
        """The state's shape (int64), without reading it.

        ``tf.shape(variable)`` reads the variable, and once a scatter has touched it a
        read copies all of it.
        """
        return gen_resource_variable_ops.variable_shape(self._state.handle, out_type=tf.int64)

    def _grow(self, capacity: int | tf.Tensor, needed: int | tf.Tensor) -> None:
        """Doubles the row buffer (or more, to ``needed`` rows), keeping its rows."""
        new = tf.maximum(tf.cast(capacity, tf.int64) * 2, tf.cast(needed, tf.int64))
        extra = tf.zeros(tf.stack([new - tf.cast(capacity, tf.int64), self._size]), tf.float32)
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

    # ------------------------------------------------------------------ take

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
        ``tf.cond`` instead. Inside ``strategy.run`` one replica-synchronous take
        returns the same result to every replica.
        """
        self._strategy()
        replica = _replica_context()
        if replica is not None:
            return replica.merge_call(lambda _: self.take(timeout))
        if tf.executing_eagerly():
            return self._take_eager(timeout)
        return self._take_graph(conditional=False)[1]

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
            with self._arrived:
                generation = self._arrivals
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
            with self._arrived:
                if self._arrivals == generation:
                    self._arrived.wait(wait)

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

    def _reduce_rows(self, pending: int | tf.Tensor) -> tuple[tf.Tensor, ...]:
        """The reduced pending rows, one tensor per variable (lock held; deterministic).

        One XLA-compiled function reads the row buffer in place (no copy), reduces its
        first ``pending`` rows with :func:`_reproducible_sum`, divides and splits the
        result by variable. It reads the first ``rows`` rows of the buffer, ``rows``
        the power of two at or above ``pending`` (at least :data:`_GROUP`): the shape of
        an empty ``[rows, 0]`` tensor passed to it, so one trace serves every count and
        XLA compiles once per power of two that occurs (XLA needs static shapes).
        Past :data:`_MARKER_TABLE` pending rows it reads the whole buffer.
        """
        if isinstance(pending, tf.Tensor) and tf.get_static_value(pending) is None:
            pending = tf.cast(pending, tf.int64)
            shape = tf.gather(_marker_shapes(), tf.minimum(pending, _MARKER_TABLE))
        else:
            count = (
                int(tf.get_static_value(pending))
                if isinstance(pending, tf.Tensor)
                else int(pending)
            )
            shape = _marker_shapes()[min(count, _MARKER_TABLE)]
            pending = tf.constant(count, tf.int64)
        return self._helpers.reduce(tf.zeros(shape, tf.float32), pending)

    def _reduce_math(self, marker: tf.Tensor, count: tf.Tensor) -> tuple[tf.Tensor, ...]:
        buffer = tf.reshape(self._state.read_value(), [-1, self._size])
        rows = buffer[: tf.shape(marker)[0]]  # or fewer, if the buffer is smaller
        return self._split(_reproducible_sum(rows, count), count)

    def _take_graph(self, conditional: bool, required: int | None = None) -> tuple[tf.Tensor, Any]:
        if required is None:
            required = self._num_required or (1 if conditional else 0)

        def body() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
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
                    state = tf.cond(ready, lambda: self._reduce_rows(pending), self._zeros)
                else:
                    state = self._reduce_rows(pending)

            def reset() -> tf.Tensor:
                with tf.control_dependencies(tf.nest.flatten(state)):
                    if not self._deterministic:
                        self._state.assign(
                            tf.zeros(self._state.shape, self._state.dtype), read_value=False
                        )
                    delta = tf.one_hot(_TAKEN, _NUM_COUNTERS, dtype=tf.int64) * pending
                    delta -= tf.one_hot(_PENDING, _NUM_COUNTERS, dtype=tf.int64) * pending
                    delta += tf.one_hot(_TAKES, _NUM_COUNTERS, dtype=tf.int64) * tf.cast(
                        pending > 0, tf.int64
                    )
                    self._counters.assign_add(delta, read_value=False)
                    return tf.constant(True)

            if conditional:
                done = tf.cond(ready, reset, lambda: tf.constant(False))
            else:
                done = reset()
            return state, pending, done

        state, pending, ready = graph_section([self._guard], body)
        if conditional and not self._deterministic:
            grads = tf.cond(
                ready,
                lambda: tuple(tf.nest.flatten(self._finish(state, pending))),
                self._zeros,
            )
            return ready, tf.nest.pack_sequence_as(self._helpers.structure, list(grads))
        return ready, self._finish(state, pending)

    def _zeros(self) -> tuple[tf.Tensor, ...]:
        return tuple(tf.zeros(s.shape, s.dtype) for s in self._slots)

    def _finish(self, state: Any, pending: int | tf.Tensor) -> Any:
        """Reduced gradients from a state read by take (outside the lock).

        A deterministic accumulator's state was reduced under the lock already.
        """
        if self._deterministic:
            flat = state
        else:
            pending = tf.convert_to_tensor(pending, tf.int64)
            math = self._helpers.finish if tf.executing_eagerly() else self._finish_math
            flat = math(state, pending)
        return tf.nest.pack_sequence_as(self._helpers.structure, list(flat))

    def _finish_math(self, state: tf.Tensor, pending: tf.Tensor) -> tuple:
        return self._split(state, pending)

    def _split(self, total: tf.Tensor, pending: tf.Tensor) -> tuple[tf.Tensor, ...]:
        """The flat sum divided for "mean", cut into one tensor per variable."""
        if self._reduction == "mean":
            divisor = tf.cast(tf.maximum(pending, 1), total.dtype)
            total = total / divisor
        dtypes = {slot.dtype for slot in self._slots}
        if len(dtypes) == 1:  # one cast of the whole (a cast rounds each element alone)
            total = tf.cast(total, dtypes.pop())
        out = []
        for slot in self._slots:
            piece = total[slot.offset : slot.offset + slot.size]
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


# ---------------------------------------------------------------------- reproducible sum


@functools.cache
def _marker_shapes_array() -> np.ndarray:
    shapes = [[1 << (max(i, _GROUP) - 1).bit_length(), 0] for i in range(_MARKER_TABLE)]
    return np.array(shapes + [[2**30, 0]], np.int32)  # 2**30: the whole buffer


def _marker_shapes() -> tf.Tensor | np.ndarray:
    """Row i: the shape of take's marker for i pending rows (see ``_reduce_rows``).

    A constant in a graph (one gather picks the row: cheaper than computing a power of
    two with scalar ops); the array itself eagerly.
    """
    table = _marker_shapes_array()
    return table if tf.executing_eagerly() else tf.constant(table)


def _reproducible_sum(rows: tf.Tensor, count: tf.Tensor) -> tf.Tensor:
    """Per-element sums of the first ``count`` rows, independent of the rows' order.

    Args:
      rows: float32 ``[b, n]``; rows at ``count`` and beyond are ignored.
      count: int64 scalar, at most ``b``.

    Returns:
      float64 ``[n]``. See the module docstring for the method and its error bound.
      Non-finite values propagate as in IEEE addition (+Inf and -Inf give NaN).

    The rows are taken in groups of :data:`_GROUP` (the last one padded with ignored
    rows): within a group the rows are combined by elementwise ops, across groups by
    reductions, so with up to ``_GROUP`` rows XLA compiles the whole sum into one
    vectorized pass. The grouping does not change the result: maxima, and sums of
    integers below 2**53, are exact in any order.
    """
    count = tf.cast(count, tf.int64)
    n = rows.shape[1]
    b = tf.shape(rows, out_type=tf.int64)[0]
    rows = tf.pad(rows, [[0, tf.math.floormod(-b, _GROUP)], [0, 0]])
    groups = tf.reshape(rows, [-1, _GROUP, n if n is not None else -1])
    first = tf.range(tf.shape(groups, out_type=tf.int64)[0]) * _GROUP
    xs = [
        tf.where(
            (first + j < count)[:, None],
            tf.cast(groups[:, j], tf.float64),
            tf.zeros([], tf.float64),
        )
        for j in range(_GROUP)
    ]  # [groups, n] each: row j of every group
    biggest = tf.reduce_max(functools.reduce(tf.maximum, [tf.abs(x) for x in xs]), axis=0)
    # 2**floor(log2(biggest)) as float64 bits (its exponent field), clamped to
    # [2**-160, 2**128]: below for zeros, above for Inf/NaN.
    unit = tf.clip_by_value(
        tf.bitwise.bitwise_and(tf.bitcast(biggest, tf.int64), _EXPONENT_FIELD),
        _POWER_BITS * (1023 - 160),
        _POWER_BITS * (1023 + 128),
    )
    # count <= 2**log_count, so count integers below 2**(52 - log_count) sum exactly.
    log_count = tf.cast(
        tf.math.ceil(tf.math.log(tf.cast(tf.maximum(count, 1), tf.float64)) / _LN2),
        tf.int64,
    )
    # Grids q1 = 2**(e + 1 + log_count - 52) and q2 = 2**(e + 2 * log_count - 104), e
    # the exponent of biggest, and their inverses: powers of two, so scaling by them is
    # exact; built by adding to the exponent field (2**-k has field 2046 - field(2**k)).
    q1_bits = unit + _POWER_BITS * (1 + log_count - 52)
    q2_bits = unit + _POWER_BITS * (2 * log_count - 104)
    q1, q2 = tf.bitcast(q1_bits, tf.float64), tf.bitcast(q2_bits, tf.float64)
    inverse1 = tf.bitcast(_POWER_BITS * 2046 - q1_bits, tf.float64)
    inverse2 = tf.bitcast(_POWER_BITS * 2046 - q2_bits, tf.float64)
    sum1, sum2 = [], []
    for x in xs:
        n1 = tf.round(x * inverse1)  # |n1| <= 2**(52 - log_count)
        sum1.append(n1)
        sum2.append(tf.round((x - n1 * q1) * inverse2))  # exact remainder; same bound
    # Exact whatever the order: integers below 2**53.
    total1 = tf.reduce_sum(tf.add_n(sum1), axis=0)
    total2 = tf.reduce_sum(tf.add_n(sum2), axis=0)
    return tf.where(tf.math.is_finite(total1), total1 * q1 + total2 * q2, total1)


# ---------------------------------------------------------------------- helpers


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
        index=index,
        name=name,
        shape=dims,
        size=int(np.prod(dims, dtype=np.int64)),
        offset=offset,
        dtype=dtype,
        guard=guard if isinstance(guard, Guard) else None,
    )


def _replica_context() -> tf.distribute.ReplicaContext | None:
    """The replica context of a non-default strategy's ``run``, else None."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    return tf.distribute.get_replica_context()


def _as_tensors(parts: list[_Part]) -> list[tuple]:
    """Eager parts as tensors, to pass to a ``tf.function`` (Python values would make
    it retrace for every new version number)."""
    out = []
    for part in parts:
        finite = (
            part.finite if isinstance(part.finite, tf.Tensor) else tf.constant(bool(part.finite))
        )
        version = part.version
        if part.version_kind == "int":
            version = tf.constant(version, tf.int64)
        elif part.version_kind == "each":
            version = tuple(tf.constant(v, tf.int64) for v in version)
        out.append((part.elements, part.values, finite, part.version_kind, version))
    return out


def _state_device(first: Any) -> str:
    """Where the state lives: with the first variable, or on a parameter server.

    Under ``ParameterServerStrategy`` (created in its scope, or for variables on a
    parameter server) the state must be where every worker reaches it: the first
    variable's parameter server, else ``/job:ps/task:0``.
    """
    device = getattr(first, "device", "") or ""
    if on_parameter_server(device):
        return device
    if tf.distribute.has_strategy() and is_parameter_server(tf.distribute.get_strategy()):
        return "/job:ps/replica:0/task:0/device:CPU:0"
    return device


def _spans_workers(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether some of ``strategy``'s replicas run in other processes (multi-worker)."""
    if strategy is None:
        return False
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def _holds_distributed(*structures: Any) -> bool:
    return any(
        isinstance(x, tf.distribute.DistributedValues)
        for structure in structures
        for x in tf.nest.flatten(structure)
    )


def _per_replica(gradients: Any) -> list[Any]:
    """Splits a structure holding PerReplica leaves into one structure per replica."""
    leaves = tf.nest.flatten(gradients)
    distributed = [x for x in leaves if isinstance(x, tf.distribute.DistributedValues)]
    if not distributed:
        return [gradients]
    replicas = len(distributed[0].values)
    per_leaf = [_local_values(x, replicas) for x in leaves]
    return [
        tf.nest.pack_sequence_as(gradients, [leaf[r] for leaf in per_leaf])
        for r in range(replicas)
    ]


def _local_values(value: Any, replicas: int) -> list[Any]:
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    if isinstance(value, tuple) and not isinstance(value, tf.Tensor):
        fields = [_local_values(v, replicas) for v in value]
        return [tuple(f[r] for f in fields) for r in range(replicas)]
    return [value] * replicas


def _sparse_slot(entries: tuple, position: int) -> int:
    """Index of the slot holding the ``position``-th sparse entry."""
    sparse = [i for i, e in enumerate(entries) if e is not None and e[0] == "sparse"]
    return sparse[position]


def _after(check: Any, tensors: tuple) -> tuple:
    with tf.control_dependencies([check]):
        return tuple(None if t is None else tf.identity(t) for t in tensors)


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


def _concat(tensors: list[tf.Tensor]) -> tf.Tensor:
    return tensors[0] if len(tensors) == 1 else tf.concat(tensors, 0)
