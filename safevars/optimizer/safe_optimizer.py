"""The class users call: ``SafeOptimizer``, its settings, build and update entry points.

:class:`SafeOptimizer` is assembled from one part per concern (each a class of methods
in its own module, listed in its bases); this module holds its public surface:

* the settings (read-only properties) and :attr:`SafeOptimizer.safevars_state`;
* :meth:`SafeOptimizer.build`, which also makes the locks (one shared lock where
  :func:`safevars.locking.share_lock` allows it);
* :meth:`SafeOptimizer.apply_gradients` and :meth:`SafeOptimizer.apply`, and the
  dispatch of a validated call: into cross-replica context, to the parameter-server
  coordinator's path, or straight into the section.

``SafeOptimizer(opt)`` itself (the class switch) is in ``class_switch.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import keras
import tensorflow as tf

from safevars import locking
from safevars._validation import short
from safevars.creator_scope import STEP_GUARD_HOOKS, slots_of
from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.optimizer.accumulation import AccumulationPart, _make_accumulator
from safevars.optimizer.class_switch import _make_safe, _SafeOptimizerType, register_root
from safevars.optimizer.coordinator import CoordinatorPart
from safevars.optimizer.decisions import in_xla_context
from safevars.optimizer.keras_update import KerasUpdatePart
from safevars.optimizer.locked_step import LockedStepPart
from safevars.optimizer.runtime import SafevarsState, _Runtime
from safevars.optimizer.serialization import MODULE, SerializationPart, register
from safevars.optimizer.statistics import StatisticsPart
from safevars.optimizer.strategies import StrategiesPart, current_strategy
from safevars.optimizer.validation import ValidationPart, check_variable, for_keras, name_of
from safevars.optimizer.versions import VersionsPart
from safevars.optimizer.whole_state import WholeStatePart
from safevars.variable import SafeVariable, wrap

__all__ = ["SafeOptimizer"]


@register
class SafeOptimizer(
    ValidationPart,
    VersionsPart,
    StrategiesPart,
    CoordinatorPart,
    LockedStepPart,
    AccumulationPart,
    KerasUpdatePart,
    StatisticsPart,
    WholeStatePart,
    SerializationPart,
    keras.optimizers.Optimizer,
    metaclass=_SafeOptimizerType,
):
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
      lock_span: How much of a step traced in a ``tf.function`` runs under the lock.
        ``"step"`` (default): from the forward pass's reads of the weights to the last
        write of the update, so the gradients applied are those of the weights updated
        and the update overlaps the backward pass as in the plain step; threads running
        traced steps on the same model take turns for whole steps (as XLA-compiled steps
        do). ``"update"``: only once every gradient is computed, so threads' forward and
        backward passes overlap (Hogwild-style), at the cost of the update waiting for
        the last gradient. Eager calls lock the update only, either way. See
        :mod:`safevars.sections.step_span` for when ``"step"`` falls back to ``"update"``.
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

    # Saved in Keras configs ("module") and pickles: the public path, not this file.
    __module__ = MODULE

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
    lock_span = property(lambda self: self._safevars.lock_span, doc="``lock_span`` (read-only).")

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
            check_variable(variable, f"variables[{index}]")
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.ready:
                return
            keras_variables = [for_keras(v) for v in variables]
            if self.built:
                known = self._trainable_variables_indices
                unknown = [name_of(v) for v in keras_variables if self._var_key(v) not in known]
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
        # The optimizer's own variables made safe (in safevars.scope(): its slots,
        # iterations): the section holds their locks too, and a step counts each slot
        # it wrote once, with the variable the slot is for.
        own = {id(g): g for g in map(_safe_guard, self.variables) if g is not None}
        runtime.slots = {g: [s for s in slots_of(g) if id(s) in own] for g in guards}
        fixed = [runtime.state_guard, *nested, *own.values()]
        if runtime.accumulate_steps > 1:
            accumulator = _make_accumulator(
                trainables, runtime.accumulate_steps, runtime.deterministic, self.name
            )
            runtime.state.accumulator = accumulator
            runtime.accumulator = accumulator
            # The pending gradients are training state: a checkpoint of the optimizer
            # alone resumes exactly (a restore made before this build is applied now).
            self._track_trackable(accumulator, name="safevars_accumulation", overwrite=True)
        share = getattr(locking, "share_lock", None)
        runtime.shared = bool(share(guards + fixed)) if share is not None else False
        if runtime.shared and not self.gradient_accumulation_steps:
            # A step writing every variable (and its slots): one add.
            slots = [s for g in guards for s in runtime.slots[g]]
            locking.join_versions(guards + slots)
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
                    f"{short(pair)}. Pass zip(gradients, variables)."
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
        strategy = current_strategy()
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
        if asserts and in_xla_context():
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


def _safe_guard(variable: Any) -> Any:
    """The guard of a variable that is safe already (SafeVariable-backed), or None."""
    backing = getattr(variable, "_value", variable)
    return backing.guard if isinstance(backing, SafeVariable) else None


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


register_root(SafeOptimizer)  # The root-class hook: class_switch derives from it.
# What SafeOptimizer(...) takes and returns (_make_safe cannot name SafeOptimizer).
SafeOptimizer.__signature__ = inspect.signature(_make_safe).replace(
    return_annotation="SafeOptimizer"
)


def _bookkeeping_guards(optimizer: Any) -> list[Any]:
    """A safe optimizer's own state guards, for a train step's section (the hook)."""
    runtime = getattr(optimizer, "_safevars", None)
    if runtime is None:
        return []
    return [runtime.state_guard, *runtime.fixed_guards]


STEP_GUARD_HOOKS.append(_bookkeeping_guards)
