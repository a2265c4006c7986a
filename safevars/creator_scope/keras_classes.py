"""The Keras classes and functions this package patches or calls (Keras 3, TensorFlow
backend), reached through the door to private APIs once Keras is imported."""

from __future__ import annotations

import threading

from safevars._tf_internal import keras_export_archive, keras_internal

__all__ = ["KerasClasses", "keras_classes"]


class KerasClasses:
    """What the patches reach of Keras: its ops, scopes and the classes they patch."""

    def __init__(self) -> None:
        import keras

        self.ops = keras.ops
        self.name_scope = keras_internal("backend").name_scope
        self.in_stateless_scope = keras_internal(
            "backend.common.stateless_scope"
        ).in_stateless_scope
        self.variable_class = keras_internal("backend.tensorflow.core").Variable
        self.optimizer_class = keras_internal("backend.tensorflow.optimizer").TFOptimizer
        self.trainer_class = keras_internal("backend.tensorflow.trainer").TensorFlowTrainer
        # Keras compares a model's compile with this class's (Trainer.compile) to tell a
        # custom one: a patch of compile goes there, not on the backend's trainer.
        self.base_trainer_class = keras_internal("trainers.trainer").Trainer
        # The bases whose objects create variables: what a block marks (marks.py).
        self.layer_class = keras.layers.Layer
        self.base_optimizer_class = keras_internal("optimizers.base_optimizer").BaseOptimizer
        self.metric_class = keras.metrics.Metric
        self.export_archive_class = keras_export_archive()


_CLASSES: list[KerasClasses] = []
_LOCK = threading.Lock()


def keras_classes() -> KerasClasses | None:
    """The Keras classes, made on first use; None when Keras is not installed."""
    with _LOCK:
        if not _CLASSES:
            try:
                _CLASSES.append(KerasClasses())
            except ImportError:  # pragma: no cover - Keras is not installed
                return None
        return _CLASSES[0]
