"""Trace-safe decisions: one code path for eager and graph.

The locked step is written once. Python values decide in Python, eager tensors are
read, graph tensors become ``tf.cond`` s, ``tf.where`` s and assertions. Also whether
ops built now go into an XLA-compiled function (where assertions are dropped).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import control_flow_util


def in_xla_context() -> bool:
    """Whether ops built now go into an XLA-compiled function (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def numpy_of(value: Any) -> Any:
    return value.numpy() if hasattr(value, "numpy") else value


def is_static(value: Any) -> bool:
    return isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating))


def decide(value: Any) -> bool | None:
    """A Python decision when one can be made now, else ``None`` (graph tensor)."""
    if is_static(value):
        return bool(value)
    if tf.executing_eagerly():
        return bool(numpy_of(value))
    return None


def branch(pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any]) -> Any:
    decided = decide(pred)
    if decided is not None:
        return true_fn() if decided else false_fn()
    return tf.cond(pred, true_fn, false_fn)


def refuse(bad: Any, error: Callable[[], Exception], message: str) -> Any:
    """Raises ``error()`` now if ``bad`` is known true; in a graph, an assertion op.

    ``message`` is the assertion's text, tagged with :func:`safevars.errors.assertion_text`
    so that :func:`safevars.errors.from_assertion` can turn its failure back into the error.
    """
    decided = decide(bad)
    if decided is not None:
        if decided:
            raise error()
        return None
    return tf.debugging.Assert(tf.logical_not(bad), [message])


def logical_not(value: Any) -> Any:
    decided = decide(value)
    return (not decided) if decided is not None else tf.logical_not(value)


def logical_and(a: Any, b: Any) -> Any:
    da, db = decide(a), decide(b)
    if da is not None and db is not None:
        return da and db
    if da is not None:
        return b if da else False
    if db is not None:
        return a if db else False
    return tf.logical_and(a, b)


def where(pred: Any, a: Any, b: Any) -> Any:
    decided = decide(pred)
    if decided is not None:
        chosen = a if decided else b
        return float(chosen) if is_static(chosen) else chosen
    return tf.where(pred, tf.cast(a, tf.float32), tf.cast(b, tf.float32))


def scale(grad: Any, factor: Any) -> Any:
    if is_static(factor) and float(factor) == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def all_finite(grads: list[Any]) -> Any:
    checks = []
    for grad in grads:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        checks.append(tf.reduce_all(tf.math.is_finite(values)))
    result = tf.reduce_all(tf.stack(checks))
    return bool(result.numpy()) if tf.executing_eagerly() else result


def zero() -> Any:
    return 0 if tf.executing_eagerly() else tf.constant(0, tf.int64)


def one() -> Any:
    return 1 if tf.executing_eagerly() else tf.constant(1, tf.int64)
