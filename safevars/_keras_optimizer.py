"""What :mod:`safevars.optimizer` needs around its critical section: checks and glue.

Private. Three groups, kept out of ``optimizer.py`` so that module reads as the section:

* **Checks** that run before anything changes (variables, gradients, versions, settings);
  each error names the argument, the value received and the fix.
* **Trace-safe decisions**: one code path for eager and graph. Python values decide in
  Python, eager tensors are read, graph tensors become ``tf.cond`` / assertions.
* **Keras and TensorFlow glue**, the only place the optimizer reaches private APIs
  (tested with TensorFlow 2.21 and Keras 3.15): merge calls under ``MirroredStrategy``,
  the public serialization identity of an optimizer class, the XLA-context test.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from safevars._tf_internal import (
    control_flow_util,
    keras_internal,
    resource_variable_ops,
    sharded_variable,
)
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    UnsupportedStrategyError,
)
from safevars.snapshot import Snapshot
from safevars.variable import SafeVariable

ON_STALE_POLICIES = ("drop", "raise", "scale")
NONFINITE_POLICIES = (None, "skip", "raise")

# --------------------------------------------------------------------------- strategies

SUPPORTED_STRATEGIES = (
    tf.distribute.OneDeviceStrategy,
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.ParameterServerStrategy,
)
SUPPORTED_NAMES = (
    "no strategy (the default), tf.distribute.OneDeviceStrategy, "
    "tf.distribute.MirroredStrategy (one machine, any number of devices), "
    "tf.distribute.MultiWorkerMirroredStrategy (processes configured by TF_CONFIG) and "
    "tf.distribute.experimental.ParameterServerStrategy (TF2, driven by "
    "ClusterCoordinator)"
)


def current_strategy() -> tf.distribute.Strategy | None:
    """The strategy in scope, or ``None`` for the default one; refuses unsupported ones."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, SUPPORTED_STRATEGIES):
        raise UnsupportedStrategyError(
            f"SafeOptimizer does not support {type(strategy).__name__}. Supported: "
            f"{SUPPORTED_NAMES}."
        )
    return strategy


def local(value: Any) -> Any:
    """The first replica's component of a distributed value (values that are equal)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return value


def oldest(value: Any) -> Any:
    """The smallest replica's version of a distributed version (largest staleness)."""
    if isinstance(value, tf.distribute.DistributedValues):
        parts = tf.distribute.get_strategy().experimental_local_results(value)
        return tf.reduce_min(tf.stack([tf.cast(p, tf.int64) for p in parts]))
    return value


# Under MirroredStrategy the section runs in cross-replica context (in the merge_call
# every Keras optimizer makes for its update anyway), so that one section covers the
# update of every replica's copy. Keras' TensorFlow optimizer reaches its update through
# ``maybe_merge_call``, which assumes a replica context and fails in cross-replica
# context, where no merge is needed. While the optimizer's own update runs from
# cross-replica context, the calling thread tells the strategy that merge calls are not
# needed, so ``maybe_merge_call`` calls its function directly. Other threads are not
# affected.

_direct = threading.local()
_install_lock = threading.Lock()


def _allow_direct_merge_calls(strategy: tf.distribute.Strategy) -> None:
    extended = strategy.extended
    if getattr(extended, "_safevars_direct_merge", False):
        return
    with _install_lock:
        if getattr(extended, "_safevars_direct_merge", False):
            return
        original = extended._use_merge_call

        def _use_merge_call() -> bool:
            if getattr(_direct, "depth", 0):
                return False
            return original()

        extended._use_merge_call = _use_merge_call
        extended._safevars_direct_merge = True


@contextlib.contextmanager
def direct_merge_calls(strategy: tf.distribute.Strategy | None) -> Iterator[None]:
    """Inside: ``maybe_merge_call`` of ``strategy`` calls its function directly."""
    if strategy is None:
        yield
        return
    _allow_direct_merge_calls(strategy)
    _direct.depth = getattr(_direct, "depth", 0) + 1
    try:
        yield
    finally:
        _direct.depth -= 1


def in_xla_context() -> bool:
    """Whether ops built now go into an XLA-compiled function (``jit_compile=True``)."""
    if tf.executing_eagerly():
        return False
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def class_identity(cls: type) -> dict[str, Any]:
    """How Keras names ``cls`` in a serialized config: module, class_name, registered_name.

    The same fields ``keras.saving.serialize_keras_object`` writes for an instance of
    ``cls`` (the public ``keras.optimizers.X`` name for Keras' own classes, the
    registered name for registered ones), so ``deserialize_keras_object`` finds it.
    """
    public = keras_internal("saving.serialization_lib").serialize_with_public_class(cls)
    if public is not None:
        return {key: public[key] for key in ("module", "class_name", "registered_name")}
    return {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "registered_name": keras.saving.get_registered_name(cls),
    }


def add_counts(variable: Any, delta: Any) -> Any:
    """``variable += delta`` for the int64 counters (one kernel for a plain variable)."""
    if isinstance(variable, resource_variable_ops.ResourceVariable) and not isinstance(
        variable, tf.distribute.DistributedValues
    ):
        return tf.raw_ops.AssignAddVariableOp(resource=variable.handle, value=delta)
    return variable.assign_add(delta, read_value=False)


# --------------------------------------------------------------------------- checks


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(value: Any, argument: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{argument} must be an int >= {minimum}, got {short(value)}.")


def check_settings(
    accumulate_steps: Any,
    max_staleness: Any,
    on_stale: Any,
    nonfinite: Any,
    deterministic: Any,
    kwargs: dict[str, Any],
) -> None:
    """Checks SafeOptimizer's own arguments (nothing is changed before they pass)."""
    check_int(accumulate_steps, "accumulate_steps", minimum=1)
    if max_staleness is not None:
        check_int(max_staleness, "max_staleness", minimum=0)
    if on_stale not in ON_STALE_POLICIES:
        raise InvalidArgumentError(
            f"on_stale must be one of {ON_STALE_POLICIES}, got {on_stale!r}."
        )
    if nonfinite not in NONFINITE_POLICIES:
        raise InvalidArgumentError(
            f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}."
        )
    if not isinstance(deterministic, bool):
        raise InvalidArgumentError(
            f"deterministic must be True or False, got {short(deterministic)}."
        )
    for key, value in kwargs.items():
        raise InvalidArgumentError(
            f"SafeOptimizer does not take {key}={short(value)}: set it on the optimizer "
            "you make safe (for example keras.optimizers.Adam(..., "
            f"{key}=...)), or as an attribute of the safe optimizer afterwards."
        )


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


def numpy_of(value: Any) -> Any:
    return value.numpy() if hasattr(value, "numpy") else value


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


# --------------------------------------------------------------------------- decisions


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
    """Raises ``error()`` now if ``bad`` is known true; in a graph, an assertion op."""
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


def to_float(value: Any) -> Any:
    return float(value) if is_static(value) else tf.cast(value, tf.float32)


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
