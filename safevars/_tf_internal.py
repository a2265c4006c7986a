"""The one door to private TensorFlow APIs that safevars' locking core relies on.

TensorFlow has no public API for taking a ``tf.CriticalSection``'s mutex without a
callable, for calling an eager kernel without Python bookkeeping, or for telling an
XLA-compiled trace apart. safevars reaches those through this module only, so a
TensorFlow release that moves them breaks here, at import, with the name of what moved.

Tested with TensorFlow 2.21.
Keras' saving library is reached here too (the entry points that ``model.save``,
``save_weights`` and ``load_weights`` call), tested with Keras 3.15.
"""

from __future__ import annotations

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import core as _core
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util, gen_resource_variable_ops
from tensorflow.python.ops.resource_variable_ops import ResourceVariable, variable_accessed

__all__ = [
    "ConcreteFunction",
    "FallbackException",
    "NotOkStatusException",
    "ResourceVariable",
    "checkpoint_entry_points",
    "colocate_with",
    "consume_mutex_lock",
    "default_graph",
    "eager_context",
    "executing_eagerly",
    "fast_execute",
    "in_xla_context",
    "mutex_lock",
    "raise_from_not_ok_status",
    "read_eagerly",
]

ConcreteFunction = concrete_function.ConcreteFunction
executing_eagerly = _context.executing_eagerly
fast_execute = pywrap_tfe.TFE_Py_FastPathExecute
FallbackException = _core._FallbackException
NotOkStatusException = _core._NotOkStatusException
raise_from_not_ok_status = ops.raise_from_not_ok_status
mutex_lock = gen_resource_variable_ops.mutex_lock
consume_mutex_lock = gen_resource_variable_ops.consume_mutex_lock
colocate_with = ops.colocate_with
default_graph = ops.get_default_graph


def eager_context():
    """The eager context object the generated op functions pass to the fast path."""
    return _context._context or _context.context()


def in_xla_context(graph=None) -> bool:
    """Whether ops built now go into an XLA-compiled function (``jit_compile=True``)."""
    return control_flow_util.GraphOrParentsInXlaContext(graph or ops.get_default_graph())


def read_eagerly(variable, handle, dtype):
    """An eager read of a plain resource variable: ``read_value`` without its Python
    overhead and its extra identity op (gradient tapes still see the read)."""
    variable_accessed(variable)
    return gen_resource_variable_ops.read_variable_op(handle, dtype)


def checkpoint_entry_points(checkpoint_objects, keras_objects):
    """(owner, attribute, objects-finder) for every saver safevars makes take locks.

    ``TrackableSaver.save``/``restore`` serve ``tf.train.Checkpoint`` (and the
    ``CheckpointManager``); Keras' ``saving_lib`` functions serve ``model.save``,
    ``save_weights`` and ``load_weights``.
    """
    from keras.src.saving import saving_lib
    from tensorflow.python.checkpoint import checkpoint

    return [
        (checkpoint.TrackableSaver, "save", checkpoint_objects),
        (checkpoint.TrackableSaver, "restore", checkpoint_objects),
        (saving_lib, "save_model", keras_objects),
        (saving_lib, "save_weights_only", keras_objects),
        (saving_lib, "load_weights_only", keras_objects),
    ]
