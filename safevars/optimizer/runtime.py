"""What a safe optimizer keeps besides Keras' state, and one validated call.

* :class:`_Runtime`: the Python-side state of one :class:`~safevars.SafeOptimizer` (its
  settings, guards, counters variable, caches), kept out of Keras' and TensorFlow's
  tracking under the optimizer's ``_safevars`` attribute.
* :class:`SafevarsState`: the trackable holding safevars' bookkeeping (counters, pending
  accumulation), checkpointed only when the user adds it.
* :class:`_Step`: one call, validated before the section.
* :class:`OptimizerPart`: the base of the classes :class:`~safevars.SafeOptimizer` is
  assembled from (one per concern, each in its own module).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from safevars.locking import Guard
from safevars.variable import wrap

# Order of the counters in the int64 statistics variable.
_COUNTERS = (
    "calls",
    "applied",
    "accumulated",
    "dropped_stale",
    "scaled_stale",
    "skipped_nonfinite",
)


class OptimizerPart(keras.optimizers.Optimizer):
    """Base of the parts of :class:`~safevars.SafeOptimizer`: methods only, never made.

    Each part holds the methods of one concern (the locked step, statistics, the
    parameter-server coordinator path, ...); ``SafeOptimizer`` derives from all of them.
    A part is a Keras optimizer class so that ``SafeOptimizer[Adam]`` keeps ``Adam``'s
    memory layout (``opt.__class__`` can only be switched between classes of one
    layout, which a part deriving from ``object`` would change) and so that each part
    type-checks as one. In ``SafeOptimizer[Adam]``'s method resolution order the parts
    come before ``Adam``: their ``super()`` calls reach ``Adam``'s methods.
    """

    _safevars: _Runtime
    _safevars_base: type


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
        "lock_span",
        "build_lock",
        "ready",
        "guards",
        "state_guard",
        "fixed_guards",
        "slots",
        "shared",
        "accumulator",
        "accumulated_set",
        "coordinator_fns",
        "counters",
        "strategy",
        "state",
    )

    # The settings, from ``settings`` (checked by SafeOptimizer(...)).
    accumulate_steps: int
    max_staleness: int | None
    on_stale: str
    nonfinite: str | None
    deterministic: bool
    lock_span: str

    def __init__(self, settings: dict[str, Any], name: str) -> None:
        for key, value in settings.items():
            setattr(self, key, value)
        self.build_lock = threading.Lock()
        self.ready = False  # Set last by the first build.
        self.guards: list[Guard] = []  # one per built variable, in Keras' order
        self.fixed_guards: list[Guard] = []  # state guard, nested optimizers' states
        self.slots: dict[Guard, list[Guard]] = {}  # guard -> its safe slots' guards
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
