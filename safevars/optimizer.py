"""SafeOptimizer: any Keras 3 optimizer with atomic, versioned, staleness-aware updates.

The problem: a Keras optimizer's ``apply_gradients`` is many separate operations (read
a slot, compute, write the slot, write the variable, add 1 to ``iterations``). Called
from several threads, asynchronous workers or concurrently running ``tf.function`` s, the
steps interleave: Adam's moments and SGD's momentum are read by one step and overwritten
by another (lost updates), ``iterations`` no longer matches the moments it bias-corrects,
and gradients computed from parameters that have since moved are applied as if fresh.

The fix: :class:`SafeOptimizer` wraps the optimizer you already use (as Keras'
``LossScaleOptimizer`` does) and runs each ``apply_gradients`` call as **one critical
section** over every variable it updates *and* the optimizer's own state (slots,
``iterations``, learning-rate variable, counters):

* eagerly, it holds the variables' safevars locks (:func:`safevars.locking.hold`; a plain
  ``tf.Variable`` or ``keras.Variable`` gets its lock from :func:`safevars.wrap`) plus one
  lock for the optimizer state, all in safevars' global lock order;
* inside a ``tf.function`` (``model.fit``, custom loops, ``strategy.run``) it traces the
  update inside the same guards' ``tf.CriticalSection`` s
  (:func:`safevars.locking.graph_section`), so the exclusion holds when the graph runs,
  across threads, concurrent graph executions and eager callers;
* each call adds exactly 1 to the version of every variable it wrote (the version a
  :class:`~safevars.SafeVariable` reports, or ``safevars.wrap(v).version``).

On top of the section it offers what the section makes cheap: a staleness policy
(``max_staleness`` with ``on_stale="drop" | "raise" | "scale"``), gradient accumulation
(``accumulate_steps``) and an opt-in non-finite policy, with every decision counted in
:meth:`SafeOptimizer.statistics`.

Under ``tf.distribute`` (create the inner optimizer and the SafeOptimizer inside
``strategy.scope()``; anything else is refused with an error naming the fix):

* ``MirroredStrategy`` / ``OneDeviceStrategy``: inside ``strategy.run`` the gradients
  are summed across replicas (as Keras does) and the section runs once per step, in
  cross-replica context, over every replica's copy.
* ``MultiWorkerMirroredStrategy``: the same on every worker; the gradients are
  all-reduced across the workers first, so every worker applies the same update to its
  own copies and the workers' weights, versions and counters agree.
* ``ParameterServerStrategy`` (TF2, with ``ClusterCoordinator``): the variables, slots,
  ``iterations`` and counters live on the parameter servers, and the guards place their
  ``tf.CriticalSection`` s there, so one ``apply_gradients`` of a scheduled function is
  one critical section on the parameter server: concurrent workers lose no update, and
  ``statistics()`` counts every worker's calls. An eager call on the coordinator runs the
  same section inside a ``tf.function`` (see :meth:`SafeOptimizer.apply_gradients`).
  ``ShardedVariable`` s (a ``variable_partitioner``) are refused. Keras 3's
  ``model.fit`` does not support ParameterServerStrategy; use a custom loop.

NOTES:
  What is *not* guaranteed:

  * Writes that bypass safevars (another optimizer on the same variables, or
    ``layer.kernel.assign(...)`` on a plain Keras variable) are neither locked nor
    counted. Wrap a variable (:func:`safevars.wrap`) and write through the wrapper, or use
    ``safevars.locked``, for code outside the optimizer.
  * Computing the gradient is *not* part of the section (that would serialize the
    forward and backward passes). A gradient may therefore be computed from parameters
    that another thread updates before it is applied: that is what ``version=`` and
    ``max_staleness`` are for.
  * An error the validation cannot foresee (a kernel failing half-way through the
    update) leaves the update half done, as it does with the plain optimizer. Every
    mistake that can be checked before the update starts (unknown variable, shape,
    dtype, versions, staleness, non-finite values) is checked first and changes nothing.
  * XLA-compiled functions (``jit_compile=True``) cannot hold a ``tf.CriticalSection``;
    SafeOptimizer refuses to trace there (``model.compile(..., jit_compile=False)``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras.src.utils import tracking
from tensorflow.python.distribute import distribute_lib, sharded_variable
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from safevars.distribute import is_parameter_server
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
    StaleGradientError,
    UnsupportedStrategyError,
)
from safevars.locking import Guard, graph_section, hold
from safevars.snapshot import Snapshot
from safevars.variable import SafeVariable, wrap

__all__ = ["OptimizerStatistics", "SafeOptimizer"]

ON_STALE_POLICIES = ("drop", "raise", "scale")
NONFINITE_POLICIES = (None, "skip", "raise")

# Order of the counters in the int64 statistics variable.
_COUNTERS = (
    "calls",
    "applied",
    "accumulated",
    "dropped_stale",
    "scaled_stale",
    "skipped_nonfinite",
)


# Eager constant deltas of the counters, by value (a handful of combinations).
_DELTAS: dict[tuple[int, ...], tf.Tensor] = {}


class OptimizerStatistics(NamedTuple):
    """A frozen record of what a :class:`SafeOptimizer` did, for debugging and tests.

    Attributes:
      calls: ``apply_gradients`` / ``apply`` calls that completed (a call refused with an
        error is not counted, because it changed nothing).
      applied: Real updates: calls of the inner optimizer. With ``accumulate_steps=k``,
        one per k accumulated calls. Equals the inner optimizer's ``iterations`` unless
        the inner optimizer was stepped outside this wrapper or restored differently.
      accumulated: Gradients added to the accumulator (``accumulate_steps > 1``).
      pending: Gradients in the accumulator now, waiting for the next real update.
      dropped_stale: Calls dropped because their gradients were too stale
        (``on_stale="drop"``).
      scaled_stale: Calls whose gradients were scaled down for staleness
        (``on_stale="scale"``).
      skipped_nonfinite: Calls skipped because a gradient held NaN or Inf
        (``nonfinite="skip"``).
    """

    calls: int
    applied: int
    accumulated: int
    pending: int
    dropped_stale: int
    scaled_stale: int
    skipped_nonfinite: int


# --------------------------------------------------------------------------- merge calls
#
# Under MirroredStrategy the section runs in cross-replica context (in the merge_call
# that every Keras optimizer uses for its update anyway), so that one section covers the
# update of every replica's copy. Keras' TensorFlow optimizer reaches the update through
# ``maybe_merge_call``, which assumes a replica context and fails in cross-replica
# context, where no merge is needed. While this module calls the inner optimizer from
# cross-replica context, the calling thread tells the strategy that merge calls are not
# needed, so ``maybe_merge_call`` calls its function directly. Other threads are not
# affected.

_direct = threading.local()
_install_lock = threading.Lock()


def _allow_direct_merge_calls(strategy: tf.distribute.Strategy) -> None:
    """Makes ``strategy`` skip merge calls in threads inside :func:`_direct_merge_calls`."""
    extended = strategy.extended
    if getattr(extended, "_safevars_direct_merge", False):
        return
    with _install_lock:
        if getattr(extended, "_safevars_direct_merge", False):
            return
        original = extended._use_merge_call

        def _use_merge_call() -> bool:
            if getattr(_direct, "depth", 0):
                return False
            return original()

        extended._use_merge_call = _use_merge_call
        extended._safevars_direct_merge = True


@contextlib.contextmanager
def _direct_merge_calls(strategy: tf.distribute.Strategy | None) -> Iterator[None]:
    if strategy is None:
        yield
        return
    _allow_direct_merge_calls(strategy)
    _direct.depth = getattr(_direct, "depth", 0) + 1
    try:
        yield
    finally:
        _direct.depth -= 1


_SUPPORTED_STRATEGIES = (
    tf.distribute.OneDeviceStrategy,
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.ParameterServerStrategy,
)
_SUPPORTED_NAMES = (
    "no strategy (the default), tf.distribute.OneDeviceStrategy, "
    "tf.distribute.MirroredStrategy (one machine, any number of devices), "
    "tf.distribute.MultiWorkerMirroredStrategy (processes configured by TF_CONFIG) and "
    "tf.distribute.experimental.ParameterServerStrategy (TF2, driven by "
    "ClusterCoordinator)"
)


def _current_strategy() -> tf.distribute.Strategy | None:
    """The strategy in scope, or ``None`` for the default one; refuses unsupported ones."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, _SUPPORTED_STRATEGIES):
        raise UnsupportedStrategyError(
            f"SafeOptimizer does not support {type(strategy).__name__}. Supported: "
            f"{_SUPPORTED_NAMES}."
        )
    return strategy


