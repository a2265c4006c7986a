"""Installing this package's patches of TensorFlow's and Keras' classes (idempotent).

Installed when :mod:`safevars` is imported (as :mod:`safevars.sections` patches compiled
calls), and again by :func:`safevars.scope` (for Keras imported afterwards). Each patch
changes nothing for variables that are not SafeVariables, and a patched method is never
patched twice (it carries ``_safevars``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars._tf_internal import keras_clone_model_homes, keras_model_files, saved_model_loader
from safevars.creator_scope import (
    keras_variables,
    marks,
    model_files,
    optimizer_steps,
    protection,
    train_steps,
)
from safevars.creator_scope.creators import reenter_after_reset
from safevars.creator_scope.keras_classes import keras_classes
from safevars.creator_scope.slots import add_variable_from_reference
from safevars.creator_scope.strategy_updates import update_under_lock
from safevars.locking.saved_model import restores_without_versions, tracks_guarded_state

__all__ = ["install"]

_INSTALL_LOCK = threading.Lock()
_TRAINING_ENTRIES = (
    "compile",
    "fit",
    "train_on_batch",
    "evaluate",
    "test_on_batch",
    "predict",
    "predict_on_batch",
)
_KERAS_DONE: list[bool] = []


def _patch(
    owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    current = getattr(owner, name)  # may be inherited: the patch then overrides it on owner
    if not getattr(current, "_safevars", False):
        setattr(owner, name, make(current))


def _surviving_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``tf.compat.v1.reset_default_graph`` (``keras.backend.clear_session()``):
    the :func:`safevars.scope` blocks open in this thread stay open on the new graph."""

    def reset_default_graph() -> Any:
        result = original()
        reenter_after_reset()
        return result

    reset_default_graph.__wrapped__ = original  # type: ignore[attr-defined]
    reset_default_graph._safevars = True  # type: ignore[attr-defined]
    return reset_default_graph


def _without_reading(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    return optimizer_steps.write_without_reading(original, method)


def install() -> None:
    """Installs the patches (idempotent); without Keras, only TensorFlow's."""
    with _INSTALL_LOCK:
        _patch(tf.distribute.StrategyExtended, "update", update_under_lock)
        _patch(tf.compat.v1, "reset_default_graph", _surviving_reset)
        _patch(saved_model_loader(), "_restore_checkpoint", restores_without_versions)
        if _KERAS_DONE:
            return
        keras = keras_classes()
        if keras is None:  # pragma: no cover - Keras is not installed
            return
        _patch(keras.optimizer_class, "add_variable_from_reference", add_variable_from_reference)
        _patch(keras.optimizer_class, "apply", optimizer_steps.plain_apply)
        _patch(
            keras.optimizer_class, "_distributed_tf_update_step", optimizer_steps.plain_update_step
        )
        for method in ("assign", "assign_add", "assign_sub"):
            _patch(keras.optimizer_class, method, functools.partial(_without_reading, method))
        _patch(keras.trainer_class, "make_train_function", train_steps.make_train_function)
        _patch(keras.base_trainer_class, "reset_metrics", train_steps.reset_metrics)
        _patch(
            keras.variable_class,
            "assign_add",
            lambda original: keras_variables.read_modify_write(original, "add"),
        )
        _patch(
            keras.variable_class,
            "assign_sub",
            lambda original: keras_variables.read_modify_write(original, "subtract"),
        )
        _patch(keras.variable_class, "_trackable_children", keras_variables.trackable_children)
        _patch(keras.export_archive_class, "_filter_and_track_resources", tracks_guarded_state)
        # Protection that follows a model made in a block, or protected, wherever Keras
        # creates its variables later (marks.py, protection.py, model_files.py).
        _patch(keras.variable_class, "_initialize", marks.initialize)
        for owner in (keras.layer_class, keras.base_optimizer_class, keras.metric_class):
            _patch(owner, "__init__", marks.constructed)
        for entry in _TRAINING_ENTRIES:
            owner = keras.base_trainer_class if entry == "compile" else keras.trainer_class
            _patch(owner, entry, functools.partial(protection.protecting_entry, entry))
        files = keras_model_files()
        _patch(files, "_serialize_model_as_json", model_files.marking_metadata)
        _patch(files, "_load_model_from_fileobj", model_files.loading_from_fileobj)
        _patch(files, "_load_model_from_dir", model_files.loading_from_dir)
        homes = keras_clone_model_homes()
        clone = model_files.cloning(getattr(homes[0], "clone_model"))  # noqa: B009
        for home in homes:
            if not getattr(getattr(home, "clone_model"), "_safevars", False):  # noqa: B009
                setattr(home, "clone_model", clone)  # noqa: B010
        _KERAS_DONE.append(True)


install()
