"""The counters of a SafeOptimizer: written last in each section, read as a frozen record.

The counters live in one int64 variable (see ``_COUNTERS`` in ``runtime.py`` for their
order) guarded by the optimizer's state lock; :class:`OptimizerStatistics` is the record
:meth:`SafeOptimizer.statistics` returns, with the accumulator's pending count added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from safevars._tf_internal import resource_variable_ops
from safevars.locking import hold
from safevars.optimizer.runtime import _COUNTERS, OptimizerPart
from safevars.sections import graph_section

__all__ = ["OptimizerStatistics"]

# Eager constant deltas of the counters, by value (a handful of combinations).
_DELTAS: dict[tuple[int, ...], tf.Tensor] = {}


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


def add_counts(variable: Any, delta: Any) -> Any:
    """``variable += delta`` for the int64 counters (one kernel for a plain variable)."""
    if isinstance(variable, resource_variable_ops.ResourceVariable) and not isinstance(
        variable, tf.distribute.DistributedValues
    ):
        return tf.raw_ops.AssignAddVariableOp(resource=variable.handle, value=delta)
    return variable.assign_add(delta, read_value=False)


class StatisticsPart(OptimizerPart):
    """SafeOptimizer's part that writes and reads the counters."""

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
            return OptimizerStatistics._make([*values[:3], pending, *values[3:]])
        values = tf.unstack(tf.convert_to_tensor(runtime.counters))
        pending = (
            tf.cast(accumulator.count, tf.int64)
            if accumulator is not None
            else tf.constant(0, tf.int64)
        )
        return OptimizerStatistics._make([*values[:3], pending, *values[3:]])

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
        written = add_counts(runtime.counters, delta)
        if tf.executing_eagerly():
            runtime.state_guard.bump_eager(1)
        else:
            runtime.state_guard.bump_graph(written)
