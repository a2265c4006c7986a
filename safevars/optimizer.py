"""SafeOptimizer: a Keras 3 optimizer made safe to share, with atomic, versioned updates.

The problem: a Keras optimizer's ``apply_gradients`` is many separate operations (read
a slot, compute, write the slot, write the variable, add 1 to ``iterations``). Called
from several threads, asynchronous workers or concurrently running ``tf.function`` s, the
steps interleave: Adam's moments and SGD's momentum are read by one step and overwritten
by another (lost updates), ``iterations`` no longer matches the moments it bias-corrects,
and gradients computed from parameters that have since moved are applied as if fresh.

The fix: ``SafeOptimizer(optimizer)`` makes the optimizer you already use safe and
returns it. Each ``apply_gradients`` / ``apply`` call is then **one critical section**
over every variable it updates *and* the optimizer's own state (slots, ``iterations``,
learning rate, Keras' gradient accumulators, safevars' counters):

* eagerly under the variables' safevars locks (:func:`safevars.locking.hold`; a plain
  ``tf.Variable`` or ``keras.Variable`` gets its lock from :func:`safevars.wrap`);
* inside a ``tf.function`` (``model.fit``, custom loops, ``strategy.run``) the update is
  traced inside the same locks' mutexes (:func:`safevars.locking.graph_section`), so the
  exclusion holds when the graph runs, across threads, graph executions and eager code;
* each call adds exactly 1 to the version of every variable it wrote.

When it is built, the optimizer asks :func:`safevars.locking.share_lock` to let its
model variables and its state share one lock (each keeping its own version): one step
then takes one lock, however many variables the model has.

**Why a class made per optimizer class, not a proxy.** ``SafeOptimizer(adam)`` gives
``adam`` the class ``SafeOptimizer[Adam]`` (made once per optimizer class, a subclass of
both :class:`SafeOptimizer` and ``Adam``) and returns the same object. It therefore *is*
the optimizer: every attribute and hyperparameter (read and write), every method
(``exclude_from_weight_decay``, EMA, Nadam's and Muon's own), ``name``,
``loss_scale_factor`` as ``LossScaleOptimizer`` and ``MultiOptimizer`` set it, Keras'
warnings and errors for missing gradients, and the state layout (``variables``,
``get_weights``, checkpoints, ``.keras`` files) are the optimizer's own, with nothing in
between; ``isinstance(opt, Adam)`` holds. Keras' internal calls (``apply_gradients``
calling ``apply``, ``LossScaleOptimizer`` and ``MultiOptimizer`` calling the optimizer
they hold, ``model.fit``) reach the safe ``apply`` by ordinary method resolution. A
transparent proxy (what :class:`~safevars.SafeVariable` is for ``tf.Variable``) would
forward reads to the wrapped object, whose own methods then run on the wrapped object:
every path into an update would need intercepting, and anyone holding the plain object
(the one passed in) would update it unlocked. Here no plain object is left. The price:
the call changes the class of the object you pass (it cannot be undone), and
``type(opt) is Adam`` is false.

**Where safevars' own state lives.** The counters of :meth:`SafeOptimizer.statistics`
and the pending gradients of ``accumulate_steps`` are not optimizer variables: they are
in :attr:`SafeOptimizer.safevars_state`, a trackable that checkpoints only if you add it
(``tf.train.Checkpoint(..., safevars=opt.safevars_state)``). A ``.keras`` file or a
checkpoint of ``SafeOptimizer(Adam)`` is therefore laid out exactly as one of ``Adam``:
either loads into the other and training continues bitwise as it would have.

On top of the section: a staleness policy (``max_staleness`` with ``on_stale="drop" |
"raise" | "scale"``), deterministic accumulation (``accumulate_steps``; Keras' own
``gradient_accumulation_steps`` works too, made thread-safe) and an opt-in non-finite
policy, with every decision counted in :meth:`SafeOptimizer.statistics`.

Under ``tf.distribute`` (create the optimizer and make it safe inside
``strategy.scope()``; anything else is refused with an error naming the fix):

* ``MirroredStrategy`` / ``OneDeviceStrategy``: inside ``strategy.run`` the gradients
  are summed across replicas (as Keras does) and the section runs once per step, in
  cross-replica context, over every replica's copy.
* ``MultiWorkerMirroredStrategy``: the same on every worker; the gradients are
  all-reduced across the workers first, so the workers' weights, versions and counters
  agree.
* ``ParameterServerStrategy`` (TF2, with ``ClusterCoordinator``): variables, slots and
  counters live on the parameter servers and so do the locks: one ``apply_gradients``
  of a scheduled function is one critical section on the parameter server. An eager
  call on the coordinator runs the same section inside a ``tf.function``.
  ``ShardedVariable`` s are refused. Keras 3's ``model.fit`` does not support
  ParameterServerStrategy; use a custom loop.

NOTES:
  What is *not* guaranteed:

  * Writes that bypass safevars (another optimizer on the same variables, or
    ``layer.kernel.assign(...)`` on a plain Keras variable) are neither locked nor
    counted. Write through :func:`safevars.wrap` or use ``safevars.locked``.
  * Computing the gradient is not part of the section (that would serialize the
    forward and backward passes): a gradient may be computed from parameters another
    thread updates before it is applied. That is what ``version=`` and
    ``max_staleness`` are for.
  * An error the validation cannot foresee (a kernel failing half-way) leaves the update
    half done, as with the plain optimizer. Every mistake that can be checked before the
    update (unknown variable, shape, dtype, versions, staleness, non-finite values) is
    checked first and changes nothing.
  * A ``tf.function`` traced before the optimizer was made safe (a model's
    ``train_function`` after a first ``fit``) keeps the plain, unlocked update: make
    the optimizer safe before the first step, or compile the model again
    (``model.compile(optimizer=model.optimizer, ...)``; the optimizer keeps its state).
  * Inside an XLA-compiled function (``jit_compile=True``) the locks are taken around
    the compiled call (:mod:`safevars.sections`); the ``"raise"`` policies need run-time
    assertions, which XLA drops, so they are refused there.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from safevars import _keras_optimizer as k
from safevars import locking
from safevars._tf_internal import distribute_lib
from safevars.distribute import is_parameter_server
from safevars.errors import (
    InvalidArgumentError,
    NonFiniteGradientError,
    StaleGradientError,
    UnsupportedStrategyError,
)
from safevars.locking import Guard, graph_section, hold
from safevars.variable import wrap, writes_counted_by_caller

__all__ = ["OptimizerStatistics", "SafeOptimizer"]

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

# How many SafeOptimizer sections the calling thread is inside (running or tracing). A
# SafeOptimizer called by another one's update (LossScaleOptimizer or MultiOptimizer
# holding safe optimizers, inside a safe one) leaves the versions to the outermost.
_nesting = threading.local()


class OptimizerStatistics(NamedTuple):
    """A frozen record of what a :class:`SafeOptimizer` did, for debugging and tests.

    Attributes:
      calls: ``apply_gradients`` / ``apply`` calls that completed (a call refused with an
        error is not counted, because it changed nothing).
      applied: Real updates. With ``accumulate_steps=k`` or Keras'
        ``gradient_accumulation_steps=k``, one per k accumulated calls.
      accumulated: Calls whose gradients went into an accumulator (either kind).
      pending: Gradients in the ``accumulate_steps`` accumulator now, waiting for the
        next real update.
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


