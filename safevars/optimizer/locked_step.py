"""The critical section of one call, and everything it does with every lock held.

:meth:`LockedStepPart._safevars_section` takes the locks: eagerly
:func:`safevars.locking.hold`, while tracing :func:`safevars.sections.graph_section`
(the update is traced inside the locks' mutexes; with ``lock_span="step"``, the default,
the forward pass's reads of the weights wait for the same section:
:mod:`safevars.sections.step_span`). Inside,
:meth:`LockedStepPart._safevars_locked_step` applies the policies in one trace-safe
path (decisions are Python values eagerly and tensors in a graph):

* staleness (``max_staleness`` with ``on_stale="drop" | "raise" | "scale"``; the lag
  measured in ``versions.py``, the refusal and the scale factor from
  :mod:`safevars.staleness`);
* non-finite gradients (``nonfinite="skip" | "raise"``);
* then the update (``accumulation.py``, ``keras_update.py``) unless dropped or skipped,
  and the counters last (``statistics.py``).

Every check runs before anything is written.
"""

from __future__ import annotations

import threading
from typing import Any

import tensorflow as tf

from safevars.errors import NonFiniteGradientError, assertion_text
from safevars.locking import hold
from safevars.optimizer.decisions import (
    all_finite,
    branch,
    logical_and,
    logical_not,
    refuse,
    scale,
    where,
    zero,
)
from safevars.optimizer.runtime import _COUNTERS, OptimizerPart, _Step
from safevars.sections import graph_section, step_span
from safevars.staleness import refuse_stale, stale_scale_factor

# The nonfinite="raise" refusal, eagerly (with a final period) and as a run-time
# assertion. No quotes: a graph's assertion message shows them escaped, as \'.
_NONFINITE = (
    "A gradient holds NaN or Inf and nonfinite=raise; nothing was applied. Use "
    "nonfinite=skip to skip such steps, or a LossScaleOptimizer for mixed precision"
)

# How many SafeOptimizer sections the calling thread is inside (running or tracing). A
# SafeOptimizer called by another one's update (LossScaleOptimizer or MultiOptimizer
# holding safe optimizers, inside a safe one) leaves the versions to the outermost.
_nesting = threading.local()


class LockedStepPart(OptimizerPart):
    """SafeOptimizer's part that takes the locks and runs the policies inside them."""

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
            return
        span = None
        if runtime.lock_span == "step":
            # The optimizer's own variables too: a read of ``iterations`` traced before
            # the update (a step number, a learning-rate schedule) is the step's.
            spanned = [*step.variables, *self.variables]
            span = step_span.plan(tf.compat.v1.get_default_graph(), spanned)
        if span is None:  # The lock is taken once every gradient is computed.
            graph_section(guards, body, after=step.grads)
        else:  # From the forward pass's reads to the last write (safevars.sections.step_span).
            graph_section(guards, body, after=span.after, gated=span.gated)

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
                checks.append(refuse_stale(staleness, runtime.max_staleness, "applied"))
            elif runtime.on_stale == "drop":
                keep = logical_not(stale)
                counts["dropped_stale"] = stale
            else:
                factor = where(stale, stale_scale_factor(staleness), 1.0)
                grads = [scale(g, factor) for g in grads]
                counts["scaled_stale"] = stale
        if runtime.nonfinite is not None:
            finite = all_finite(grads)
            if runtime.nonfinite == "raise":
                checks.append(
                    refuse(
                        logical_not(finite),
                        lambda: NonFiniteGradientError(f"{_NONFINITE}."),
                        assertion_text(NonFiniteGradientError, _NONFINITE),
                    )
                )
            else:
                counts["skipped_nonfinite"] = logical_and(keep, logical_not(finite))
                keep = logical_and(keep, finite)
        with tf.control_dependencies([c for c in checks if c is not None]):
            applied, accumulated = branch(
                keep,
                lambda: self._safevars_update(step, grads, strategy),
                lambda: (zero(), zero()),
            )
            counts["applied"] = applied
            counts["accumulated"] = accumulated
            self._safevars_count(counts)
