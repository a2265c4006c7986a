"""Keras variables backed by SafeVariables: atomic ``assign_add``/``assign_sub``, their
versions in checkpoints and their locks in SavedModels.

* ``keras.Variable.assign_add``/``assign_sub`` (metrics, ``iterations``), which Keras
  implements as a read followed by an ``assign``, become one atomic
  :meth:`~safevars.SafeVariable.update` with Keras' own arithmetic.
* ``tf.train.Checkpoint`` and ``tf.saved_model.save`` ask the Keras variable, not the
  SafeVariable it holds, for its dependencies. For a checkpoint the Keras variable names
  the version too, so a restore brings back the version with the value; for a
  SavedModel it names what the SafeVariable's traced writes capture (its version, its
  lock's mutex and gate: :func:`~safevars.locking.saved_model.saved_guards`), as the
  SafeVariable does, so a function that writes it (a layer's state) exports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars.creator_scope.keras_classes import keras_classes
from safevars.distribute import merge_context
from safevars.locking import Guard
from safevars.locking.saved_model import restoring_saved_model, saved_guards
from safevars.variable import SafeVariable

__all__ = ["read_modify_write", "trackable_children"]


def read_modify_write(original: Callable[..., Any], op_name: str) -> Callable[..., Any]:
    """Wraps ``keras.Variable.assign_add`` (``op_name`` "add") or ``assign_sub``
    ("subtract")."""

    def method(self: Any, value: Any) -> Any:
        backing = getattr(self, "_value", None)
        keras = keras_classes()
        if not isinstance(backing, SafeVariable) or keras is None or keras.in_stateless_scope():
            return original(self, value)
        if backing._self_mirrored and merge_context(backing.__wrapped__) is not None:
            # Inside strategy.run the write is merged by the variable's aggregation, as
            # Keras' own assign does; keep its semantics (locked and counted already).
            return original(self, value)
        combine = getattr(keras.ops, op_name)

        def fn(current: tf.Tensor) -> tf.Tensor:
            new = combine(self._maybe_autocast(current), value)  # Keras' self + value
            new = self._convert_to_tensor(new, dtype=self._dtype)
            return tf.cast(new, backing.dtype)  # as Keras' _direct_assign

        return backing.update(fn)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method._safevars = True  # type: ignore[attr-defined]
    return method


def trackable_children(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``keras.Variable._trackable_children``: a SafeVariable-backed variable also
    names its version in checkpoints (without this, a restore brought the value back and
    left the version where it was) and, in SavedModels, what its traced writes capture
    (without this, exporting a function that writes it failed: "references an
    'untracked' resource", the lock's mutex)."""

    def _trackable_children(self: Any, save_type: str = "checkpoint", **kwargs: Any) -> Any:
        children = original(self, save_type, **kwargs)
        guard = getattr(getattr(self, "_value", None), "_self_guard", None)
        if not isinstance(guard, Guard):
            return children
        if save_type == "savedmodel":
            return {**children, "safevars": saved_guards([guard])}
        if save_type != "checkpoint" or restoring_saved_model():
            return children
        guard.sync_version_var()
        return {**children, "safevars_version": guard.version_var}

    _trackable_children._safevars = True  # type: ignore[attr-defined]
    return _trackable_children
