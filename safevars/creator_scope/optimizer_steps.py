"""A plain Keras optimizer's step over a model built in :func:`safevars.scope`: one
section, one version add, as a :class:`~safevars.SafeOptimizer` step.

``model.compile(optimizer="adam")`` in (or after) the scope makes a plain optimizer whose
slots are safe (:mod:`~safevars.creator_scope.slots`). Its ``apply`` is patched: when
the variables it updates are SafeVariable-backed, the whole call (Keras' update of every
variable and slot, weight decay, constraints, ``iterations``) runs as one critical
section over their lock, which in the scope is one lock for the model and its optimizer;
in a ``tf.function`` the section spans the step from the forward pass's reads of the
weights, as a SafeOptimizer's default ``lock_span="step"`` does
(:mod:`safevars.sections.step_span`). Each variable and slot the step wrote counts one
version, with one add where they share a joint counter. With Keras'
``gradient_accumulation_steps=k`` a version counts an applied update: the calls that
only accumulate add none (weights, slots and accumulators alike), eagerly, traced and
in ``fit``, as a SafeOptimizer counts them. Under a ``tf.distribute``
strategy (Keras' apply runs per replica) the update of the variables and slots, which
Keras runs once in cross-replica context, is that section instead.

What a plain optimizer does not get: a SafeOptimizer's policies (staleness, non-finite
gradients, exact accumulation), its statistics and ``version=``. Keras' optimizer writes
of a safe variable also read nothing back (:func:`write_without_reading`): Keras discards
the value, and the read would cost an op per write and make the next write of the
buffer copy it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars._tf_internal import KERAS_STEP_FUNCTIONS
from safevars.creator_scope.backing import guard_of_backing, guards_of_backings, safe_backing
from safevars.creator_scope.keras_classes import keras_classes
from safevars.creator_scope.slots import slots_of
from safevars.creator_scope.strategy_updates import cross_replica
from safevars.locking import (
    Guard,
    bump_eager_together,
    bump_graph_together,
    hold,
    join_versions,
)
from safevars.sections import graph_section, step_span
from safevars.variable import writes_counted_by_caller

__all__ = [
    "forget_step_guards",
    "plain_apply",
    "plain_update_step",
    "traced_by_user",
    "traced_plainly",
    "write_without_reading",
]


class StepGuards:
    """What a plain optimizer's step locks and counts, worked out once it is built.

    Attributes:
      locked: Every safe variable the step may write (the weights, the optimizer's own).
      counted: Those it counts once per step: the weights and their slots.
    """

    __slots__ = ("locked", "counted")

    def __init__(self, locked: list[Guard], counted: list[Guard]) -> None:
        self.locked = locked
        self.counted = counted


_STEP_GUARDS = "_safevars_step_guards"  # optimizer attribute: {variable ids: StepGuards}
_TRACED = "_safevars_traced_plainly"  # optimizer attribute: True once traced unlocked
# Optimizer attribute: True once traced unlocked into a function that is not Keras' own
# (Keras traces its train function again after safevars.protect; a user's is kept).
_TRACED_BY_USER = "_safevars_traced_by_user"
_stepping = threading.local()  # .depth: plain optimizer steps this thread is inside


def _depth() -> int:
    depth: int = getattr(_stepping, "depth", 0)
    return depth


def traced_plainly(optimizer: Any) -> bool:
    """Whether ``optimizer``'s plain update was traced into a ``tf.function`` (which keeps
    it unlocked if the optimizer is made safe afterwards)."""
    return bool(optimizer.__dict__.get(_TRACED, False))


def traced_by_user(optimizer: Any) -> bool:
    """Whether ``optimizer``'s plain update was traced into a ``tf.function`` other than
    Keras' own train function (one safevars cannot make trace again)."""
    return bool(optimizer.__dict__.get(_TRACED_BY_USER, False))


def _in_keras_step() -> bool:
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(graph, "name", None) in KERAS_STEP_FUNCTIONS:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def forget_step_guards(optimizer: Any) -> None:
    """Drops ``optimizer``'s cached step plans (its variables were protected since)."""
    optimizer.__dict__.pop(_STEP_GUARDS, None)


def step_guards(optimizer: Any, variables: list[Any]) -> StepGuards | None:
    """The guards of ``optimizer``'s step over ``variables`` (None: none is safe).

    Made once per set of variables; the weights and their slots get a joint version
    counter where they can (one add per step), unless Keras' gradient accumulation
    writes the slots on other calls than the weights.
    """
    cache = optimizer.__dict__.setdefault(_STEP_GUARDS, {})
    key = tuple(map(id, variables))
    if key in cache:
        return cache[key]
    weights = [g for g in map(guard_of_backing, variables) if g is not None]
    if not weights:
        cache[key] = None
        return None
    own = guards_of_backings(optimizer.variables)
    slots = [s for g in weights for s in slots_of(g) if id(s) in own]
    counted = weights + slots
    if not optimizer.gradient_accumulation_steps:
        join_versions(counted)
    found = cache[key] = StepGuards(list(dict.fromkeys([*weights, *own.values()])), counted)
    return found


