"""``model.fit``'s step of a model built in :func:`safevars.scope`: one section, whole.

Keras' train step reads the weights (forward pass), updates a metric (the loss tracker,
made in the scope when the model is compiled there), then applies the gradients. A
section opened only at the update would leave the forward pass out of it, and the
metric's own section in between would stop a step's section from spanning back to the
forward pass (:mod:`safevars.sections.step_span`). So ``make_train_function`` is patched:
a model with SafeVariable-backed weights gets a train step that is one critical section
over every safe variable it may write (the model's, its optimizer's, its metrics'; one
lock in the scope), taken before the forward pass. Concurrent ``fit`` steps are then
serializable, and a traced step holds one ``MutexLock`` however many variables the model
has. The optimizer of a built model is built before the section, as its first update
would build it inside, so a :class:`~safevars.SafeOptimizer` joins its bookkeeping to the
model's lock.

Also for any model: ``fit`` traces its step again when ``model.optimizer`` was made safe
(its class changed) since the step was traced, so an optimizer made safe between two
``fit`` calls does not keep the plain, unlocked update of the first.

Under a ``tf.distribute`` strategy the step runs per replica: each update locks itself
there (a SafeOptimizer's step is one section, in cross-replica context).

``reset_metrics`` (which ``train_on_batch`` and ``test_on_batch`` call before every step,
``fit`` and ``evaluate`` once an epoch) resets every metric under their locks at once,
one eager section instead of one per metric variable: a snapshot or locked read in
another thread never sees some metrics reset and others not, and the reset takes the
lock once. With the lock in run-time mode each acquisition is an eager ``MutexLock``:
resetting a loss and a mean absolute error (4 variables) took 1,116 µs against
293-306 µs plain, and takes 556-605 µs; a ``train_on_batch`` step of a 22-variable MLP
compiled with that metric took 1.58-1.61x the plain step, and takes 1.22-1.25x
(2026-11-30, 2 cores). The variables of a metric Keras builds inside the first traced
step (``UnliftedInitializerVariable``) are written by the direct kernel path too: with
it, a 20-variable MLP's reset took 667 µs against 748 µs, and its ``train_on_batch`` step
1.16x against 1.23x the plain step (median of 15 interleaved rounds, one process,
2026-11-30). Since eager sections take the mutex only while a call of a graph taking it
runs (:mod:`safevars.locking.runtime_mode`), the reset between two steps takes none:
321 µs against 523 µs (plain 288 µs), the step 1.07x against 1.20x plain (same
measurement). A model class that overrides ``reset_metrics`` without calling
``super().reset_metrics()`` resets its metrics as it writes them: each write locked and
counted, one after another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars.creator_scope.backing import guards_of_backings, safe_backing
from safevars.locking import Guard, hold
from safevars.sections import graph_section

__all__ = ["STEP_GUARD_HOOKS", "LockedTrainStep", "make_train_function", "reset_metrics"]

STEP_GUARD_HOOKS: list[Callable[[Any], list[Guard]]] = []
"""The registered hooks a train step's section calls up through: each gives, for an
optimizer, guards its step takes besides those of its variables (a SafeOptimizer's
bookkeeping, registered by :mod:`safevars.optimizer`)."""

_TRACED_WITH = "_safevars_train_optimizer_class"  # model attribute


def step_guards(model: Any) -> list[Guard]:
    """The guards of every safe variable a Keras train step of ``model`` may write."""
    optimizer = getattr(model, "optimizer", None)
    variables = [*model.weights, *getattr(model, "metrics_variables", ())]
    if optimizer is not None:
        variables += list(optimizer.variables)
    guards = guards_of_backings(variables)
    if optimizer is not None:
        for hook in STEP_GUARD_HOOKS:
            guards.update((id(g), g) for g in hook(optimizer))
    return list(guards.values())


class LockedTrainStep:
    """A model's ``train_step``, run as one critical section (see the module docstring)."""

    __slots__ = ("model", "step", "__wrapped__")

    def __init__(self, model: Any, step: Callable[[Any], Any]) -> None:
        self.model = model
        self.step = step
        self.__wrapped__ = step

    def __call__(self, data: Any) -> Any:
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            return self.step(data)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built and self.model.built:
            # Only for a built model: a subclassed one is built by its first traced step
            # (Keras defers it there without a strategy), and an optimizer built before
            # would know only the weights made so far ("Unknown variable" after).
            with tf.init_scope():
                optimizer.build(self.model.trainable_variables)
        guards = step_guards(self.model)
        if not guards:
            return self.step(data)
        if tf.executing_eagerly():
            with hold(guards):
                return self.step(data)
        return graph_section(guards, lambda: self.step(data))


def make_train_function(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``Trainer.make_train_function``."""

    def make_train_function(self: Any, force: bool = False) -> Any:
        optimizer_class = type(getattr(self, "optimizer", None))
        if self.__dict__.get(_TRACED_WITH, optimizer_class) is not optimizer_class:
            force = True  # the optimizer was made safe since the step was traced
        step = self.__dict__.get("train_step")
        if not isinstance(step, LockedTrainStep) and any(
            safe_backing(v) is not None for v in self.weights
        ):
            # An instance attribute: every Keras version's train function looks it up.
            object.__setattr__(self, "train_step", LockedTrainStep(self, self.train_step))
        function = original(self, force)
        self.__dict__[_TRACED_WITH] = optimizer_class
        return function

    make_train_function.__wrapped__ = original  # type: ignore[attr-defined]
    make_train_function._safevars = True  # type: ignore[attr-defined]
    return make_train_function


def reset_metrics(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``Trainer.reset_metrics``: one eager section over every safe metric
    variable (see the module docstring). In a graph, and for a model without safe metric
    variables, it is Keras' own."""

    def reset_metrics(self: Any) -> Any:
        if not tf.executing_eagerly():
            return original(self)
        guards = guards_of_backings(getattr(self, "metrics_variables", ()))
        if not guards:
            return original(self)
        with hold(list(guards.values())):
            return original(self)

    reset_metrics.__wrapped__ = original  # type: ignore[attr-defined]
    reset_metrics._safevars = True  # type: ignore[attr-defined]
    return reset_metrics
