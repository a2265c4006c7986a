"""``accumulate_steps=k``: k calls averaged exactly, then one real update.

The pending gradients are in a :class:`~safevars.GradientAccumulator` made when the
optimizer is built (kept in :attr:`SafeOptimizer.safevars_state`, not among the
optimizer's variables). Every call adds to it inside the section; the call that
completes k takes the mean and applies it with Keras' update (``keras_update.py``).
Keras' own ``gradient_accumulation_steps`` is the other way, handled in
``keras_update.py``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars.errors import InvalidArgumentError
from safevars.optimizer.decisions import branch, one, zero
from safevars.optimizer.runtime import OptimizerPart, _Step
from safevars.optimizer.validation import dtype_name, name_of


def _make_accumulator(variables: list[Any], steps: int, deterministic: bool, name: str) -> Any:
    from safevars.accumulator import GradientAccumulator

    if any(tf.as_dtype(dtype_name(v)) == tf.float64 for v in variables):
        deterministic = False  # The exact sum covers float16, bfloat16 and float32.
    return GradientAccumulator(
        variables,
        reduction="mean",
        num_required=steps,
        deterministic=deterministic,
        name=f"{name}_accumulator",
    )


class AccumulationPart(OptimizerPart):
    """SafeOptimizer's part that accumulates (``accumulate_steps > 1``) or applies."""

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
            return one()

        return branch(ready, apply_mean, zero), one()

    def _safevars_check_same_variables(self, indices: frozenset[int]) -> None:
        """With accumulate_steps > 1 every call must update the same variables."""
        runtime = self._safevars
        with runtime.build_lock:
            if runtime.accumulated_set is None:
                runtime.accumulated_set = indices
                return
            expected = runtime.accumulated_set
        if indices != expected:
            names = [name_of(self._trainable_variables[i]) for i in sorted(indices ^ expected)]
            raise InvalidArgumentError(
                f"With accumulate_steps={runtime.accumulate_steps} every call must give "
                f"gradients for the same variables (the first call gave {len(expected)}); "
                f"this call differs in {names}. Give a gradient (not None) for the same "
                "variables in every call."
            )
