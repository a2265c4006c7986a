"""The ``version=`` argument: its forms, checked before the section, and the staleness.

A call may say what its gradients were computed from: one int (compared with
``iterations``) or one entry per pair (a SafeVariable's ``.version``, a
:class:`~safevars.Snapshot` or ``None``). :func:`normalize_versions` checks and
normalises it before anything changes; inside the section
:meth:`VersionsPart._safevars_staleness` measures how many updates behind the gradients
are (with :mod:`safevars.staleness`, shared with GradientAccumulator), which the
``max_staleness`` / ``on_stale`` policy (in ``locked_step.py``) acts on.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from safevars._validation import is_int, short
from safevars.errors import InvalidArgumentError
from safevars.optimizer.decisions import numpy_of
from safevars.optimizer.runtime import OptimizerPart, _Step
from safevars.snapshot import Snapshot
from safevars.staleness import version_lag


def _version_value(value: Any, where: str) -> Any:
    if isinstance(value, Snapshot):
        value = value.version
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where} must be an int version, got {value!r}.")
    if is_int(value):
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
        """How many updates behind ``step``'s gradients are (clamped at 0).

        The lag (:func:`safevars.staleness.version_lag`) of ``iterations`` behind a
        global version, or the largest lag of a listed variable behind its version.

        Raises:
          InvalidArgumentError: eagerly, a version is ahead of the current one (it
            cannot have been read before the gradients were computed). In a graph such a
            version counts as fresh.

        Modes: eagerly a Python ``int``; in a graph an int64 tensor (or ``0``).
        """
        assert step.versions is not None  # the caller checks
        kind, given = step.versions
        if kind == "global":
            return version_lag(self.iterations, given, refuse_future=True)
        eager = tf.executing_eagerly()
        lags = [
            version_lag(
                int(guard.version()) if eager else guard.graph_version(),
                value,
                refuse_future=True,
                argument=f"version[{position}]",
            )
            for guard, value, position in zip(step.guards, given, step.kept)
            if value is not None
        ]
        if not lags:
            return 0
        return max(lags) if eager else tf.reduce_max(tf.stack(lags))

    def _safevars_refuse_future_versions(self, step: _Step) -> None:
        """Eager check that no given version is ahead of the current state."""
        if self.max_staleness is None or step.versions is None:
            return
        self._safevars_staleness(step)  # eagerly, refuses a version from the future