def _applies(optimizer: Any) -> Any:
    """1 if the optimizer's next step applies an update, 0 if it only accumulates.

    With Keras' ``gradient_accumulation_steps=k`` (else always 1), decided from
    ``iterations`` before the step as Keras decides it: an ``int`` eagerly, an int64
    tensor while tracing (read before Keras increments ``iterations``). The caller
    holds the step's section.
    """
    every = getattr(optimizer, "gradient_accumulation_steps", None) if optimizer else None
    if not every:
        return 1
    if tf.executing_eagerly():
        return int((int(optimizer._iterations.numpy()) + 1) % every == 0)
    following = tf.cast(tf.convert_to_tensor(optimizer._iterations), tf.int64) + 1
    return tf.cast(tf.equal(following % every, 0), tf.int64)


def step_section(
    guards: StepGuards,
    call: Callable[[], Any],
    spanned: list[Any],
    after: Any,
    optimizer: Any = None,
) -> Any:
    """Runs ``call()`` (a plain optimizer's step) as one critical section over
    ``guards.locked``, counting one version per variable of ``guards.counted`` written.

    In a ``tf.function`` the section spans the step from the reads of ``spanned`` where
    :func:`~safevars.sections.step_span.plan` allows, else it waits for ``after``. With
    ``optimizer``'s ``gradient_accumulation_steps``, a call that only accumulates counts
    no version (:func:`_applies`).
    """

    def count(written: set[Guard]) -> list[Guard]:
        return [g for g in guards.counted if g in written]

    _stepping.depth = _depth() + 1
    try:
        if tf.executing_eagerly():
            with hold(guards.locked):
                applies = _applies(optimizer)
                with writes_counted_by_caller(guards.counted) as written:
                    result = call()
                if applies:
                    bump_eager_together(count(written), 1)
            return result

        def body() -> Any:
            graph = tf.compat.v1.get_default_graph()
            applies = _applies(optimizer)
            first = len(graph.get_operations())
            reads = [] if isinstance(applies, int) else [applies]
            with (
                tf.control_dependencies(reads),
                writes_counted_by_caller(guards.counted) as written,
            ):
                result = call()
            counted = count(written)
            if counted:
                with tf.control_dependencies(graph.get_operations()[first:]):
                    done = tf.no_op(name="safevars_step_done")
                bump_graph_together(counted, done, applies)
            return result

        span = step_span.plan(tf.compat.v1.get_default_graph(), spanned) if spanned else None
        if span is None:
            return graph_section(guards.locked, body, after=after)
        return graph_section(guards.locked, body, after=span.after, gated=span.gated)
    finally:
        _stepping.depth -= 1


def _is_safe_optimizer(optimizer: Any) -> bool:
    return getattr(optimizer, "_safevars", None) is not None  # its own section


def plain_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``Optimizer.apply``."""

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        if _is_safe_optimizer(self) or _depth():
            return original(self, grads, trainable_variables)
        if not tf.executing_eagerly():
            self.__dict__[_TRACED] = True
            if not _in_keras_step():
                self.__dict__[_TRACED_BY_USER] = True
        if trainable_variables is None or not cross_replica():
            return original(self, grads, trainable_variables)
        variables = list(trainable_variables)
        if not any(safe_backing(v) is not None for v in variables):
            return original(self, grads, variables)
        keras = keras_classes()
        if not self.built and keras is not None:
            with keras.name_scope(self.name, caller=self):  # as Keras' apply builds
                self.build(variables)
            self.built = True
        guards = step_guards(self, variables)
        if guards is None:
            return original(self, grads, variables)
        spanned = [*variables, *self.variables]  # (a read of iterations too)
        return step_section(
            guards, lambda: original(self, grads, variables), spanned, list(grads), self
        )

    apply.__wrapped__ = original  # type: ignore[attr-defined]
    apply._safevars = True  # type: ignore[attr-defined]
    return apply


def plain_update_step(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``TFOptimizer._distributed_tf_update_step`` (cross-replica context,
    under a strategy too)."""

    def update(self: Any, distribution: Any, grads_and_vars: Any, learning_rate: Any) -> Any:
        pairs = list(grads_and_vars)
        if _is_safe_optimizer(self) or _depth():
            return original(self, distribution, pairs, learning_rate)
        guards = step_guards(self, [v for _, v in pairs]) if pairs else None
        if guards is None:
            return original(self, distribution, pairs, learning_rate)
        return step_section(
            guards,
            lambda: original(self, distribution, pairs, learning_rate),
            [],
            [g for g, _ in pairs],
        )

    update.__wrapped__ = original  # type: ignore[attr-defined]
    update._safevars = True  # type: ignore[attr-defined]
    return update


def write_without_reading(original: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wraps Keras' ``TFOptimizer.assign``/``assign_add``/``assign_sub`` (``method``): a
    dense write of a SafeVariable-backed variable reads nothing back."""

    def write(self: Any, variable: Any, value: Any) -> Any:
        backing = safe_backing(variable)
        if backing is None or isinstance(value, tf.IndexedSlices):
            return original(self, variable, value)
        getattr(backing, method)(tf.cast(value, backing.dtype), read_value=False)
        return None

    write.__wrapped__ = original  # type: ignore[attr-defined]
    write._safevars = True  # type: ignore[attr-defined]
    return write