def _local(value: Any) -> Any:
    """The first replica's component of a distributed value (values that are equal)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return value


def _oldest(value: Any) -> Any:
    """The smallest replica's version of a distributed version (largest staleness)."""
    if isinstance(value, tf.distribute.DistributedValues):
        parts = tf.distribute.get_strategy().experimental_local_results(value)
        return tf.reduce_min(tf.stack([tf.cast(p, tf.int64) for p in parts]))
    return value


# --------------------------------------------------------------------------- one call


class _Step(NamedTuple):
    """One validated call: non-``None`` gradients and what they update."""

    grads: list[Any]
    variables: list[Any]  # as given (keras.Variable, tf.Variable or SafeVariable)
    inner_variables: list[Any]  # what the inner optimizer is called with
    guards: list[Guard]
    # None, ("global", v) with v compared to ``iterations``, or ("each", [v or None]).
    versions: tuple[str, Any] | None


class _Runtime:
    """Python-side state of a SafeOptimizer, kept out of Keras/TF attribute tracking."""

    __slots__ = (
        "build_lock", "guards", "state_guard", "accumulator", "accumulated_set",
        "coordinator_fns",
    )

    def __init__(self) -> None:
        self.build_lock = threading.Lock()
        self.guards: list[Guard] = []
        self.state_guard: Guard | None = None
        self.accumulator: Any = None
        # With accumulate_steps > 1: the variable indices every call must give gradients for.
        self.accumulated_set: frozenset[int] | None = None
        # Under ParameterServerStrategy: the tf.functions that eager calls on the
        # coordinator run instead of taking the parameter servers' mutexes eagerly.
        self.coordinator_fns: dict[Any, Callable[..., Any]] = {}


