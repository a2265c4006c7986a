"""Checks of what a SafeVariable is given: an expected version, a value's static shape.

The dtype and shape check of every written value is :meth:`SafeVariable._checked`
(``writes.py``), which uses the shape helpers here; :func:`_version_argument` checks the
``expected_version`` of :meth:`SafeVariable.compare_and_assign`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import ops
from safevars._validation import short
from safevars.errors import InvalidArgumentError


def _version_argument(value: Any, argument: str) -> int | tf.Tensor:
    """A version argument as an ``int`` (eagerly) or an int64 tensor (graph), or raises.

    Versions are integers: a float (``2.9``) or a string (``"1"``) is refused, never
    truncated or parsed.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"{argument} must be >= 0, got {int(value)}.")
        return int(value)
    if isinstance(value, tf.Tensor):
        if not value.dtype.is_integer:
            raise InvalidArgumentError(
                f"{argument} must be an integer version (an int, or an integer tensor), "
                f"got a {value.dtype.name} tensor {short(value)}. Versions are never "
                "rounded: pass the int read from .version or a snapshot."
            )
        rank = value.shape.rank
        if rank is not None and rank != 0:
            raise InvalidArgumentError(
                f"{argument} must be a scalar version, got a tensor of shape "
                f"{value.shape.as_list()}: {short(value)}. Pass one version."
            )
        if isinstance(value, ops.EagerTensor):
            return _version_argument(int(value.numpy()), argument)
        if rank is None:
            value = tf.ensure_shape(value, [])
        return tf.cast(value, tf.int64)
    raise InvalidArgumentError(
        f"{argument} must be an int (a version read from .version or a snapshot) or an "
        f"integer scalar tensor, got {short(value)}."
    )


def _static_shape(variable: tf.Variable) -> tuple[int | None, ...] | None:
    shape = variable.shape
    return None if shape.rank is None else tuple(shape.as_list())


def _shapes_fit(expected: tuple[int | None, ...], got: tuple[int | None, ...]) -> bool:
    if len(expected) != len(got):
        return False
    return all(e is None or g is None or e == g for e, g in zip(expected, got))