class _Step(NamedTuple):
    """One validated call."""

    grads: list[Any]  # the non-None gradients, checked
    kept: list[int]  # their positions in the call
    variables: list[Any]  # the call's variables at `kept`, as given
    keras_variables: list[Any]  # every variable of the call, as Keras' update gets them
    guards: list[Guard]  # the guards of `variables`
    # None, ("global", v) with v compared to ``iterations``, or ("each", [v or None]).
    versions: tuple[str, Any] | None


class SafevarsState(tf.Module):
    """safevars' bookkeeping of one SafeOptimizer: counters and pending accumulation.

    Not part of the optimizer's variables or checkpoint dependencies (so plain and safe
    optimizers read each other's files); add it to a checkpoint to keep it::

        tf.train.Checkpoint(model=model, optimizer=opt, safevars=opt.safevars_state)

    Attributes:
      statistics: The int64 counters behind :meth:`SafeOptimizer.statistics`.
      accumulator: The :class:`~safevars.GradientAccumulator` of ``accumulate_steps > 1``
        (set when the optimizer is built), else absent.
    """


class _Runtime:
    """Python-side state of a SafeOptimizer, kept out of Keras' and TF's tracking."""

    __slots__ = (
        "accumulate_steps",
        "max_staleness",
        "on_stale",
        "nonfinite",
        "deterministic",
        "build_lock",
        "ready",
        "guards",
        "state_guard",
        "fixed_guards",
        "shared",
        "accumulator",
        "accumulated_set",
        "coordinator_fns",
        "counters",
        "strategy",
        "state",
    )

    def __init__(self, settings: dict[str, Any], name: str) -> None:
        for key, value in settings.items():
            setattr(self, key, value)
        self.build_lock = threading.Lock()
        self.ready = False  # Set last by the first build.
        self.guards: list[Guard] = []  # one per built variable, in Keras' order
        self.fixed_guards: list[Guard] = []  # state guard, nested optimizers' states
        self.shared = False
        self.accumulator: Any = None
        # With accumulate_steps > 1: the variable indices every call must give gradients for.
        self.accumulated_set: frozenset[int] | None = None
        # Under ParameterServerStrategy: the tf.functions that eager calls on the
        # coordinator run instead of taking the parameter servers' mutexes eagerly.
        self.coordinator_fns: dict[Any, Callable[..., Any]] = {}
        self.strategy = tf.distribute.get_strategy()
        with tf.init_scope():
            self.counters = tf.Variable(
                tf.zeros([len(_COUNTERS)], tf.int64),
                trainable=False,
                name=f"{name}_safevars_statistics",
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        self.state_guard = wrap(self.counters).guard
        self.state = SafevarsState(name="safevars_state")
        self.state.statistics = self.counters


# --------------------------------------------------------------------------- the classes


class _SafeOptimizerType(type):
    """Metaclass: ``SafeOptimizer(opt, ...)`` makes ``opt`` safe and returns it.

    Calling a class made for one optimizer class (``type(opt)(...)``) constructs that
    optimizer from the arguments and makes it safe with the default settings.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        base = cls.__dict__.get("_safevars_base")
        if base is None:
            return _make_safe(*args, **kwargs)
        made = base(*args, **kwargs)
        return made if isinstance(made, SafeOptimizer) else _make_safe(made)


@keras.saving.register_keras_serializable(package="safevars", name="SafeOptimizer")
class SafeOptimizer(keras.optimizers.Optimizer, metaclass=_SafeOptimizerType):
    """Makes a Keras 3 optimizer safe to share: each update atomic, versioned and checked.

    Use it wherever the optimizer goes::

        model.compile(optimizer=safevars.SafeOptimizer(keras.optimizers.Adam(1e-3)), ...)
        model.fit(...)

        opt = safevars.SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        opt.apply_gradients(zip(grads, model.trainable_variables))   # from any thread

    ``SafeOptimizer(optimizer)`` returns ``optimizer`` itself, now an instance of
    ``SafeOptimizer[type(optimizer)]``: the same object, the same arithmetic (bitwise,
    for one thread), attributes, methods and saved state, plus the critical section,
    versions, staleness and non-finite policies, accumulation and counters. Model
    variables may be ``keras.Variable`` s, plain ``tf.Variable`` s or
    :class:`~safevars.SafeVariable` s.

    Args:
      optimizer: The Keras optimizer to make safe (an instance, or an identifier such as
        ``"adam"`` for ``keras.optimizers.get``). It may already be built (a loaded
        model's optimizer, for example) but not be safe already.
      accumulate_steps: k >= 1. With k > 1, the gradients of k calls are averaged
        exactly (with :class:`safevars.GradientAccumulator`) and applied by one update:
        ``iterations``, the learning-rate schedule, weight decay and Adam's bias
        correction advance once per real update. The optimizer's own
        ``gradient_accumulation_steps`` is the other way (Keras' running sum, kept in
        the optimizer's variables); use one or the other.
      max_staleness: ``None`` (no check) or an int >= 0: calls whose gradients were
        computed from parameters more than this many updates old are handled by
        ``on_stale``. Staleness is measured only for calls given ``version=``.
      on_stale: ``"drop"`` (skip the call, count it), ``"raise"``
        (:class:`~safevars.StaleGradientError`, nothing changes) or ``"scale"`` (multiply
        the gradients by ``1 / (staleness + 1)``, Zhang et al., "Staleness-aware
        Async-SGD", 2016).
      nonfinite: ``None`` (default, no check, as Keras), ``"skip"`` (a call with a NaN or
        Inf gradient changes nothing but the ``skipped_nonfinite`` count) or ``"raise"``
        (:class:`~safevars.NonFiniteGradientError`).
      deterministic: With ``accumulate_steps > 1``: accumulate exactly, so the mean is
        bitwise the same whatever order concurrent calls arrive in (see
        :class:`~safevars.GradientAccumulator`); False keeps a float32 running sum.
      name: Optional: sets the optimizer's ``name``.

    Returns:
      ``optimizer``, made safe.

    Raises:
      InvalidArgumentError: an argument is out of range, ``optimizer`` is not a Keras
        optimizer or is safe already, or both kinds of accumulation are asked for.
        Nothing is changed then.

    Mixed precision: ``LossScaleOptimizer(SafeOptimizer(...))`` is what ``model.compile``
    builds under a ``mixed_float16`` policy: the loss-scale optimizer skips non-finite
    steps before they reach the section, and sets the safe optimizer's
    ``loss_scale_factor`` (off) as on any optimizer it holds.
    ``SafeOptimizer(LossScaleOptimizer(...))`` also works (its whole step, scale
    included, is one section), but not under a ``tf.distribute`` strategy.

    Saving: ``model.save`` writes the optimizer's own config plus a ``"safevars"``
    entry (the settings) under the registered name ``"safevars>SafeOptimizer"``, and
    exactly the variables the plain optimizer writes; ``keras.models.load_model`` gives
    a SafeOptimizer back once ``safevars`` is imported. ``pickle`` works as for Keras
    optimizers.
    """

    _safevars: _Runtime
    _safevars_base: type

    # ------------------------------------------------------------------ settings

    accumulate_steps = property(
        lambda self: self._safevars.accumulate_steps, doc="``accumulate_steps`` (read-only)."
    )
    max_staleness = property(
        lambda self: self._safevars.max_staleness, doc="``max_staleness`` (read-only)."
    )
    on_stale = property(lambda self: self._safevars.on_stale, doc="``on_stale`` (read-only).")
    nonfinite = property(lambda self: self._safevars.nonfinite, doc="``nonfinite`` (read-only).")
    deterministic = property(
        lambda self: self._safevars.deterministic, doc="``deterministic`` (read-only)."
    )

    @property
    def safevars_state(self) -> SafevarsState:
        """safevars' bookkeeping (counters, pending accumulation), to checkpoint apart.

        Not among :attr:`variables` nor a checkpoint dependency of the optimizer, so the
        optimizer's files are those of the plain optimizer. Add it to a checkpoint to
        keep the counters and the gradients pending with ``accumulate_steps > 1``.
        """
        return self._safevars.state

    # ------------------------------------------------------------------ build

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the optimizer (if it is not) and its locks for ``variables``.

        Args:
          variables: The trainable variables (``keras.Variable``, ``tf.Variable`` or
            SafeVariable) every later call may update. If the optimizer was built before
            it was made safe, they must be among the variables it was built with.

        Raises:
          InvalidArgumentError: an entry is not a variable, or not one the optimizer was
            already built with.

        Thread safety: idempotent and safe to call from several threads; the first call
        builds. Its model variables and state then share one lock where
        :func:`safevars.locking.share_lock` allows it.

        Modes: eager or while tracing (variables and locks are made in the init scope).
        """
        variables = list(variables)
        for index, variable in enumerate(variables):
            k.check_variable(variable, f"variables[{index}]")
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.ready:
                return
            keras_variables = [k.for_keras(v) for v in variables]
            if self.built:
                known = self._trainable_variables_indices
                unknown = [k.name_of(v) for v in keras_variables if self._var_key(v) not in known]
                if unknown:
                    raise InvalidArgumentError(
                        f"The optimizer is already built on other variables; {unknown} are "
                        "not among them. Make an unbuilt optimizer safe, or build on the "
                        "variables it was built with."
                    )
            else:
                super().build(keras_variables)
            with tf.init_scope():
                self._safevars_setup(runtime)

    def _safevars_setup(self, runtime: _Runtime) -> None:
        """The locks of a built optimizer; sets ``runtime.ready`` last."""
        trainables = list(self._trainable_variables)
        guards = [wrap(v).guard for v in trainables]
        nested = [o._safevars.state_guard for o in _nested_safe_optimizers(self)]
        fixed = [runtime.state_guard, *nested]
        if runtime.accumulate_steps > 1:
            accumulator = _make_accumulator(
                trainables, runtime.accumulate_steps, runtime.deterministic, self.name
            )
            runtime.state.accumulator = accumulator
            runtime.accumulator = accumulator
        share = getattr(locking, "share_lock", None)
        runtime.shared = bool(share(guards + fixed)) if share is not None else False
        runtime.guards = guards
        runtime.fixed_guards = fixed
        runtime.ready = True

    # ------------------------------------------------------------------ updates

    def apply_gradients(
        self, grads_and_vars: Iterable[tuple[Any, Any]], *, version: Any = None
    ) -> Any:
        """Applies ``(gradient, variable)`` pairs as one atomic, versioned update.

        Args:
          grads_and_vars: Pairs of a gradient (tensor, ``tf.IndexedSlices`` or ``None``,
            which skips that variable with Keras' warning) and a variable the optimizer
            was built with (the first call builds it, as in Keras).
          version: What the gradients were computed from, to measure staleness with
            ``max_staleness``: an int (the value of ``iterations`` when the parameters
            were read), or a list with one entry per pair, each a version
            (``v.version`` of a SafeVariable, ``safevars.wrap(v).version``), a
            :class:`~safevars.Snapshot` or ``None``. Staleness is the number of updates
            since (the largest over the listed variables). Ignored without
            ``max_staleness``.

        Returns:
          The optimizer's step counter variable (as Keras returns it).

        Raises:
          InvalidArgumentError: a pair is malformed, a variable is unknown or listed
            twice, no gradient is given, ``version`` is malformed or from the future,
            the optimizer was made outside the scope of the strategy it is called
            under, or a ``"raise"`` policy is asked for inside XLA.
          ShapeMismatchError: a gradient's shape does not match its variable's.
          DTypeMismatchError: a gradient is not a floating-point tensor.
          StaleGradientError: ``on_stale="raise"`` and the gradients are too stale.
          NonFiniteGradientError: ``nonfinite="raise"`` and a gradient holds NaN/Inf.
          UnsupportedStrategyError: called under an unsupported ``tf.distribute``
            strategy (the message names the supported ones), or with a
            ``ShardedVariable``. Each of these is raised before anything changes:
            variables, slots, ``iterations``, versions and counters are as they were.

        Thread safety: the whole update (every variable written, every slot,
        ``iterations``, Keras' accumulators, the counters and the pending accumulation)
        is one critical section: concurrent calls from any threads, graphs or eager code
        never interleave, and each call adds exactly 1 to the version of each variable
        it wrote (none when the call is dropped, skipped or only accumulated).

        Modes: eagerly under the safevars locks. In a ``tf.function`` inside the locks'
        mutexes (policies become ``tf.cond`` s; ``"raise"`` policies become run-time
        assertions that fail with ``tf.errors.InvalidArgumentError`` before anything is
        written). Under ``jit_compile=True`` the locks are taken around the compiled
        call. Inside ``strategy.run`` (Mirrored and MultiWorkerMirrored strategies) the
        gradients are summed across replicas (and workers) as Keras does and the
        section runs once, in cross-replica context. Under ParameterServerStrategy a
        scheduled function may call it inside ``strategy.run`` or directly; the section
        is on the parameter server, and an eager call on the coordinator runs it in a
        ``tf.function``. Read ``version`` before the forward pass::

            version = tf.convert_to_tensor(optimizer.iterations)
            with tf.control_dependencies([version]), tf.GradientTape() as tape:
                loss = ...
            optimizer.apply_gradients(zip(tape.gradient(loss, vs), vs), version=version)
        """
        pairs = list(grads_and_vars)
        for index, pair in enumerate(pairs):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidArgumentError(
                    f"grads_and_vars[{index}] must be a (gradient, variable) pair, got "
                    f"{k.short(pair)}. Pass zip(gradients, variables)."
                )
        if pairs:
            grads, variables = [p[0] for p in pairs], [p[1] for p in pairs]
            self._safevars_apply(grads, variables, version, "grads_and_vars[{}]")
        return self._iterations

    def apply(
        self,
        grads: Sequence[Any],
        trainable_variables: Sequence[Any] | None = None,
        *,
        version: Any = None,
    ) -> None:
        """Keras' ``apply``: ``grads`` for ``trainable_variables`` (default: all built).

        See :meth:`apply_gradients` for ``version``, errors, thread safety and modes.
        """
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise InvalidArgumentError(
                    "When passing `grads` without `variables`, the optimizer must already "
                    "be built on a list of variables. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise InvalidArgumentError(
                f"grads has {len(grads)} entries but trainable_variables has "
                f"{len(trainable_variables)}: the gradients must match the variables one "
                "to one."
            )
        self._safevars_apply(grads, trainable_variables, version, "grads[{}]")

    def _safevars_apply(
        self, grads: list[Any], variables: list[Any], version: Any, where: str
    ) -> None:
        runtime = self._safevars
        strategy = k.current_strategy()
        self._safevars_check_created_under(strategy)
        if strategy is not None and isinstance(self, keras.optimizers.LossScaleOptimizer):
            raise UnsupportedStrategyError(
                "SafeOptimizer(LossScaleOptimizer(...)) cannot run under a tf.distribute "
                "strategy (the loss-scale optimizer must run in replica context, the "
                "section runs in cross-replica context). Wrap the other way round: "
                "LossScaleOptimizer(SafeOptimizer(...)), which model.compile builds "
                "itself under a mixed_float16 policy."
            )
        step = self._safevars_validate(grads, variables, version, where)
        asserts = runtime.nonfinite == "raise" or (
            runtime.on_stale == "raise"
            and runtime.max_staleness is not None
            and step.versions is not None
        )
        if asserts and k.in_xla_context():
            raise InvalidArgumentError(
                "The 'raise' policies (on_stale='raise', nonfinite='raise') check at run "
                "time with assertions, which XLA-compiled functions (jit_compile=True) "
                "drop: the update would go ahead. Use on_stale='drop' or 'scale' and "
                "nonfinite='skip' under XLA, or compile with jit_compile=False."
            )
        if strategy is not None and not tf.distribute.in_cross_replica_context():
            self._safevars_merge_into_cross_replica(step)
        elif tf.executing_eagerly() and self._safevars_on_parameter_servers():
            self._safevars_section_on_coordinator(step, strategy)
        else:
            self._safevars_section(step, strategy)

    def _safevars_check_created_under(self, strategy: tf.distribute.Strategy | None) -> None:
        """Refuses a call under a strategy other than the one that created the state.

        The slots, ``iterations`` and counters belong to the strategy current when they
        were created; used under another they would be variables that strategy does not
        own (Keras fails deep inside with "Must not nest tf.distribute.Strategy scopes").
        """
        if strategy is None:
            return
        owners = (
            (getattr(self, "_distribution_strategy", None), "the optimizer"),
            (self._safevars.strategy, "SafeOptimizer(...) was called, and its counters"),
        )
        for created, what in owners:
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
                "belong to this strategy. Create the optimizer and make it safe inside "
                "`with strategy.scope():` (the scope the model's variables are created in)."
            )

    def _safevars_on_parameter_servers(self) -> bool:
        return is_parameter_server(getattr(self, "_distribution_strategy", None))

    def _safevars_coordinator_function(
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

    def _safevars_section_on_coordinator(
        self, step: _Step, strategy: tf.distribute.Strategy | None
    ) -> None:
        """An eager call under ParameterServerStrategy: the same section, in a graph.

        Taking a parameter server's mutex with an eager ``MutexLock`` from the
        coordinator while scheduled functions use it deadlocks (observed with TF 2.21),
        so the coordinator runs the section inside a ``tf.function`` traced once per set
        of variables. The ``"raise"`` policies keep their eager error types.
        """
        self._safevars_refuse_future_versions(step)
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
        key = (
            "apply",
            positions,
            tuple(step.kept),
            len(step.keras_variables),
            shape,
            strategy is not None,
        )
        template = step

        def make() -> Callable[..., Any]:
            def run(grads: list[Any], versions: Any) -> None:
                rebuilt = None if versions is None else (template.versions[0], versions)
                self._safevars_section(
                    template._replace(grads=list(grads), versions=rebuilt), strategy
                )

            return run

        fn = self._safevars_coordinator_function(key, make)
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

    def _safevars_refuse_future_versions(self, step: _Step) -> None:
        """Eager check that no given version is ahead of the current state."""
        if self.max_staleness is None or step.versions is None:
            return
        kind, given = step.versions
        if kind == "global":
            pairs = [(int(k.numpy_of(self.iterations)), given)]
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

    def _safevars_merge_into_cross_replica(self, step: _Step) -> None:
        """Sums the gradients over replicas (as Keras does), then runs the section once."""
        context = tf.distribute.get_replica_context()
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, step.grads)
        packed: Any = None
        if step.versions is not None:
            kind, value = step.versions
            if kind == "global":
                packed = tf.cast(value, tf.int64)
            else:
                packed = [None if v is None else tf.cast(v, tf.int64) for v in value]

        def merged(strategy: tf.distribute.Strategy, grads: Any, versions: Any) -> None:
            grads = [k.local(g) for g in grads]
            if versions is not None:
                if step.versions[0] == "global":
                    versions = ("global", k.oldest(versions))
                else:
                    versions = ("each", [None if v is None else k.oldest(v) for v in versions])
            self._safevars_section(step._replace(grads=grads, versions=versions), strategy)

        context.merge_call(merged, args=(reduced, packed))

    # ------------------------------------------------------------------ the section

    def _safevars_section(self, step: _Step, strategy: tf.distribute.Strategy | None) -> None:
        runtime = self._safevars
        guards = list(step.guards) + runtime.fixed_guards
        if self.use_ema:
            guards += runtime.guards  # EMA reads, and may overwrite, every model variable.

        def body() -> None:
            _nesting.depth = getattr(_nesting, "depth", 0) + 1
            try:
                self._safevars_locked_step(step, strategy)
            finally:
                _nesting.depth -= 1

        if tf.executing_eagerly():
            with hold(guards):
                body()
        else:
            graph_section(guards, body, after=step.grads)

    def _safevars_locked_step(self, step: _Step, strategy: tf.distribute.Strategy | None) -> None:
        """Everything one call does, with every lock held (one trace-safe path).

        Decisions are Python values eagerly and tensors in a graph. Every check runs
        before anything is written; the counters are written last.
        """
        runtime = self._safevars
        counts: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
        counts["calls"] = 1
        grads = step.grads
        keep: Any = True
        checks: list[Any] = []
        if runtime.max_staleness is not None and step.versions is not None:
            staleness = self._safevars_staleness(step)
            stale = staleness > runtime.max_staleness
            if runtime.on_stale == "raise":
                checks.append(
                    k.refuse(
                        stale,
                        lambda: StaleGradientError(
                            f"The gradients are {int(staleness)} updates stale, more than "
                            f"max_staleness={runtime.max_staleness}; nothing was applied. "
                            "Recompute them from the current parameters, or use "
                            "on_stale='drop' or 'scale'."
                        ),
                        "safevars StaleGradientError: the gradients are more than "
                        "max_staleness updates stale; nothing was applied.",
                    )
                )
            elif runtime.on_stale == "drop":
                keep = k.logical_not(stale)
                counts["dropped_stale"] = stale
            else:
                factor = k.where(stale, 1.0 / (k.to_float(staleness) + 1.0), 1.0)
                grads = [k.scale(g, factor) for g in grads]
                counts["scaled_stale"] = stale
        if runtime.nonfinite is not None:
            finite = k.all_finite(grads)
            if runtime.nonfinite == "raise":
                checks.append(
                    k.refuse(
                        k.logical_not(finite),
                        lambda: NonFiniteGradientError(
                            "A gradient holds NaN or Inf and nonfinite='raise'; nothing was "
                            "applied. Use nonfinite='skip' to skip such steps, or a "
                            "LossScaleOptimizer for mixed precision."
                        ),
                        "safevars NonFiniteGradientError: a gradient holds NaN or Inf; "
                        "nothing was applied.",
                    )
                )
            else:
                counts["skipped_nonfinite"] = k.logical_and(keep, k.logical_not(finite))
                keep = k.logical_and(keep, finite)
        with tf.control_dependencies([c for c in checks if c is not None]):
            applied, accumulated = k.branch(
                keep,
                lambda: self._safevars_update(step, grads, strategy),
                lambda: (k.zero(), k.zero()),
            )
            counts["applied"] = applied
            counts["accumulated"] = accumulated
            self._safevars_count(counts)

    def _safevars_update(
        self, step: _Step, grads: list[Any], strategy: tf.distribute.Strategy | None
    ) -> tuple[Any, Any]:
        """Accumulates or applies; returns (applied, accumulated) as 0/1."""
        runtime = self._safevars
        if runtime.accumulate_steps == 1:
            full: list[Any] = [None] * len(step.keras_variables)
            for grad, position in zip(grads, step.kept):
                full[position] = grad
            return self._safevars_keras_update(full, step.keras_variables, step.guards, strategy)
        accumulator = runtime.accumulator
        positions = [self._get_variable_index(v) for v in step.variables]
        by_index: list[Any] = [None] * len(runtime.guards)
        for grad, position in zip(grads, positions):
            by_index[position] = grad
        # The section holds the optimizer's state lock, so no other call adds or takes
        # between these two atomic accumulator operations.
        accumulator.add(by_index)
        ready, mean = accumulator.take_if_ready()
        variables = [step.keras_variables[i] for i in step.kept]

        def apply_mean() -> Any:
            self._safevars_keras_update(
                [mean[p] for p in positions], variables, step.guards, strategy
            )
            return k.one()

        return k.branch(ready, apply_mean, k.zero), k.one()

    def _safevars_keras_update(
        self,
        grads: list[Any],
        variables: list[Any],
        guards: list[Guard],
        strategy: tf.distribute.Strategy | None,
    ) -> tuple[Any, Any]:
        """Keras' own update, then 1 more on each written variable's version.

        Returns (applied, accumulated): (1, 0), or with Keras'
        ``gradient_accumulation_steps`` (1 on the calls that update, 1).
        """
        eager = tf.executing_eagerly()
        every = self.gradient_accumulation_steps
        update: Any = 1
        if every:
            if eager:
                update = int((int(self._iterations.numpy()) + 1) % every == 0)
            else:
                following = tf.cast(tf.convert_to_tensor(self._iterations), tf.int64) + 1
                update = tf.cast(tf.equal(following % every, 0), tf.int64)
        graph = None if eager else tf.compat.v1.get_default_graph()
        existing = None if eager else set(graph.get_operations())
        reads = [] if eager or not every else [update]
        with (
            k.direct_merge_calls(strategy),
            tf.control_dependencies(reads),
            writes_counted_by_caller(guards),
        ):
            super().apply(grads, variables)
        result = (update, k.one()) if every else (k.one(), k.zero())
        if getattr(_nesting, "depth", 0) > 1:
            return result  # The enclosing SafeOptimizer's section counts the versions.
        if eager:
            if update:
                for guard in guards:
                    guard.bump_eager(1)
            return result
        created = [op for op in graph.get_operations() if op not in existing]
        with tf.control_dependencies(created):
            written = tf.no_op(name="safevars_update_done")
        for guard in guards:
            guard.bump_graph(written, update)
        return result

    def _safevars_count(self, counts: dict[str, Any]) -> None:
        values = [counts[name] for name in _COUNTERS]
        if all(isinstance(v, (int, bool)) for v in values):
            key = tuple(int(v) for v in values)
            delta = _DELTAS.get(key) if tf.executing_eagerly() else None
            if delta is None:
                delta = tf.constant(key, tf.int64)
                if tf.executing_eagerly():
                    _DELTAS[key] = delta
        else:
            delta = tf.stack([tf.cast(v, tf.int64) for v in values])
        runtime = self._safevars
        written = k.add_counts(runtime.counters, delta)
        if tf.executing_eagerly():
            runtime.state_guard.bump_eager(1)
        else:
            runtime.state_guard.bump_graph(written)

    def _safevars_staleness(self, step: _Step) -> Any:
        kind, given = step.versions
        eager = tf.executing_eagerly()
        if kind == "global":
            current = self.iterations
            if eager:
                staleness = int(k.numpy_of(current)) - int(k.numpy_of(given))
            else:
                staleness = tf.cast(current, tf.int64) - tf.cast(given, tf.int64)
        else:
            parts = []
            for guard, value in zip(step.guards, given):
                if value is None:
                    continue
                if eager:
                    parts.append(int(guard.version()) - int(k.numpy_of(value)))
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

    def _safevars_validate(
        self, grads: list[Any], variables: list[Any], version: Any, where: str
    ) -> _Step:
        """Checks everything checkable before the section; builds on the first call."""
        for index, variable in enumerate(variables):
            k.check_variable(variable, where.format(index))
        versions = k.normalize_versions(version, len(variables))
        kept = [i for i, g in enumerate(grads) if g is not None]
        if not kept:
            raise InvalidArgumentError(
                "No gradients provided for any variable. Every gradient given is None; "
                "if you use model.compile(), did you forget the loss?"
            )
        checked = [k.check_gradient(grads[i], variables[i], where.format(i)) for i in kept]
        runtime = self._safevars
        if not runtime.ready:
            if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
                raise InvalidArgumentError(
                    "Build the optimizer before calling it inside strategy.run: "
                    "optimizer.build(model.trainable_variables) under strategy.scope() "
                    "(model.fit does it for you). Variables cannot be created per replica."
                )
            if self.built:
                self.build(self._trainable_variables)
            else:
                with keras.name_scope(self.name, caller=self):  # as Keras' apply builds
                    self.build(variables)
        known = self._trainable_variables_indices
        seen: dict[int, int] = {}
        for i, variable in enumerate(variables):
            key = self._var_key(variable)
            if key not in known:
                raise InvalidArgumentError(
                    f"{where.format(i)}: Unknown variable {k.name_of(variable)!r}: this "
                    f"optimizer can only be called for the {len(known)} variables it was "
                    "built with (the first apply or build() fixes them). For a new set of "
                    "variables, make a new optimizer."
                )
            if grads[i] is not None:
                if key in seen:
                    raise InvalidArgumentError(
                        f"{where.format(i)}: variable {k.name_of(variable)!r} is listed twice "
                        f"(also at {where.format(seen[key])}); sum its gradients first."
                    )
                seen[key] = i
        if runtime.accumulate_steps > 1:
            self._safevars_check_same_variables(
                frozenset(self._get_variable_index(variables[i]) for i in kept)
            )
        step_versions: tuple[str, Any] | None = None
        if versions is not None:
            kind, value = versions
            step_versions = (kind, value if kind == "global" else [value[i] for i in kept])
        return _Step(
            grads=checked,
            kept=kept,
            variables=[variables[i] for i in kept],
            keras_variables=[k.for_keras(v) for v in variables],
            guards=[runtime.guards[self._get_variable_index(variables[i])] for i in kept],
            versions=step_versions,
        )

    def _safevars_check_same_variables(self, indices: frozenset[int]) -> None:
        """With accumulate_steps > 1 every call must update the same variables."""
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.accumulated_set is None:
                runtime.accumulated_set = indices
                return
            expected = runtime.accumulated_set
        if indices != expected:
            names = [k.name_of(self._trainable_variables[i]) for i in sorted(indices ^ expected)]
            raise InvalidArgumentError(
                f"With accumulate_steps={runtime.accumulate_steps} every call must give "
                f"gradients for the same variables (the first call gave {len(expected)}); "
                f"this call differs in {names}. Give a gradient (not None) for the same "
                "variables in every call."
            )

    # ------------------------------------------------------------------ whole-state calls

    def _safevars_all_guards(self) -> list[Guard]:
        """Every guard of the optimizer, for eager whole-state calls (none before build).

        None on parameter servers: the coordinator cannot take their mutexes eagerly
        (see :meth:`_safevars_section_on_coordinator`); Keras' own calls run unlocked.
        """
        runtime = self._safevars
        if not runtime.ready or self._safevars_on_parameter_servers():
            return []
        return runtime.guards + runtime.fixed_guards

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Keras' ``finalize_variable_values`` (EMA), under the optimizer's locks.

        Thread safety: atomic with respect to ``apply_gradients`` (eagerly).

        Modes: Keras calls it eagerly at the end of ``fit``; in a graph, no lock.
        """
        variables = [k.for_keras(v) for v in var_list]
        if tf.executing_eagerly():
            with hold(self._safevars_all_guards()):
                super().finalize_variable_values(variables)
        else:
            super().finalize_variable_values(variables)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Keras' ``set_weights`` (the layout of :attr:`variables`), under the locks.

        Thread safety: atomic with respect to ``apply_gradients`` (eagerly).

        Modes: eager.
        """
        with hold(self._safevars_all_guards()):
            super().set_weights(weights)

    def save_own_variables(self, store: Any) -> None:
        """Keras' saving hook: the optimizer's variables, read under the locks."""
        with hold(self._safevars_all_guards()):
            super().save_own_variables(store)

    def load_own_variables(self, store: Any) -> None:
        """Keras' loading hook: the optimizer's variables, written under the locks."""
        with hold(self._safevars_all_guards()):
            super().load_own_variables(store)

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
        runtime = self._safevars
        accumulator = runtime.accumulator
        guard = runtime.state_guard
        if tf.executing_eagerly() and self._safevars_on_parameter_servers():

            def make() -> Callable[..., Any]:
                def read() -> Any:
                    return graph_section([guard], lambda: tuple(self.statistics()))

                return read

            record = self._safevars_coordinator_function("statistics", make)()
            return OptimizerStatistics(*(int(x) for x in record))
        if tf.executing_eagerly():
            with hold([guard]):
                values = [int(x) for x in runtime.counters.numpy()]
                pending = int(accumulator.count) if accumulator is not None else 0
            return OptimizerStatistics(*values[:3], pending, *values[3:])
        values = tf.unstack(tf.convert_to_tensor(runtime.counters))
        pending = (
            tf.cast(accumulator.count, tf.int64)
            if accumulator is not None
            else tf.constant(0, tf.int64)
        )
        return OptimizerStatistics(*values[:3], pending, *values[3:])

    # ------------------------------------------------------------------ serialization

    def get_config(self) -> dict[str, Any]:
        """The optimizer's own config, plus a ``"safevars"`` entry: class and settings."""
        config = super().get_config()
        runtime = self._safevars
        config["safevars"] = {
            "optimizer": k.class_identity(self._safevars_base),
            "accumulate_steps": runtime.accumulate_steps,
            "max_staleness": runtime.max_staleness,
            "on_stale": runtime.on_stale,
            "nonfinite": runtime.nonfinite,
            "deterministic": runtime.deterministic,
        }
        return config

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> SafeOptimizer:
        """Rebuilds a safe optimizer from :meth:`get_config`.

        Also takes the config of safevars 0.1 (``{"optimizer": ..., settings}``) and, on
        a class made for one optimizer class, that optimizer's plain config.
        """
        config = dict(config)
        settings = config.pop("safevars", None)
        if settings is None:
            legacy = config.get("optimizer")
            if isinstance(legacy, dict) and "class_name" in legacy:
                inner = keras.saving.deserialize_keras_object(
                    config.pop("optimizer"), custom_objects=custom_objects
                )
                config.pop("name", None)
                return SafeOptimizer(inner, **config)
            base = cls.__dict__.get("_safevars_base")
            if base is None:
                raise InvalidArgumentError(
                    "SafeOptimizer.from_config needs a config from SafeOptimizer."
                    f"get_config() (with a 'safevars' entry); got keys {sorted(config)}."
                )
            return SafeOptimizer(base.from_config(config, custom_objects=custom_objects))
        settings = dict(settings)
        identity = settings.pop("optimizer")
        inner = keras.saving.deserialize_keras_object(
            {**identity, "config": config}, custom_objects=custom_objects
        )
        return SafeOptimizer(inner, **settings)

    def __reduce__(self) -> Any:
        # Keras pickles through its saving format; the class made for this optimizer's
        # class has no importable name, so unpickle through SafeOptimizer.
        reduced = super().__reduce__()
        return (SafeOptimizer._unpickle_model, reduced[1])


# --------------------------------------------------------------------------- making safe

_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _safe_class(base: type) -> type:
    """``SafeOptimizer[base]``: made once per optimizer class, registered for saving."""
    with _CLASSES_LOCK:
        made = _CLASSES.get(base)
        if made is None:
            namespace = {
                "__module__": __name__,
                "__qualname__": f"SafeOptimizer[{base.__qualname__}]",
                "__doc__": f"{base.__name__}, made safe by safevars.SafeOptimizer.",
                "_safevars_base": base,
            }
            try:
                namespace["__signature__"] = inspect.signature(base)
            except (TypeError, ValueError):
                pass
            meta = _SafeOptimizerType
            if not issubclass(meta, type(base)):  # the optimizer class has a metaclass
                meta = type(
                    f"SafeOptimizerType[{type(base).__name__}]",
                    (_SafeOptimizerType, type(base)),
                    {},
                )
            made = meta(base.__name__, (SafeOptimizer, base), namespace)
            # Serialized under SafeOptimizer's registered name, which stays SafeOptimizer's.
            register = keras.saving.register_keras_serializable("safevars", "SafeOptimizer")
            register(made)
            register(SafeOptimizer)
            _CLASSES[base] = made
        return made


def _resolve(optimizer: Any) -> keras.optimizers.Optimizer:
    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise InvalidArgumentError(
                f"optimizer={k.short(optimizer)} is not a Keras optimizer identifier ({e})."
            ) from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a keras.optimizers.Optimizer (for example "
            f"keras.optimizers.Adam()), got {k.short(optimizer)}."
        )
    if isinstance(optimizer, SafeOptimizer):
        raise InvalidArgumentError(
            f"optimizer {optimizer.name!r} is already safe (SafeOptimizer returns the "
            "optimizer it makes safe); use it as it is."
        )
    return optimizer


def _make_safe(
    optimizer: keras.optimizers.Optimizer | str,
    *,
    accumulate_steps: int = 1,
    max_staleness: int | None = None,
    on_stale: str = "drop",
    nonfinite: str | None = None,
    deterministic: bool = True,
    name: str | None = None,
    **kwargs: Any,
) -> SafeOptimizer:
    """Implements ``SafeOptimizer(...)``: checks everything, then changes the class."""
    optimizer = _resolve(optimizer)
    k.check_settings(accumulate_steps, max_staleness, on_stale, nonfinite, deterministic, kwargs)
    if accumulate_steps > 1 and optimizer.gradient_accumulation_steps:
        raise InvalidArgumentError(
            f"accumulate_steps={accumulate_steps} and the optimizer's "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} would "
            "accumulate twice: use accumulate_steps (exact, order-independent, kept in "
            "safevars_state) or gradient_accumulation_steps (Keras' running sum, kept in "
            "the optimizer's variables), not both."
        )
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"name must be a str or None, got {k.short(name)}.")
    cls = _safe_class(type(optimizer))
    settings = {
        "accumulate_steps": int(accumulate_steps),
        "max_staleness": None if max_staleness is None else int(max_staleness),
        "on_stale": on_stale,
        "nonfinite": nonfinite,
        "deterministic": deterministic,
    }
    runtime = _Runtime(settings, name or optimizer.name)
    object.__setattr__(optimizer, "_safevars", runtime)
    try:
        optimizer.__class__ = cls
    except TypeError as e:
        object.__delattr__(optimizer, "_safevars")
        raise InvalidArgumentError(
            f"{type(optimizer).__name__} cannot be made safe: its instances have a memory "
            f"layout of their own ({e}). Define it without __slots__."
        ) from None
    if name is not None:
        optimizer.name = name
    return optimizer


def _nested_safe_optimizers(optimizer: Any) -> list[SafeOptimizer]:
    """Safe optimizers held by ``optimizer`` (LossScaleOptimizer, MultiOptimizer), deep."""
    found: list[SafeOptimizer] = []
    seen = {id(optimizer)}
    pending = [optimizer]
    while pending:
        current = pending.pop()
        for value in list(vars(current).values()):
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, keras.optimizers.Optimizer) and id(item) not in seen:
                    seen.add(id(item))
                    if isinstance(item, SafeOptimizer):
                        found.append(item)
                    pending.append(item)
    return found


def _make_accumulator(variables: list[Any], steps: int, deterministic: bool, name: str) -> Any:
    from safevars.accumulator import GradientAccumulator

    if any(tf.as_dtype(k.dtype_name(v)) == tf.float64 for v in variables):
        deterministic = False  # The exact sum covers float16, bfloat16 and float32.
    return GradientAccumulator(
        variables,
        reduction="mean",
        num_required=steps,
        deterministic=deterministic,
        name=f"{name}_accumulator",
    )


SafeOptimizer.__signature__ = inspect.signature(_make_safe)  # what SafeOptimizer(...) takes