@keras.saving.register_keras_serializable(package="safevars", name="SafeOptimizer")
class SafeOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that each update is atomic, versioned and checked.

    Use it wherever the optimizer goes::

        model.compile(optimizer=safevars.SafeOptimizer(keras.optimizers.Adam(1e-3)), ...)
        model.fit(...)

        opt = safevars.SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        opt.apply_gradients(zip(grads, model.trainable_variables))   # from any thread

    The inner optimizer does the arithmetic, so results are those of the inner optimizer
    (bitwise, for one thread). The wrapper adds the critical section, versions,
    staleness and non-finite policies, accumulation and counters. Model variables may be
    ``keras.Variable`` s, plain ``tf.Variable`` s or :class:`~safevars.SafeVariable` s.

    Args:
      optimizer: The Keras optimizer to wrap (an instance, or an identifier such as
        ``"adam"`` for ``keras.optimizers.get``). It must not be built on other
        variables, use its own ``gradient_accumulation_steps`` (use
        ``accumulate_steps``) or be another SafeOptimizer.
      accumulate_steps: k >= 1. With k > 1, the gradients of k calls are averaged (with
        :class:`safevars.GradientAccumulator`) and applied once, by one call of the inner
        optimizer: ``iterations``, the learning-rate schedule, weight decay and Adam's
        bias correction advance once per real update, not per call.
      max_staleness: ``None`` (no check) or an int >= 0: calls whose gradients were
        computed from parameters more than this many updates old are handled by
        ``on_stale``. Staleness is measured only for calls given ``version=``.
      on_stale: ``"drop"`` (skip the call, count it), ``"raise"``
        (:class:`~safevars.StaleGradientError`, nothing changes) or ``"scale"`` (multiply
        the gradients by ``1 / (staleness + 1)``, Zhang et al., "Staleness-aware
        Async-SGD", 2016), as in :class:`~safevars.GradientAccumulator`.
      nonfinite: ``None`` (default, no check, as Keras), ``"skip"`` (a call with a NaN or
        Inf gradient changes nothing but the ``skipped_nonfinite`` count) or ``"raise"``
        (:class:`~safevars.NonFiniteGradientError`).
      deterministic: With ``accumulate_steps > 1``: accumulate exactly, so the mean is
        bitwise the same whatever order concurrent calls arrive in, at 80 bytes of state
        per model parameter (see :class:`~safevars.GradientAccumulator`); False keeps a
        float32 running sum (4 bytes per parameter, order-dependent in its last bits).
        float64 variables always use the float sum. Unused when ``accumulate_steps=1``.
      name: Optional name.

    Raises:
      InvalidArgumentError: an argument is out of range or ``optimizer`` is unusable.

    Mixed precision: ``LossScaleOptimizer(SafeOptimizer(...))`` is the supported order,
    and the one ``model.compile`` builds by itself under a ``mixed_float16`` policy: the
    loss-scale optimizer skips non-finite steps before they reach the section, and the
    section covers the inner update. ``SafeOptimizer(LossScaleOptimizer(...))`` works in
    custom loops without a strategy (call ``scale_loss`` on the SafeOptimizer); under
    ``model.compile`` it needs ``auto_scale_loss=False`` (Keras would wrap it once more),
    and under ``MirroredStrategy`` it is refused.

    Saving: registered as ``"safevars>SafeOptimizer"``; ``model.save("m.keras")`` and
    ``keras.models.load_model`` round-trip it (the inner optimizer is serialized in its
    config, all optimizer variables are saved) once ``safevars`` is imported. It is
    trackable, so ``tf.train.Checkpoint(optimizer=...)`` saves the inner optimizer's
    slots, ``iterations``, the counters and pending accumulated gradients.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer | str,
        *,
        accumulate_steps: int = 1,
        max_staleness: int | None = None,
        on_stale: str = "drop",
        nonfinite: str | None = None,
        deterministic: bool = True,
        name: str | None = None,
        **kwargs: Any,
    ) -> None:
        inner = _inner_optimizer(optimizer)
        _check_int(accumulate_steps, "accumulate_steps", minimum=1)
        if max_staleness is not None:
            _check_int(max_staleness, "max_staleness", minimum=0)
        if on_stale not in ON_STALE_POLICIES:
            raise InvalidArgumentError(
                f"on_stale must be one of {ON_STALE_POLICIES}, got {on_stale!r}."
            )
        if nonfinite not in NONFINITE_POLICIES:
            raise InvalidArgumentError(
                f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}."
            )
        if not isinstance(deterministic, bool):
            raise InvalidArgumentError(
                f"deterministic must be True or False, got {_short(deterministic)}."
            )
        _reject_base_kwargs(kwargs)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = inner
        self.accumulate_steps = int(accumulate_steps)
        self.max_staleness = None if max_staleness is None else int(max_staleness)
        self.on_stale = on_stale
        self.nonfinite = nonfinite
        self.deterministic = deterministic
        self._statistics = self.add_variable(
            shape=(len(_COUNTERS),),
            dtype="int64",
            initializer="zeros",
            aggregation="only_first_replica",
            name="safevars_statistics",
        )
        self._safevars = _Runtime()

    # ------------------------------------------------------------------ delegation

    @property
    def variables(self) -> list[Any]:
        """This wrapper's variables (counters) followed by the inner optimizer's."""
        own = self._variables[:]
        accumulator = self._safevars.accumulator
        if accumulator is not None:
            own += list(accumulator.variables)
        return own + self.inner_optimizer.variables

    @property
    def iterations(self) -> Any:
        """The inner optimizer's ``iterations``: real updates applied."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> Any:
        """The inner optimizer's learning rate (settable, as on the inner optimizer)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss: Any) -> Any:
        """The inner optimizer's ``scale_loss`` (its ``loss_scale_factor``, if any)."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """The inner optimizer's ``finalize_variable_values`` (EMA), under the locks.

        Thread safety: with ``use_ema`` on the inner optimizer, atomic with respect to
        ``apply_gradients`` (eager only); without EMA it writes nothing.

        Modes: Keras calls it eagerly at the end of ``fit``.
        """
        runtime = self._safevars
        variables = [_for_inner(v) for v in var_list]
        if (
            self.inner_optimizer.use_ema
            and tf.executing_eagerly()
            and runtime.state_guard is not None
        ):
            with hold(runtime.guards + [runtime.state_guard]):
                self.inner_optimizer.finalize_variable_values(variables)
        else:
            self.inner_optimizer.finalize_variable_values(variables)

    # ------------------------------------------------------------------ build

    @tracking.no_automatic_dependency_tracking
    def build(self, variables: Sequence[Any]) -> None:
        """Builds the inner optimizer's slots and this wrapper's locks for ``variables``.

        Args:
          variables: The trainable variables (``keras.Variable``, ``tf.Variable`` or
            SafeVariable) every later call may update.

        Raises:
          InvalidArgumentError: an entry is not a variable.

        Thread safety: idempotent and safe to call from several threads; the first call
        builds.

        Modes: eager or while tracing (variables are created in the init scope).
        """
        variables = list(variables)
        for index, variable in enumerate(variables):
            _check_variable(variable, f"variables[{index}]")
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.state_guard is not None:
                return
            inner = self.inner_optimizer
            if inner.built:
                known = inner._trainable_variables_indices
                unknown = [
                    _name(v) for v in variables if inner._var_key(_for_inner(v)) not in known
                ]
                if unknown:
                    raise InvalidArgumentError(
                        f"The wrapped optimizer is already built on other variables; "
                        f"{unknown} are not among them. Wrap an unbuilt optimizer."
                    )
            else:
                inner.build([_for_inner(v) for v in variables])
            runtime.guards = [wrap(v).guard for v in variables]
            # Created after the variables' guards, so it sorts after them in lock order.
            state_guard = wrap(self._statistics).guard
            if self.accumulate_steps > 1:
                accumulator = _make_accumulator(
                    variables, self.accumulate_steps, self.deterministic, self.name
                )
                # Checkpoints and model.save() keep the pending gradients.
                self._track_trackable(accumulator, name="safevars_accumulator")
                runtime.accumulator = accumulator
            super().build(variables)
            # Set last: other threads treat the optimizer as built once it is set.
            runtime.state_guard = state_guard

    # ------------------------------------------------------------------ updates

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, Any]], *, version: Any = None
    ) -> Any:
        """Applies ``(gradient, variable)`` pairs as one atomic, versioned update.

        Args:
          grads_and_vars: Pairs of a gradient (tensor, ``tf.IndexedSlices`` or ``None``,
            which skips that variable) and a variable the optimizer was built with (the
            first call builds it, as in Keras).
          version: What the gradients were computed from, to measure staleness with
            ``max_staleness``: an int (the value of :attr:`iterations` when the
            parameters were read), or a list with one entry per pair, each a version
            (``v.version`` of a SafeVariable, ``safevars.wrap(v).version``), a
            :class:`~safevars.Snapshot` or ``None``. Staleness is the number of updates
            since (the largest over the listed variables). Ignored without
            ``max_staleness``.

        Returns:
          The inner optimizer's ``iterations`` variable (as Keras returns its own).

        Raises:
          InvalidArgumentError: a pair is malformed, a variable is unknown or listed
            twice, no gradient is given, ``version`` is malformed or from the future,
            or the optimizer was created outside the scope of the strategy it is called
            under.
          ShapeMismatchError: a gradient's shape does not match its variable's.
          DTypeMismatchError: a gradient is not a floating-point tensor.
          StaleGradientError: ``on_stale="raise"`` and the gradients are too stale.
          NonFiniteGradientError: ``nonfinite="raise"`` and a gradient holds NaN/Inf.
          UnsupportedStrategyError: called under an unsupported ``tf.distribute``
            strategy (the message names the supported ones), or with a
            ``ShardedVariable``. Each of these is raised before anything changes:
            variables, slots, ``iterations``, versions and counters are as they were.

        Thread safety: the whole update (every variable, every slot, ``iterations``, the
        counters and the pending accumulation) is one critical section: concurrent calls
        from any threads, graphs or eager code never interleave, and each call adds
        exactly 1 to the version of each variable it wrote (none when the call is
        dropped, skipped or only accumulated).

        Modes: eagerly under the safevars locks. In a ``tf.function`` inside the
        guards' ``tf.CriticalSection`` s (policies become ``tf.cond`` s; ``"raise"``
        policies become run-time assertions that fail with
        ``tf.errors.InvalidArgumentError`` before anything is written). Inside
        ``strategy.run`` (Mirrored and MultiWorkerMirrored strategies) the gradients are
        summed across replicas (and workers) as Keras does and the section runs once, in
        cross-replica context, for all local replicas. Under ParameterServerStrategy a
        scheduled function may call it inside ``strategy.run`` or directly; the section
        is on the parameter server. Read ``version`` before the forward pass, so the
        gradients are computed from parameters at least that new::

            version = tf.convert_to_tensor(optimizer.iterations)
            with tf.control_dependencies([version]), tf.GradientTape() as tape:
                loss = ...
            optimizer.apply_gradients(zip(tape.gradient(loss, vs), vs), version=version)

        An eager call on the parameter-server coordinator runs the section inside a
        ``tf.function`` traced once per set of variables (an eager lock on a parameter
        server would deadlock with the scheduled functions waiting for it); the
        ``"raise"`` policies still raise :class:`~safevars.StaleGradientError` and
        :class:`~safevars.NonFiniteGradientError` there.
        """
        pairs = list(grads_and_vars)
        for index, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidArgumentError(
                    f"grads_and_vars[{index}] must be a (gradient, variable) pair, got "
                    f"{_short(pair)}. Pass zip(gradients, variables)."
                )
        if not pairs:
            return self.iterations
        grads = [p[0] for p in pairs]
        variables = [p[1] for p in pairs]
        self._apply(grads, variables, version, "grads_and_vars[{}]")
        return self.iterations

    def apply(
        self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None,
        *, version: Any = None,
    ) -> None:
        """Keras' ``apply``: ``grads`` for ``trainable_variables`` (default: all built).

        See :meth:`apply_gradients` for ``version``, errors, thread safety and modes.
        """
        grads = list(grads)
        if trainable_variables is None:
            if self._safevars.state_guard is None:
                raise InvalidArgumentError(
                    "apply(grads) without trainable_variables needs a built optimizer: "
                    "call build(variables) first or pass trainable_variables."
                )
            trainable_variables = list(self._trainable_variables)
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise InvalidArgumentError(
                f"grads has {len(grads)} entries but trainable_variables has "
                f"{len(trainable_variables)}; they must match one to one."
            )
        if not grads:
            return
        self._apply(grads, trainable_variables, version, "grads[{}]")

    def _apply(
        self, grads: list[Any], variables: list[Any], version: Any, where: str
    ) -> None:
        if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(
            ops.get_default_graph()
        ):
            raise InvalidArgumentError(
                "SafeOptimizer cannot run inside an XLA-compiled function "
                "(jit_compile=True): its critical sections are not XLA operations. "
                "Use model.compile(..., jit_compile=False) or tf.function(jit_compile="
                "False)."
            )
        strategy = _current_strategy()
        self._check_created_under(strategy)
        if strategy is not None and isinstance(
            self.inner_optimizer, keras.optimizers.LossScaleOptimizer
        ):
            raise UnsupportedStrategyError(
                "SafeOptimizer(LossScaleOptimizer(...)) cannot run under a tf.distribute "
                "strategy (the loss-scale optimizer must run in replica context, the "
                "section runs in cross-replica context). Wrap the other way round: "
                "LossScaleOptimizer(SafeOptimizer(...)), which model.compile builds "
                "itself under a mixed_float16 policy."
            )
        step = self._validate(grads, variables, version, where)
        if strategy is not None and not tf.distribute.in_cross_replica_context():
            self._merge_into_cross_replica(step)
        elif tf.executing_eagerly() and self._on_parameter_servers():
            self._section_on_coordinator(step, strategy)
        else:
            self._section(step, strategy)

    def _check_created_under(self, strategy: tf.distribute.Strategy | None) -> None:
        """Refuses a call under a strategy other than the one that created the state.

        Keras optimizers create their slots, ``iterations`` and (here) the counters with
        the strategy current at construction; used under another strategy they would
        update variables that strategy does not own (Keras fails deep inside with
        "Must not nest tf.distribute.Strategy scopes").
        """
        if strategy is None:
            return
        owners = ((self, "SafeOptimizer"), (self.inner_optimizer, "its inner optimizer"))
        for owner, what in owners:
            created = getattr(owner, "_distribution_strategy", None)
            if created is None or created is strategy:
                continue
            under = (
                "outside any strategy scope"
                if isinstance(created, distribute_lib._DefaultDistributionStrategy)
                else f"under another {type(created).__name__}"
            )
            raise InvalidArgumentError(
                f"SafeOptimizer is called under {type(strategy).__name__} but {what} was "
                f"created {under}, so its state (slots, iterations, counters) does not "
                "belong to this strategy. Create the inner optimizer and the "
                "SafeOptimizer inside `with strategy.scope():` (the scope the model's "
                "variables are created in)."
            )

    def _on_parameter_servers(self) -> bool:
        """Whether this optimizer's state lives on parameter servers (created under PS)."""
        return is_parameter_server(getattr(self, "_distribution_strategy", None))

    def _coordinator_function(
        self, key: Any, make: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """The cached ``tf.function`` ``make()`` for ``key`` (built once, thread-safely)."""
        runtime = self._safevars
        fn = runtime.coordinator_fns.get(key)
        if fn is None:
            with runtime.build_lock:
                fn = runtime.coordinator_fns.get(key)
                if fn is None:
                    fn = tf.function(make(), autograph=False)
                    runtime.coordinator_fns[key] = fn
        return fn

    def _section_on_coordinator(
        self, step: _Step, strategy: tf.distribute.Strategy | None
    ) -> None:
        """An eager call under ParameterServerStrategy: the same section, in a graph.

        Taking a parameter server's mutex with an eager ``MutexLock`` from the
        coordinator while scheduled functions use the same mutex deadlocks (observed
        with TensorFlow 2.21: neither the eager op nor the workers' steps return). So
        the coordinator runs :meth:`_section` inside a
        ``tf.function`` (traced once per set of variables), where the lock is taken by
        the critical-section ops on the parameter server, as in scheduled functions.
        Errors keep their eager types: the run-time assertions of the ``"raise"``
        policies are raised as :class:`~safevars.StaleGradientError` and
        :class:`~safevars.NonFiniteGradientError`.
        """
        self._refuse_future_versions(step)
        positions = tuple(self._get_variable_index(v) for v in step.variables)
        versions: Any = None
        shape: Any = None
        if step.versions is not None:
            kind, value = step.versions
            if kind == "global":
                versions, shape = tf.constant(value, tf.int64), "global"
            else:
                versions = [None if v is None else tf.constant(v, tf.int64) for v in value]
                shape = ("each", tuple(v is None for v in value))
        key = ("apply", positions, shape, strategy is not None)
        template = step

        def make() -> Callable[..., Any]:
            def run(grads: list[Any], versions: Any) -> None:
                rebuilt = None
                if versions is not None:
                    rebuilt = (template.versions[0], versions)
                rebuilt_step = template._replace(grads=list(grads), versions=rebuilt)
                self._section(rebuilt_step, strategy)

            return run

        fn = self._coordinator_function(key, make)
        try:
            fn(list(step.grads), versions)
        except tf.errors.InvalidArgumentError as e:
            if "safevars StaleGradientError" in e.message:
                raise StaleGradientError(
                    f"The gradients are more than max_staleness={self.max_staleness} "
                    "updates stale; nothing was applied. Recompute them from the current "
                    "parameters, or use on_stale='drop' or 'scale'."
                ) from None
            if "safevars NonFiniteGradientError" in e.message:
                raise NonFiniteGradientError(
                    "A gradient holds NaN or Inf and nonfinite='raise'; nothing was "
                    "applied. Use nonfinite='skip' to skip such steps."
                ) from None
            raise

    def _refuse_future_versions(self, step: _Step) -> None:
        """Eager check that no given version is ahead of the current state.

        Versions only grow, so a version ahead of the state read now was not read before
        the gradients were computed (the section itself, in a graph, clamps at 0).
        """
        if self.max_staleness is None or step.versions is None:
            return
        kind, given = step.versions
        if kind == "global":
            pairs = [(int(_numpy(self.inner_optimizer.iterations)), given)]
        else:
            pairs = [
                (int(guard.version()), value)
                for guard, value in zip(step.guards, given)
                if value is not None
            ]
        for current, value in pairs:
            if int(value) > current:
                raise InvalidArgumentError(
                    f"version is {int(value) - current} update(s) ahead of the current "
                    "state: it must be a version read before the gradients were computed "
                    "(optimizer.iterations, v.version or a snapshot)."
                )

    def _merge_into_cross_replica(self, step: _Step) -> None:
        """Sums the gradients over replicas (as Keras does), then runs the section once."""
        context = tf.distribute.get_replica_context()
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, step.grads)
        versions = step.versions
        packed: Any = None
        if versions is not None:
            kind, value = versions
            if kind == "global":
                packed = tf.cast(value, tf.int64)
            else:
                packed = [None if v is None else tf.cast(v, tf.int64) for v in value]

        def merged(strategy: tf.distribute.Strategy, grads: Any, versions: Any) -> None:
            grads = [_local(g) for g in grads]
            if versions is not None:
                if step.versions[0] == "global":
                    versions = ("global", _oldest(versions))
                else:
                    versions = ("each", [None if v is None else _oldest(v) for v in versions])
            self._section(step._replace(grads=grads, versions=versions), strategy)

        context.merge_call(merged, args=(reduced, packed))

    # ------------------------------------------------------------------ the section

    def _section(self, step: _Step, strategy: tf.distribute.Strategy | None) -> None:
        runtime = self._safevars
        guards = list(step.guards) + [runtime.state_guard]
        if self.inner_optimizer.use_ema:
            guards += runtime.guards  # EMA may overwrite every model variable.

        def body() -> None:
            self._locked_step(step, strategy)

        if tf.executing_eagerly():
            with hold(guards):
                body()
        else:
            graph_section(guards, body, after=step.grads)

    def _locked_step(self, step: _Step, strategy: tf.distribute.Strategy | None) -> None:
        """Everything one call does, with every lock held (one trace-safe path).

        Decisions are Python values eagerly and tensors in a graph (``_branch`` and
        ``_refuse`` turn them into ``tf.cond`` and assertions there). Every check runs
        before anything is written; the counters are written last.
        """
        counts: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        counts["calls"] = 1
        grads = step.grads
        keep: Any = True
        checks: list[Any] = []
        if self.max_staleness is not None and step.versions is not None:
            staleness = self._staleness(step)
            stale = staleness > self.max_staleness
            if self.on_stale == "raise":
                checks.append(_refuse(
                    stale,
                    lambda: StaleGradientError(
                        f"The gradients are {int(staleness)} updates stale, more than "
                        f"max_staleness={self.max_staleness}; nothing was applied. "
                        "Recompute them from the current parameters, or use "
                        "on_stale='drop' or 'scale'."
                    ),
                    "safevars StaleGradientError: the gradients are more than "
                    "max_staleness updates stale; nothing was applied.",
                ))
            elif self.on_stale == "drop":
                keep = _logical_not(stale)
                counts["dropped_stale"] = stale
            else:
                factor = _where(stale, 1.0 / (_to_float(staleness) + 1.0), 1.0)
                grads = [_scale(g, factor) for g in grads]
                counts["scaled_stale"] = stale
        if self.nonfinite is not None:
            finite = _all_finite(grads)
            if self.nonfinite == "raise":
                checks.append(_refuse(
                    _logical_not(finite),
                    lambda: NonFiniteGradientError(
                        "A gradient holds NaN or Inf and nonfinite='raise'; nothing was "
                        "applied. Use nonfinite='skip' to skip such steps, or a "
                        "LossScaleOptimizer for mixed precision."
                    ),
                    "safevars NonFiniteGradientError: a gradient holds NaN or Inf; "
                    "nothing was applied.",
                ))
            else:
                counts["skipped_nonfinite"] = _logical_and(keep, _logical_not(finite))
                keep = _logical_and(keep, finite)
        with tf.control_dependencies([c for c in checks if c is not None]):
            applied, accumulated = _branch(
                keep,
                lambda: self._update(step, grads, strategy),
                lambda: (_zero(), _zero()),
            )
            counts["applied"] = applied
            counts["accumulated"] = accumulated
            self._count(counts)

    def _update(
        self, step: _Step, grads: list[Any], strategy: tf.distribute.Strategy | None
    ) -> tuple[Any, Any]:
        """Accumulates or applies; returns (applied, accumulated) as 0/1."""
        if self.accumulate_steps == 1:
            self._apply_inner(step, grads, strategy)
            return _one(), _zero()
        accumulator = self._safevars.accumulator
        positions = [self._get_variable_index(v) for v in step.variables]
        full: list[Any] = [None] * len(self._safevars.guards)
        for grad, position in zip(grads, positions):
            full[position] = grad
        # Our section holds the optimizer's state lock, so no other call adds or takes
        # between these two atomic accumulator operations.
        accumulator.add(full)
        ready, mean = accumulator.take_if_ready()

        def apply_mean() -> Any:
            self._apply_inner(step, [mean[p] for p in positions], strategy)
            return _one()

        applied = _branch(ready, apply_mean, _zero)
        return applied, _one()

    def _apply_inner(
        self, step: _Step, grads: list[Any], strategy: tf.distribute.Strategy | None
    ) -> None:
        """Calls the inner optimizer and adds 1 to each written variable's version."""
        eager = tf.executing_eagerly()
        graph = None if eager else ops.get_default_graph()
        existing = None if eager else set(graph.get_operations())
        with _direct_merge_calls(strategy):
            self.inner_optimizer.apply(grads, step.inner_variables)
        if eager:
            for guard in step.guards:
                guard.bump_eager()
            return
        created = [op for op in graph.get_operations() if op not in existing]
        with tf.control_dependencies(created):
            written = tf.no_op(name="safevars_update_done")
        for guard in step.guards:
            guard.bump_graph(written)

    def _count(self, counts: dict[str, Any]) -> None:
        values = [counts[name] for name in _COUNTERS]
        if all(isinstance(v, (int, bool, np.bool_)) for v in values):
            key = tuple(int(v) for v in values)
            delta = _DELTAS.get(key) if tf.executing_eagerly() else None
            if delta is None:
                delta = tf.constant(key, tf.int64)
                if tf.executing_eagerly():
                    _DELTAS[key] = delta
        else:
            delta = tf.stack([tf.cast(v, tf.int64) for v in values])
        variable = self._statistics.value
        guard = self._safevars.state_guard
        if tf.executing_eagerly():
            variable.assign_add(delta, read_value=False)
            guard.bump_eager()
        else:
            guard.bump_graph(variable.assign_add(delta, read_value=False))

    def _staleness(self, step: _Step) -> Any:
        kind, given = step.versions
        eager = tf.executing_eagerly()
        if kind == "global":
            current = self.inner_optimizer.iterations
            if eager:
                staleness = int(_numpy(current)) - int(_numpy(given))
            else:
                staleness = tf.cast(current, tf.int64) - tf.cast(given, tf.int64)
        else:
            parts = []
            for guard, value in zip(step.guards, given):
                if value is None:
                    continue
                if eager:
                    parts.append(int(guard.version()) - int(_numpy(value)))
                else:
                    parts.append(guard.version_var.read_value() - tf.cast(value, tf.int64))
            if not parts:
                return 0
            staleness = max(parts) if eager else tf.reduce_max(tf.stack(parts))
        if eager:
            if staleness < 0:
                raise InvalidArgumentError(
                    f"version is {-staleness} update(s) ahead of the current state: it "
                    "must be a version read before the gradients were computed "
                    "(optimizer.iterations, v.version or a snapshot)."
                )
            return staleness
        return tf.maximum(staleness, 0)

    # ------------------------------------------------------------------ validation

    def _validate(
        self, grads: list[Any], variables: list[Any], version: Any, where: str
    ) -> _Step:
        """Checks everything checkable before the section; builds on the first call."""
        for index, variable in enumerate(variables):
            _check_variable(variable, where.format(index))
        versions = _normalize_versions(version, len(variables))
        kept = [i for i, g in enumerate(grads) if g is not None]
        if not kept:
            raise InvalidArgumentError(
                "No gradient was given for any variable (every gradient is None). If "
                "you use model.compile(), did you forget the loss?"
            )
        checked = {i: _check_gradient(grads[i], variables[i], where.format(i)) for i in kept}
        if self._safevars.state_guard is None:
            if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
                raise InvalidArgumentError(
                    "Build the optimizer before calling it inside strategy.run: "
                    "optimizer.build(model.trainable_variables) under strategy.scope() "
                    "(model.fit does it for you). Variables cannot be created per replica."
                )
            self.build(variables)  # As Keras does: the first call fixes the variables.
        seen: dict[int, int] = {}
        for i in kept:
            variable = variables[i]
            key = self._var_key(variable)
            if key not in self._trainable_variables_indices:
                raise InvalidArgumentError(
                    f"{where.format(i)}: variable {_name(variable)!r} is not one of the "
                    f"{len(self._trainable_variables)} variables this optimizer was built "
                    "with (the first apply or build() fixes them). Build a new "
                    "SafeOptimizer for a new set of variables."
                )
            if key in seen:
                raise InvalidArgumentError(
                    f"{where.format(i)}: variable {_name(variable)!r} is listed twice (also "
                    f"at {where.format(seen[key])}); sum its gradients first."
                )
            seen[key] = i
        if self.accumulate_steps > 1:
            self._check_same_variables(frozenset(
                self._get_variable_index(variables[i]) for i in kept
            ))
        guards = self._safevars.guards
        step_versions: tuple[str, Any] | None = None
        if versions is not None:
            kind, value = versions
            step_versions = (kind, value if kind == "global" else [value[i] for i in kept])
        return _Step(
            grads=[checked[i] for i in kept],
            variables=[variables[i] for i in kept],
            inner_variables=[_for_inner(variables[i]) for i in kept],
            guards=[guards[self._get_variable_index(variables[i])] for i in kept],
            versions=step_versions,
        )

    def _check_same_variables(self, indices: frozenset[int]) -> None:
        """With accumulate_steps > 1 every call must update the same variables."""
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.accumulated_set is None:
                runtime.accumulated_set = indices
                return
            expected = runtime.accumulated_set
        if indices != expected:
            names = [_name(self._trainable_variables[i]) for i in sorted(indices ^ expected)]
            raise InvalidArgumentError(
                f"With accumulate_steps={self.accumulate_steps} every call must give "
                f"gradients for the same variables (the first call gave {len(expected)}); "
                f"this call differs in {names}. Give a gradient (not None) for the same "
                "variables in every call."
            )

    # ------------------------------------------------------------------ statistics

    def statistics(self) -> OptimizerStatistics:
        """A frozen record of the counters (see :class:`OptimizerStatistics`).

        Thread safety: eagerly, read under the optimizer's state lock, so the record is
        consistent with completed calls (never half of one).

        Modes: eagerly the fields are ``int`` s. In a ``tf.function`` they are int64
        tensors read when the graph runs, without the lock. Under
        ParameterServerStrategy the counters live on the parameter server and count
        every worker's calls; an eager read on the coordinator takes the lock inside a
        ``tf.function``, as :meth:`apply_gradients` does.
        """
        accumulator = self._safevars.accumulator
        guard = self._safevars.state_guard
        if tf.executing_eagerly() and guard is not None and self._on_parameter_servers():
            # As in _section_on_coordinator: no eager MutexLock on a parameter server.
            def make() -> Callable[..., Any]:
                def read() -> Any:
                    return graph_section([guard], lambda: tuple(self.statistics()))

                return read

            record = self._coordinator_function("statistics", make)()
            return OptimizerStatistics(*(int(x) for x in record))
        if tf.executing_eagerly():
            with hold([guard] if guard is not None else []):
                values = [int(x) for x in self._statistics.numpy()]
                pending = int(accumulator.count) if accumulator is not None else 0
            return OptimizerStatistics(*values[:3], pending, *values[3:])
        tensor = tf.convert_to_tensor(self._statistics)
        values = tf.unstack(tensor)
        pending = (
            tf.cast(accumulator.count, tf.int64)
            if accumulator is not None
            else tf.constant(0, tf.int64)
        )
        return OptimizerStatistics(*values[:3], pending, *values[3:])

    # ------------------------------------------------------------------ serialization

    def get_config(self) -> dict[str, Any]:
        """The config: this wrapper's settings and the inner optimizer, serialized."""
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accumulate_steps": self.accumulate_steps,
            "max_staleness": self.max_staleness,
            "on_stale": self.on_stale,
            "nonfinite": self.nonfinite,
            "deterministic": self.deterministic,
        }

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> SafeOptimizer:
        """Rebuilds a SafeOptimizer (and its inner optimizer) from :meth:`get_config`."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


# --------------------------------------------------------------------------- helpers


def _inner_optimizer(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise InvalidArgumentError(
                f"optimizer={_short(optimizer)} is not a Keras optimizer identifier ({e})."
            ) from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a keras.optimizers.Optimizer (for example "
            f"keras.optimizers.Adam()), got {_short(optimizer)}."
        )
    if isinstance(optimizer, SafeOptimizer):
        raise InvalidArgumentError(
            "optimizer is already a SafeOptimizer; wrap the plain optimizer once."
        )
    if optimizer.gradient_accumulation_steps:
        raise InvalidArgumentError(
            f"optimizer uses gradient_accumulation_steps="
            f"{optimizer.gradient_accumulation_steps}; pass accumulate_steps to "
            "SafeOptimizer instead (its accumulation is thread-safe and advances "
            "iterations once per real update)."
        )
    return optimizer


def _reject_base_kwargs(kwargs: dict[str, Any]) -> None:
    """Accepts Keras' base-optimizer arguments only at their defaults (config round trip)."""
    defaults = {
        "learning_rate": None, "weight_decay": None, "clipnorm": None,
        "global_clipnorm": None, "clipvalue": None, "use_ema": False,
        "ema_momentum": 0.99, "ema_overwrite_frequency": None, "loss_scale_factor": None,
        "gradient_accumulation_steps": None,
    }
    for key, value in kwargs.items():
        if key not in defaults:
            raise InvalidArgumentError(f"SafeOptimizer got an unknown argument {key!r}.")
        if value != defaults[key]:
            raise InvalidArgumentError(
                f"SafeOptimizer does not take {key}={value!r}: set it on the inner "
                "optimizer, which does the arithmetic."
            )


