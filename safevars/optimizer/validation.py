"""Every check that runs before anything changes: settings, variables, gradients, calls.

Each error names the argument, the value received and the fix. A call that passes
:meth:`ValidationPart._safevars_validate` becomes a :class:`~runtime._Step`; the first
one builds the optimizer (as Keras' first ``apply`` does).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from safevars._tf_internal import sharded_variable
from safevars._validation import check_bool, check_choice, check_int, short
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedStrategyError,
)
from safevars.optimizer.runtime import OptimizerPart, _Step
from safevars.optimizer.versions import normalize_versions
from safevars.staleness import check_stale_policy
from safevars.variable import SafeVariable

NONFINITE_POLICIES = ("skip", "raise")
"""The values ``nonfinite`` accepts besides ``None`` (no check, the default)."""

LOCK_SPANS = ("step", "update")
"""The values ``lock_span`` accepts (:mod:`safevars.sections.step_span`)."""


def check_settings(
    accumulate_steps: Any,
    max_staleness: Any,
    on_stale: Any,
    nonfinite: Any,
    deterministic: Any,
    kwargs: dict[str, Any],
    lock_span: Any = "step",
) -> dict[str, Any]:
    """Checks SafeOptimizer's own arguments (nothing is changed before they pass).

    Returns:
      The settings, normalised (Python ``int`` s and ``bool`` s), as the optimizer keeps
      them: ``accumulate_steps``, ``max_staleness``, ``on_stale``, ``nonfinite``,
      ``deterministic``, ``lock_span``.

    Raises:
      InvalidArgumentError: an argument is out of range, or ``kwargs`` is not empty (an
        optimizer argument given to SafeOptimizer).
    """
    accumulate_steps = check_int(
        accumulate_steps,
        "accumulate_steps",
        1,
        fix="It is the number of calls averaged into one update (1: no accumulation).",
    )
    max_staleness, on_stale = check_stale_policy(max_staleness, on_stale)
    if nonfinite is not None:
        nonfinite = check_choice(
            nonfinite, "nonfinite", NONFINITE_POLICIES, fix="None (the default) does not check."
        )
    deterministic = check_bool(deterministic, "deterministic")
    lock_span = check_choice(
        lock_span,
        "lock_span",
        LOCK_SPANS,
        fix='"step" locks a traced step from its reads of the weights; "update" only '
        "once every gradient is computed.",
    )
    for key, value in kwargs.items():
        raise InvalidArgumentError(
            f"SafeOptimizer does not take {key}={short(value)}: set it on the optimizer "
            "you make safe (for example keras.optimizers.Adam(..., "
            f"{key}=...)), or as an attribute of the safe optimizer afterwards."
        )
    return {
        "accumulate_steps": accumulate_steps,
        "max_staleness": max_staleness,
        "on_stale": on_stale,
        "nonfinite": nonfinite,
        "deterministic": deterministic,
        "lock_span": lock_span,
    }


def is_variable(value: Any) -> bool:
    return isinstance(value, (tf.Variable, keras.Variable))


def check_variable(variable: Any, where: str) -> None:
    if isinstance(variable, sharded_variable.ShardedVariableMixin):
        raise UnsupportedStrategyError(
            f"{where} is a ShardedVariable (ParameterServerStrategy with a "
            "variable_partitioner). SafeOptimizer locks whole variables and does not "
            "support sharded ones: create the ParameterServerStrategy without "
            "variable_partitioner."
        )
    if not is_variable(variable):
        raise InvalidArgumentError(
            f"{where} must be a variable (keras.Variable, tf.Variable or "
            f"safevars.SafeVariable), got {short(variable)}."
        )


def for_keras(variable: Any) -> Any:
    """What Keras' update is given: the raw variable, so each write is counted once."""
    if isinstance(variable, SafeVariable):
        return variable.__wrapped__
    return variable


def name_of(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "variable"))


def dtype_name(variable: Any) -> str:
    dtype = variable.dtype
    return getattr(dtype, "name", str(dtype))


def check_gradient(grad: Any, variable: Any, where: str) -> Any:
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
        if (
            shape.rank is not None
            and values.shape.rank is not None
            and (
                values.shape.rank != shape.rank
                or not values.shape[1:].is_compatible_with(shape[1:])
            )
        ):
            raise ShapeMismatchError(
                f"{where}: the IndexedSlices gradient has values of shape "
                f"{values.shape.as_list()}, which do not fit variable {name_of(variable)!r} "
                f"of shape {shape.as_list()}."
            )
        return grad
    if not isinstance(grad, tf.Tensor):
        try:
            grad = tf.convert_to_tensor(grad)
        except (TypeError, ValueError) as e:
            raise DTypeMismatchError(
                f"{where}: the gradient {short(grad)} cannot be converted to a tensor ({e})."
            ) from None
    if not grad.dtype.is_floating:
        raise DTypeMismatchError(
            f"{where}: the gradient has dtype {grad.dtype.name}; gradients must be "
            f"floating point (variable {name_of(variable)!r} is {dtype_name(variable)})."
        )
    if not grad.shape.is_compatible_with(shape):
        raise ShapeMismatchError(
            f"{where}: the gradient has shape {grad.shape.as_list()} but variable "
            f"{name_of(variable)!r} has shape {shape.as_list()}."
        )
    return grad


class ValidationPart(OptimizerPart):
    """SafeOptimizer's part that checks a call and makes it a :class:`_Step`."""

    def _safevars_validate(
        self, grads: list[Any], variables: list[Any], version: Any, where: str
    ) -> _Step:
        """Checks everything checkable before the section; builds on the first call."""
        for index, variable in enumerate(variables):
            check_variable(variable, where.format(index))
        versions = normalize_versions(version, len(variables))
        kept = [i for i, g in enumerate(grads) if g is not None]
        if not kept:
            raise InvalidArgumentError(
                "No gradients provided for any variable. Every gradient given is None; "
                "if you use model.compile(), did you forget the loss?"
            )
        checked = [check_gradient(grads[i], variables[i], where.format(i)) for i in kept]
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
                    f"{where.format(i)}: Unknown variable {name_of(variable)!r}: this "
                    f"optimizer can only be called for the {len(known)} variables it was "
                    "built with (the first apply or build() fixes them). For a new set of "
                    "variables, make a new optimizer."
                )
            if grads[i] is not None:
                if key in seen:
                    raise InvalidArgumentError(
                        f"{where.format(i)}: variable {name_of(variable)!r} is listed twice "
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
            keras_variables=[for_keras(v) for v in variables],
            guards=[runtime.guards[self._get_variable_index(variables[i])] for i in kept],
            versions=step_versions,
        )
