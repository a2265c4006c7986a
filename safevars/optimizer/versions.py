"""The ``version=`` argument: its forms, checked before the section, and the staleness.

A call may say what its gradients were computed from: one int (compared with
``iterations``) or one entry per pair (a SafeVariable's ``.version``, a
:class:`~safevars.Snapshot` or ``None``). :func:`normalize_versions` checks and
normalises it before anything changes; inside the section
:meth:`VersionsPart._safevars_staleness` measures how many updates behind the gradients
are, which the ``max_staleness`` / ``on_stale`` policy (in ``locked_step.py``) acts on.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from safevars._validation import short
from safevars.errors import InvalidArgumentError
from safevars.optimizer.decisions import numpy_of
from safevars.optimizer.runtime import OptimizerPart, _Step
from safevars.snapshot import Snapshot


def _version_value(value: Any, where: str) -> Any:
    if isinstance(value, Snapshot):
        value = value.version
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where} must be an int version, got {value!r}.")
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise InvalidArgumentError(f"{where} must be >= 0, got {value}.")
        return int(value)
    if isinstance(
        value, (tf.Tensor, tf.Variable, keras.Variable, tf.distribute.DistributedValues)
    ):
        dtype = tf.as_dtype(value.dtype)
        if not dtype.is_integer or (value.shape.rank not in (None, 0)):
            raise InvalidArgumentError(
                f"{where} must be an integer scalar, got a {dtype.name} tensor of shape "
                f"{value.shape}."
            )
        if tf.executing_eagerly() and not isinstance(value, tf.distribute.DistributedValues):
            return _version_value(int(numpy_of(value)), where)
        return tf.cast(value, tf.int64)
    raise InvalidArgumentError(
        f"{where} must be an int, an integer tensor or a safevars.Snapshot, got {short(value)}."
    )


def normalize_versions(version: Any, count: int) -> tuple[str, Any] | None:
    """``None``, ``("global", v)`` or ``("each", [v or None per pair])``."""
    if version is None:
        return None
    if isinstance(version, (list, tuple)):
        if len(version) != count:
            raise InvalidArgumentError(
                f"version lists {len(version)} entries for {count} (gradient, variable) "
                "pairs; give one version (or None) per pair, or one int."
            )
        return "each", [
            None if v is None else _version_value(v, f"version[{i}]")
            for i, v in enumerate(version)
        ]
    return "global", _version_value(version, "version")


class VersionsPart(OptimizerPart):
    """SafeOptimizer's part that measures staleness from the versions given."""

    def _safevars_staleness(self, step: _Step) -> Any:
        assert step.versions is not None  # the caller checks
        kind, given = step.versions
        eager = tf.executing_eagerly()
        if kind == "global":
            current = self.iterations
            if eager:
                staleness = int(numpy_of(current)) - int(numpy_of(given))
            else:
                staleness = tf.cast(current, tf.int64) - tf.cast(given, tf.int64)
        else:
            parts = []
            for guard, value in zip(step.guards, given):
                if value is None:
                    continue
                if eager:
                    parts.append(int(guard.version()) - int(numpy_of(value)))
                else:
                    parts.append(guard.version_var.read_value() - tf.cast(value, tf.int64))
            if not parts:
                return 0
            staleness = max(parts) if eager else tf.reduce_max(tf.stack(parts))
        if eager:
            if staleness < 0:
                raise InvalidArgumentError(
                    f"version is {-staleness} update(s) ahead of the current state: it "
                    "must be a version read before the gradients were computed "
                    "(optimizer.iterations, v.version or a snapshot)."
                )
            return staleness
        return tf.maximum(staleness, 0)

    def _safevars_refuse_future_versions(self, step: _Step) -> None:
        """Eager check that no given version is ahead of the current state."""
        if self.max_staleness is None or step.versions is None:
            return
        kind, given = step.versions
        if kind == "global":
            pairs = [(int(numpy_of(self.iterations)), given)]
        else:
            pairs = [
                (int(guard.version()), value)
                for guard, value in zip(step.guards, given)
                if value is not None
            ]
        for current, value in pairs:
            if int(value) > current:
                raise InvalidArgumentError(
                    f"version is {int(value) - current} update(s) ahead of the current "
                    "state: it must be a version read before the gradients were computed "
                    "(optimizer.iterations, v.version or a snapshot)."
                )
