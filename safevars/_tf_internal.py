"""The one door to private TensorFlow and Keras APIs.

TensorFlow has no public API for taking a ``tf.CriticalSection``'s mutex without a
callable, for calling an eager kernel without Python bookkeeping, for telling an
XLA-compiled trace apart, for a distributed variable's per-replica parts, or for the
savers that ``tf.train.Checkpoint`` and ``model.save`` call. safevars reaches every such
symbol (``tensorflow.python.*``, ``keras.src.*``) through this module only, so that a
release that moves one breaks here, at import, with the name of what moved.

At import it compares the installed TensorFlow and Keras with the versions the test
suite runs against (:data:`TESTED_TENSORFLOW`, :data:`TESTED_KERAS`, the same range
``pyproject.toml`` declares) and warns once, naming both, if they differ: the public API
of safevars may still work, but the private symbols below are where a release breaks it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from types import ModuleType
from typing import Any

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.distribute import distribute_lib, sharded_variable, values_util
from tensorflow.python.distribute import values as ds_values
from tensorflow.python.distribute.coordinator import coordinator_context
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import core as _core
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.framework import func_graph as func_graph_module
from tensorflow.python.framework import ops, tensor_conversion_registry
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import (
    control_flow_util,
    control_flow_v2_func_graphs,
    critical_section_ops,
    gen_resource_variable_ops,
    gen_stateful_random_ops,
    gen_stateless_random_ops_v2,
    resource_variable_ops,
    tensor_getitem_override,
)
from tensorflow.python.ops.resource_variable_ops import ResourceVariable, variable_accessed
from tensorflow.python.util import nest, object_identity

# The versions the test suite runs against (major, minor); pyproject.toml declares them.
TESTED_TENSORFLOW = (2, 21)
TESTED_KERAS = (3, 15)


def _minor(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _installed_keras() -> str:
    try:
        return importlib.metadata.version("keras")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_versions(tensorflow_version: str | None = None, keras_version: str | None = None) -> str:
    """Warns (once per call) if TensorFlow or Keras is not a tested version.

    Returns the warning's text, or ``""`` when both are tested versions.
    """
    tensorflow_version = tensorflow_version or tf.__version__
    keras_version = keras_version or _installed_keras()
    untested = []
    if _minor(tensorflow_version) != TESTED_TENSORFLOW:
        untested.append(f"TensorFlow {tensorflow_version}")
    if _minor(keras_version) != TESTED_KERAS:
        untested.append(f"Keras {keras_version}")
    if not untested:
        return ""
    text = (
        f"safevars is tested with TensorFlow {'.'.join(map(str, TESTED_TENSORFLOW))}.x and "
        f"Keras {'.'.join(map(str, TESTED_KERAS))}.x; found {' and '.join(untested)}. It "
        "reaches private TensorFlow/Keras APIs (locking kernels, distributed variables, "
        "the checkpoint and Keras savers, AutoGraph's conversion rules) that may have "
        "moved: expect import errors or wrong behaviour there. Install the tested versions "
        "(pip install 'tensorflow==2.21.*') or run safevars' test suite on yours."
    )
    warnings.warn(text, RuntimeWarning, stacklevel=3)
    return text


check_versions()


def keras_internal(module: str) -> ModuleType:
    """``keras.src.<module>``, imported on first use (importing Keras is slow)."""
    return importlib.import_module(f"keras.src.{module}")


def autograph_config() -> Any:
    """AutoGraph's conversion-rules module, or ``None`` if this release moved it."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:  # pragma: no cover - depends on the TensorFlow release
        return None
    return config


def autograph_source_map() -> Any:
    """The per-thread source maps AutoGraph keeps for generated code, or ``None``."""
    try:
        from tensorflow.python.util import tf_stack
    except ImportError:  # pragma: no cover - depends on the TensorFlow release
        return None
    return getattr(tf_stack, "_source_mapper_stacks", None)


__all__ = [
    "TESTED_KERAS",
    "TESTED_TENSORFLOW",
    "ConcreteFunction",
    "FallbackException",
    "FuncGraph",
    "NotOkStatusException",
    "ResourceVariable",
    "autograph_config",
    "autograph_source_map",
    "captured_placeholder",
    "check_versions",
    "checkpoint_entry_points",
    "colocate_with",
    "concrete_function",
    "consume_mutex_lock",
    "control_flow_util",
    "coordinator_context",
    "critical_section_ops",
    "default_graph",
    "distribute_lib",
    "ds_values",
    "eager_context",
    "eager_context_module",
    "executing_eagerly",
    "fast_execute",
    "func_graph_module",
    "gen_resource_variable_ops",
    "gen_stateful_random_ops",
    "gen_stateless_random_ops_v2",
    "in_xla_context",
    "is_loop_body",
    "keras_internal",
    "lazy_read",
    "mutex_lock",
    "nest",
    "object_identity",
    "ops",
    "raise_from_not_ok_status",
    "read_eagerly",
    "resource_variable_ops",
    "saved_model_loader",
    "sharded_variable",
    "tensor_conversion_registry",
    "tensor_getitem_override",
    "values_util",
]