def _check_int(value: Any, argument: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(
            f"{argument} must be an int >= {minimum}, got {_short(value)}."
        )


def _is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


def _check_variable(variable: Any, where: str) -> None:
    if isinstance(variable, sharded_variable.ShardedVariableMixin):
        raise UnsupportedStrategyError(
            f"{where} is a ShardedVariable (ParameterServerStrategy with a "
            "variable_partitioner). SafeOptimizer locks whole variables and does not "
            "support sharded ones: create the ParameterServerStrategy without "
            "variable_partitioner."
        )
    if not _is_variable(variable):
        raise InvalidArgumentError(
            f"{where} must be a variable (keras.Variable, tf.Variable or "
            f"safevars.SafeVariable), got {_short(variable)}."
        )


def _for_inner(variable: Any) -> Any:
    """What the inner optimizer is given: the raw variable, so writes are counted once."""
    if isinstance(variable, SafeVariable):
        return variable.__wrapped__
    return variable


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_gradient(grad: Any, variable: Any, where: str) -> Any:
    """Returns ``grad`` as a tensor (or IndexedSlices), or raises naming ``where``."""
    if isinstance(grad, tf.distribute.DistributedValues):
        return grad
    shape = tf.TensorShape(variable.shape)
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values
        if not values.dtype.is_floating:
            raise DTypeMismatchError(
                f"{where}: the gradient's values have dtype {values.dtype.name}; "
                "gradients must be floating point."
            )
        if shape.rank is not None and values.shape.rank is not None and (
            values.shape.rank != shape.rank
            or not values.shape[1:].is_compatible_with(shape[1:])
        ):
            raise ShapeMismatchError(
                f"{where}: the IndexedSlices gradient has values of shape "
                f"{values.shape.as_list()}, which do not fit variable {_name(variable)!r} "
                f"of shape {shape.as_list()}."
            )
        return grad
    if not isinstance(grad, tf.Tensor):
        try:
            grad = tf.convert_to_tensor(grad)
        except (TypeError, ValueError) as e:
            raise DTypeMismatchError(
                f"{where}: the gradient {_short(grad)} cannot be converted to a tensor "
                f"({e})."
            ) from None
    if not grad.dtype.is_floating:
        raise DTypeMismatchError(
            f"{where}: the gradient has dtype {grad.dtype.name}; gradients must be "
            f"floating point (variable {_name(variable)!r} is {_dtype_name(variable)})."
        )
    if not grad.shape.is_compatible_with(shape):
        raise ShapeMismatchError(
            f"{where}: the gradient has shape {grad.shape.as_list()} but variable "
            f"{_name(variable)!r} has shape {shape.as_list()}."
        )
    return grad


def _dtype_name(variable: Any) -> str:
    dtype = variable.dtype
    return getattr(dtype, "name", str(dtype))


def _version_value(value: Any, where: str) -> Any:
    if isinstance(value, Snapshot):
        value = value.version
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where} must be an int version, got {value!r}.")
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise InvalidArgumentError(f"{where} must be >= 0, got {value}.")
        return int(value)
    if isinstance(value, (tf.Tensor, tf.Variable, keras.Variable)) or (
        isinstance(value, tf.distribute.DistributedValues)
    ):
        dtype = tf.as_dtype(value.dtype)
        if not dtype.is_integer or (value.shape.rank not in (None, 0)):
            raise InvalidArgumentError(
                f"{where} must be an integer scalar, got a {dtype.name} tensor of shape "
                f"{value.shape}."
            )
        if tf.executing_eagerly() and not isinstance(value, tf.distribute.DistributedValues):
            return _version_value(int(_numpy(value)), where)
        return tf.cast(value, tf.int64)
    raise InvalidArgumentError(
        f"{where} must be an int, an integer tensor or a safevars.Snapshot, got "
        f"{_short(value)}."
    )


def _normalize_versions(version: Any, count: int) -> tuple[str, Any] | None:
    if version is None:
        return None
    if isinstance(version, (list, tuple)):
        if len(version) != count:
            raise InvalidArgumentError(
                f"version lists {len(version)} entries for {count} (gradient, variable) "
                "pairs; give one version (or None) per pair, or one int."
            )
        return "each", [
            None if v is None else _version_value(v, f"version[{i}]")
            for i, v in enumerate(version)
        ]
    return "global", _version_value(version, "version")


def _numpy(value: Any) -> Any:
    return value.numpy() if hasattr(value, "numpy") else value


def _make_accumulator(
    variables: list[Any], steps: int, deterministic: bool, name: str
) -> Any:
    from safevars.accumulator import GradientAccumulator

    if any(tf.as_dtype(_dtype_name(v)) == tf.float64 for v in variables):
        deterministic = False  # The exact sum covers float16, bfloat16 and float32.
    return GradientAccumulator(
        variables, reduction="mean", num_required=steps, deterministic=deterministic,
        name=f"{name}_accumulator",
    )


# ---------------------------------------------------- trace-safe control flow helpers
#
# One code path for eager and graph: Python values decide in Python, eager tensors are
# read, graph tensors become tf.cond / assertions. Only this bookkeeping differs.