ConcreteFunction = concrete_function.ConcreteFunction
eager_context_module = _context
executing_eagerly = _context.executing_eagerly
fast_execute = pywrap_tfe.TFE_Py_FastPathExecute
FallbackException = _core._FallbackException
NotOkStatusException = _core._NotOkStatusException
raise_from_not_ok_status = ops.raise_from_not_ok_status
mutex_lock = gen_resource_variable_ops.mutex_lock
consume_mutex_lock = gen_resource_variable_ops.consume_mutex_lock
colocate_with = ops.colocate_with
default_graph = ops.get_default_graph


def eager_context() -> Any:
    """The eager context object the generated op functions pass to the fast path."""
    return _context._context or _context.context()


def in_xla_context(graph=None) -> bool:
    """Whether ops built now go into an XLA-compiled function (``jit_compile=True``)."""
    return control_flow_util.GraphOrParentsInXlaContext(graph or ops.get_default_graph())


def is_loop_body(graph) -> bool:
    """Whether ``graph`` is the body of a ``tf.while_loop`` (AutoGraph loops included)."""
    return isinstance(graph, control_flow_v2_func_graphs.WhileBodyFuncGraph)


def captured_placeholder(graph, tensor_id):
    """The placeholder of the function graph ``graph`` that carries the captured tensor
    whose ``id`` is ``tensor_id`` (an outer graph's tensor or an eager one), or None
    (``FuncGraph._function_captures``)."""
    captures = getattr(graph, "_function_captures", None)
    return getattr(captures, "by_val_internal", {}).get(tensor_id)


def set_input(op, index, tensor) -> None:
    """Makes ``tensor`` input ``index`` of ``op``, an op of a graph being traced
    (``Operation._update_input``)."""
    op._update_input(index, tensor)


def keep_cond_as_kernel(op) -> None:
    """Runs a ``tf.cond``'s ``If`` op as one kernel, not lowered to ``Switch``/``Merge``
    (``Operation._set_attr``; TensorFlow's own control-flow code sets this attribute)."""
    op._set_attr("_lower_using_switch_merge", tf.compat.v1.AttrValue(b=False))


def read_eagerly(variable, handle, dtype):
    """An eager read of a plain resource variable: ``read_value`` without its Python
    overhead and its extra identity op (gradient tapes still see the read)."""
    variable_accessed(variable)
    return gen_resource_variable_ops.read_variable_op(handle, dtype)


def lazy_read(variable, op):
    """What ``ResourceVariable.assign*`` returns with ``read_value=True``: the variable as
    an unread variable (``_lazy_read``) whose reads wait for ``op``, or ``None`` for a
    variable that makes none (a distributed variable).

    Eagerly (``op`` is ``None``) it is made without ``_lazy_read``'s
    ``variable_accessed``: safevars' eager writes call the write kernels directly and
    record no access (a ``tf.custom_gradient`` would otherwise see the wrapped variable
    as one its function used, besides the SafeVariable it was given).
    """
    if not isinstance(variable, resource_variable_ops.BaseResourceVariable):
        return None
    if op is not None:
        return variable._lazy_read(op)
    return resource_variable_ops._UnreadVariable(
        handle=variable.handle,
        dtype=variable.dtype,
        shape=variable._shape,
        in_graph_mode=False,
        parent_op=None,
        unique_id=variable._unique_id,
    )


def saved_model_loader() -> Any:
    """The class ``tf.saved_model.load`` builds the loaded objects with (``Loader``): its
    ``_restore_checkpoint`` restores the SavedModel's variables and then asserts that
    every object it built got a value."""
    from tensorflow.python.saved_model import load

    return load.Loader


def checkpoint_entry_points(checkpoint_objects, keras_objects):
    """(owner, attribute, objects-finder) for every saver safevars makes take locks.

    ``TrackableSaver.save``/``restore`` serve ``tf.train.Checkpoint`` (and the
    ``CheckpointManager``); Keras' ``saving_lib`` functions serve ``model.save``,
    ``save_weights`` and ``load_weights``.
    """
    from tensorflow.python.checkpoint import checkpoint

    saving_lib = keras_internal("saving.saving_lib")

    return [
        (checkpoint.TrackableSaver, "save", checkpoint_objects),
        (checkpoint.TrackableSaver, "restore", checkpoint_objects),
        (saving_lib, "save_model", keras_objects),
        (saving_lib, "save_weights_only", keras_objects),
        (saving_lib, "load_weights_only", keras_objects),
    ]