def _is_static(value: Any) -> bool:
    return isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating))


def _decide(value: Any) -> bool | None:
    """A Python decision when one can be made now, else ``None`` (graph tensor)."""
    if _is_static(value):
        return bool(value)
    if tf.executing_eagerly():
        return bool(_numpy(value))
    return None


def _branch(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    decided = _decide(pred)
    if decided is not None:
        return true_fn() if decided else false_fn()
    return tf.cond(pred, true_fn, false_fn)


def _refuse(bad: Any, error: Callable[[], Exception], message: str) -> Any:
    """Raises ``error()`` now if ``bad`` is known true; in a graph, an assertion op."""
    decided = _decide(bad)
    if decided is not None:
        if decided:
            raise error()
        return None
    return tf.debugging.Assert(tf.logical_not(bad), [message])


def _logical_not(value: Any) -> Any:
    decided = _decide(value)
    return (not decided) if decided is not None else tf.logical_not(value)


def _logical_and(a: Any, b: Any) -> Any:
    da, db = _decide(a), _decide(b)
    if da is not None and db is not None:
        return da and db
    if da is not None:
        return b if da else False
    if db is not None:
        return a if db else False
    return tf.logical_and(a, b)


def _to_float(value: Any) -> Any:
    return float(value) if _is_static(value) else tf.cast(value, tf.float32)


def _where(pred: Any, a: Any, b: Any) -> Any:
    decided = _decide(pred)
    if decided is not None:
        chosen = a if decided else b
        return float(chosen) if _is_static(chosen) else chosen
    return tf.where(pred, tf.cast(a, tf.float32), tf.cast(b, tf.float32))


def _scale(grad: Any, factor: Any) -> Any:
    if _is_static(factor) and float(factor) == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def _all_finite(grads: list[Any]) -> Any:
    checks = []
    for grad in grads:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    result = tf.reduce_all(tf.stack(checks))
    return bool(result.numpy()) if tf.executing_eagerly() else result


def _zero() -> Any:
    return 0 if tf.executing_eagerly() else tf.constant(0, tf.int64)


def _one() -> Any:
    return 1 if tf.executing_eagerly() else tf.constant(1, tf.int64)
