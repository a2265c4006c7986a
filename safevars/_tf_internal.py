"""The one door to private TensorFlow and Keras APIs.

TensorFlow has no public API for taking a ``tf.CriticalSection``'s mutex without a
callable, for calling an eager kernel without Python bookkeeping, for telling an
XLA-compiled trace apart, for a distributed variable's per-replica parts, or for the
savers that ``tf.train.Checkpoint`` and ``model.save`` call. safevars reaches every such
symbol (``tensorflow.python.*``, ``keras.src.*``) through this module only, so that a
release that moves one breaks here, at import, with the name of what moved.

At import it compares the installed TensorFlow and Keras with the versions the test
suite runs against (:data:`TESTED_TENSORFLOW`, :data:`TESTED_KERAS`, the same ranges
``pyproject.toml`` declares) and warns once, naming both, if one is outside: the public
API of safevars may still work, but the private symbols below are where a release breaks
it.

At import it also keeps Python code out of two places inside TensorFlow's C code where a
Ctrl-C is mishandled (:func:`_context_handle_without_check_point`,
:func:`_type_checks_without_check_point`).

What differs between the supported Python, TensorFlow and Keras versions is settled here
too, each with its test in ``tests/test_tf_internal.py``: no other module of safevars
looks at a version.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import itertools
import operator
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import tensorflow as tf
from tensorflow.core.function.trace_type import default_types as _default_trace_types
from tensorflow.python import pywrap_tfe
from tensorflow.python.distribute import distribute_lib, sharded_variable, values_util
from tensorflow.python.distribute import values as ds_values
from tensorflow.python.distribute.coordinator import coordinator_context
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import core as _core
from tensorflow.python.eager import execute as _execute
from tensorflow.python.eager import record as _record
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
from tensorflow.python.util import _pywrap_utils, nest, object_identity

# The versions the test suite runs against, (major, minor), oldest and newest, both
# included: the same ranges as pyproject.toml's dependencies and requires-python
# (tests/test_tf_internal.py checks both). noxfile.py runs every TensorFlow minor of
# the range with the newest Keras, and the oldest Keras with the oldest TensorFlow.
# Keras 3.12 is the oldest: up to 3.11, LossScaleOptimizer.build does not call
# Optimizer.build, so a SafeOptimizer of (or around) one knows none of its variables.
TESTED_TENSORFLOW = ((2, 16), (2, 21))
TESTED_KERAS = ((3, 12), (3, 15))
TESTED_PYTHON = ((3, 10), (3, 13))


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


def _range_text(tested: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (major, oldest), (_, newest) = tested
    return f"{major}.{oldest}-{major}.{newest}"


def _pip_range(name: str, tested: tuple[tuple[int, int], tuple[int, int]]) -> str:
    (major, oldest), (_, newest) = tested
    return f"{name}>={major}.{oldest},<{major}.{newest + 1}"


def check_versions(tensorflow_version: str | None = None, keras_version: str | None = None) -> str:
    """Warns (once per call) if TensorFlow or Keras is not a tested version.

    Returns the warning's text, or ``""`` when both are tested versions.
    """
    tensorflow_version = tensorflow_version or tf.__version__
    keras_version = keras_version or _installed_keras()
    untested = []
    if not TESTED_TENSORFLOW[0] <= _minor(tensorflow_version) <= TESTED_TENSORFLOW[1]:
        untested.append(f"TensorFlow {tensorflow_version}")
    if not TESTED_KERAS[0] <= _minor(keras_version) <= TESTED_KERAS[1]:
        untested.append(f"Keras {keras_version}")
    if not untested:
        return ""
    text = (
        f"safevars is tested with TensorFlow {_range_text(TESTED_TENSORFLOW)} and Keras "
        f"{_range_text(TESTED_KERAS)}; found {' and '.join(untested)}. It reaches private "
        "TensorFlow/Keras APIs (locking kernels, distributed variables, the checkpoint and "
        "Keras savers, AutoGraph's conversion rules) that may have moved: expect import "
        "errors or wrong behaviour there. Install tested versions (pip install "
        f"'{_pip_range('tensorflow', TESTED_TENSORFLOW)}' "
        f"'{_pip_range('keras', TESTED_KERAS)}') or run safevars' test suite on yours."
    )
    warnings.warn(text, RuntimeWarning, stacklevel=3)
    return text


check_versions()


def _call_each_by_partial(steps: Iterable[tuple[Any, ...]]) -> Iterator[Any]:
    """``call_each`` for Python 3.10, which has no ``operator.call``: ``partial(fn, *args)``
    made by ``starmap``, then called by ``methodcaller('__call__')``; C objects only."""
    return map(_CALL, itertools.starmap(functools.partial, steps))


_CALL = operator.methodcaller("__call__")

call_each: Callable[[Iterable[tuple[Any, ...]]], Iterator[Any]]
"""``call_each(steps)``: a lazy iterator calling ``fn(*args)`` for each ``(fn, *args)``
of ``steps``, in order. Made of C objects only (no Python frame), so consuming it with a
C consumer (``collections.deque(maxlen=0).extend``) runs the calls as one chain of C
calls: a signal handler (``KeyboardInterrupt``) runs before the first or after the last,
never between two (:meth:`safevars.locking.guard.Guard.write_counted` relies on it).
``starmap(operator.call, steps)`` on Python 3.11+, ``_call_each_by_partial`` on 3.10."""
if sys.version_info >= (3, 11):
    call_each = functools.partial(itertools.starmap, operator.call)
else:  # pragma: no cover - depends on the Python version
    call_each = _call_each_by_partial


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
    "KERAS_STEP_FUNCTIONS",
    "TESTED_KERAS",
    "TESTED_PYTHON",
    "TESTED_TENSORFLOW",
    "ConcreteFunction",
    "FallbackException",
    "FuncGraph",
    "NotOkStatusException",
    "ResourceVariable",
    "anonymous_name",
    "autograph_config",
    "autograph_source_map",
    "call_each",
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
    "executor_is_async",
    "fast_execute",
    "func_graph_module",
    "gen_resource_variable_ops",
    "gen_stateful_random_ops",
    "gen_stateless_random_ops_v2",
    "graph_runs_outside_python_calls",
    "in_xla_context",
    "is_loop_body",
    "keras_clone_model_homes",
    "keras_export_archive",
    "keras_internal",
    "keras_model_files",
    "keras_name_scope_callers",
    "lazy_read",
    "mutex_lock",
    "nest",
    "object_identity",
    "opaque_trace_type",
    "ops",
    "raise_from_not_ok_status",
    "read_eagerly",
    "read_value_op",
    "resource_deleter",
    "resource_variable_ops",
    "same_answer_for_every_proxy",
    "saved_model_loader",
    "sharded_variable",
    "tensor_conversion_registry",
    "tensor_getitem_override",
    "values_util",
]

ConcreteFunction = concrete_function.ConcreteFunction
# The shared_name that makes a resource op create a new, uniquely named resource each
# time it runs (what eager ResourceVariables use): one eager kernel for them all.
anonymous_name = _context.anonymous_name
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


def resource_deleter(handle: Any, device: str) -> Any:
    """An object that destroys the eager resource ``handle`` (on ``device``) when it is
    garbage-collected: the deleter TensorFlow's own resource variables own
    (``resource_variable_ops.EagerResourceDeleter``, a ``DestroyResourceOp``)."""
    return resource_variable_ops.EagerResourceDeleter(handle, device)


# The module that traces a tf.data transformation's function: tf.data's own threads run
# that graph, not a call from Python.
_TF_DATA_TRACER = "/".join(("python", "data", "ops", "structured_function.py"))


def graph_runs_outside_python_calls() -> bool:
    """Whether the graph being traced may run without an eager call of its function
    through ``ConcreteFunction._call_flat``: a tf.data transformation's function (its
    tracer, ``structured_function.py``, is on the stack; tf.data 2.16-2.21) or a TF1
    graph (not a ``FuncGraph``)."""
    if not isinstance(ops.get_default_graph(), FuncGraph):
        return True
    frame: Any = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_TF_DATA_TRACER):
            return True
        frame = frame.f_back
    return False


def executor_is_async() -> bool:
    """Whether the calling thread's eager executor is asynchronous (a call returns
    before its graph has run: ``ClusterCoordinator``'s workers, ``set_synchronous_
    execution(False)``).

    Not ``context().is_async()``: that makes an ``Executor`` object whose ``__del__``
    waits for every node the executor has pending (and prints the error of a failed
    one); the handle here is the thread's executor, not owned, and deleting it deletes
    only the handle (``TFE_DeleteExecutor``)."""
    ctx = eager_context()
    ctx.ensure_initialized()
    handle = pywrap_tfe.TFE_ContextGetExecutorForThread(ctx._context_handle)
    try:
        return bool(pywrap_tfe.TFE_ExecutorIsAsync(handle))
    finally:
        pywrap_tfe.TFE_DeleteExecutor(handle)


def eager_context() -> Any:
    """The eager context object the generated op functions pass to the fast path."""
    return _context._context or _context.context()


def _context_handle_without_check_point() -> None:
    """Works around a TensorFlow crash when Ctrl-C lands in an eager tensor's creation.

    TensorFlow's C++ ``EagerTensor`` constructor (``tf.constant(1.0)``, the ``1.0`` of
    ``x + 1.0``) reads the eager context's ``_handle``, a Python property. Its first
    instruction is a check point where CPython runs a pending signal handler, and a
    ``KeyboardInterrupt`` raised there, inside the constructor, crashes the process
    (SIGSEGV, plain TensorFlow too: a few times per ten thousand interrupts of a loop of
    ``v.update(lambda x: x + 1.0)``). With a getter that is a C function
    (``operator.attrgetter``) no Python frame runs inside the constructor, so the
    interrupt lands at the next check point, after it. The one difference: ``_handle`` of
    a context not initialized yet is None instead of an ``AssertionError`` (TensorFlow
    initializes the context before it reads the handle).
    """
    _context.Context._handle = property(operator.attrgetter("_context_handle"))


_context_handle_without_check_point()


def _type_checks_without_check_point() -> None:
    """Works around TensorFlow dropping a Ctrl-C that lands in its eager fast path.

    The fast path (``TFE_Py_FastPathExecute``, which every eager write of safevars and
    every generated op function calls) asks of each input that is not an eager tensor
    whether it is a ``ResourceVariable``: an ``isinstance`` against an abstract base
    class, which runs Python code (``ABCMeta.__instancecheck__``) the first time it meets
    a type, after which TensorFlow caches the answer per type. A ``KeyboardInterrupt``
    raised in that Python code is dropped: the fast path goes on, the op runs and the
    interrupt is lost (plain TensorFlow too, e.g. ``assign_add_variable_op(handle,
    1.0)`` in a fresh process). Asking the same cached question here, for the value
    types writes are usually given, fills TensorFlow's cache, so the fast path runs no
    Python code for them; an interrupt during this warm-up is raised as usual.
    """
    import numpy as np

    numbers = "float16 float32 float64 complex64 complex128 bool int8 int16 int32 int64 uint8"
    samples: list[Any] = [0.0, 0, False, 0j, [], (), np.zeros(())]
    samples += [np.zeros((), name)[()] for name in numbers.split()]  # NumPy scalars
    for sample in samples:
        _pywrap_utils.IsResourceVariable(sample)


_type_checks_without_check_point()


def _function_call_releases_its_lock() -> None:
    """Works around a ``tf.function`` that hangs every other thread after one failed call.

    ``Function._call`` (``polymorphic_function.py``, TensorFlow 2.16 to 2.21 at least)
    takes the function's ``RLock``, binds the arguments, then releases it, without
    ``try``/``finally``: an exception in between leaves the lock held by the calling
    thread, and every call of that function from another thread waits for ever. A call
    with wrong arguments raises there (``TypeError: Binding inputs to tf.function
    failed``), and so can a Ctrl-C or any asynchronous exception landing in those few
    lines (``tests/locking/test_faults.py``'s injected ones did, 2026-11-29: its threads
    hung on the lock and the suite with them). The wrapper releases what the failed call
    left held, and nothing it held before the call (a function called while tracing
    itself, which the ``RLock`` allows). An exception landing inside the wrapper's own
    ``except`` clause can still leak the lock: the window is a few instructions, not a
    whole argument binding.
    """
    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    function_class = polymorphic_function.Function
    original = function_class._call
    if getattr(original, "_safevars_releases_lock", False):
        return

    @functools.wraps(original)
    def _call(self: Any, *args: Any, **kwds: Any) -> Any:
        lock = self._lock
        owned = getattr(lock, "_is_owned", None)
        if owned is None:  # (not the RLock this was written for: TensorFlow's own call)
            return original(self, *args, **kwds)
        held_before = owned()
        try:
            return original(self, *args, **kwds)
        except BaseException:
            if not held_before:
                while owned():
                    lock.release()
            raise

    _call._safevars_releases_lock = True  # type: ignore[attr-defined]
    function_class._call = _call


_function_call_releases_its_lock()


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


class _ByIdentity(_default_trace_types.Weakref):
    """TensorFlow's trace type of an object it cannot convert (held weakly, the object
    itself inside the trace), compared by identity: a variable's ``==`` is elementwise
    and its hash raises."""

    def __init__(self, ref: Any) -> None:
        self._ref = ref
        self._ref_hash = id(ref())

    def cast(self, value: Any, _: Any) -> Any:
        if value is self._ref():
            return value
        raise ValueError(f"Can not cast {value!r} to {self!r}")

    def placeholder_value(self, placeholder_context: Any) -> Any:
        # The object itself; a resource variable's handle is captured now, so the traced
        # graph takes it as the input ``to_tensors`` passes (TensorFlow turns a variable
        # argument's captured handle into an input), used by the body or not.
        value = self._ref()
        graph = ops.get_default_graph()
        if isinstance(value, resource_variable_ops.BaseResourceVariable) and isinstance(
            graph, FuncGraph
        ):
            graph.capture(value.handle)
        return value

    def flatten(self) -> list[Any]:
        if isinstance(self._ref(), resource_variable_ops.BaseResourceVariable):
            return [tf.TensorSpec([], tf.resource)]
        return []

    def to_tensors(self, value: Any) -> list[Any]:
        # A resource variable among a function's arguments passes its handle as an
        # input (TensorFlow makes the handle's capture an input), as VariableSpec does.
        if isinstance(value, resource_variable_ops.BaseResourceVariable):
            variable_accessed(value)
            return [value.handle]
        return []

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _ByIdentity):
            return False
        mine = self._ref()
        return mine is not None and mine is other._ref()

    __hash__ = _default_trace_types.Weakref.__hash__

    def __repr__(self) -> str:
        return f"ByIdentity[{type(self._ref()).__name__} at {self._ref_hash:#x}]"


def same_answer_for_every_proxy(proxy_type: Any, wrap: Callable[[Any, Any], None]) -> None:
    """TensorFlow's C++ check "is this a resource variable?" answers for ``proxy_type``
    as for a ``ResourceVariable``, whatever proxy it is first asked about.

    The check (``_pywrap_utils.IsResourceVariable``, which ``tf.function`` uses to
    flatten its arguments) caches its answer per Python type. Every SafeVariable has one
    type, the proxy's, over variables of several classes: a ``ResourceVariable``, a
    variable created while tracing (``UnliftedInitializerVariable``: "no"), a mirrored
    one ("no"). So the first SafeVariable TensorFlow asked about decided for all, and
    after a SafeVariable created inside a ``tf.function`` every SafeVariable passed as a
    ``tf.function`` argument failed ("Tensor.op is undefined when eager execution is
    enabled"). Asked first here, with a proxy (``wrap(proxy, wrapped)`` makes one) of a
    bare ``ResourceVariable`` object, no TensorFlow runtime involved, the answer is
    "yes" for every SafeVariable, which :func:`opaque_trace_type` expects.
    """
    proxy: Any = proxy_type.__new__(proxy_type)
    wrap(proxy, object.__new__(ResourceVariable))
    _pywrap_utils.IsResourceVariable(proxy)


def opaque_trace_type(value):
    """The ``tf.function`` trace type of an argument traced as the object itself (by
    identity, held weakly), the type TensorFlow gives objects it cannot convert."""
    return _ByIdentity(weakref.ref(value))


def read_value_op(variable):
    """A read of ``variable`` (a resource variable) as one ``ReadVariableOp``: in a graph,
    ``read_value`` adds an ``Identity`` after it."""
    if not isinstance(variable, resource_variable_ops.ResourceVariable):
        return variable.read_value()
    variable_accessed(variable)
    return gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)


def read_variables(handles, dtypes):
    """The values of several resource variables of one device, read eagerly by one
    ``_ReadVariablesOp`` (the op TensorFlow's graph optimizer fuses reads into): what one
    ``ReadVariableOp`` each returns, for the cost of one op. Records nothing on gradient
    tapes (it has no gradient): for reads no tape is watching."""
    return _execute.execute(
        b"_ReadVariablesOp",
        num_outputs=len(handles),
        inputs=list(handles),
        attrs=("N", len(handles), "dtypes", [tf.as_dtype(d).as_datatype_enum for d in dtypes]),
        ctx=eager_context(),
    )


def recording_gradients() -> bool:
    """Whether a gradient tape is active (so a read must be one it can differentiate)."""
    return _record.could_possibly_record()


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


def keras_export_archive() -> type:
    """The class of Keras' SavedModel ``ExportArchive`` (``keras.export.ExportArchive``,
    ``model.export``) that defines ``_filter_and_track_resources``: it tracks, just
    before ``write_out`` saves, the variables the endpoints' graphs used (as
    ``_tf_trackable._all_variables``).

    Keras 3.12 defines it on ``keras.src.export.saved_model.ExportArchive``; later
    releases moved it to ``SavedModelExportArchive``
    (``keras.src.export.saved_model_export_archive``), a base of the archive that
    ``ExportArchive(...)`` returns.
    """
    try:
        module = keras_internal("export.saved_model_export_archive")
    except ModuleNotFoundError:  # Keras 3.12
        return keras_internal("export.saved_model").ExportArchive
    return module.SavedModelExportArchive


def keras_name_scope_callers() -> list[Any]:
    """The objects (layers, optimizers, metrics, seed generators) whose Keras name scopes
    are open in this thread, outermost first.

    Keras keeps them in a per-thread global attribute, ``name_scope_stack``, of
    ``keras.src.backend.common.global_state``; every variable Keras creates for a layer
    (``add_weight``, ``build``), an optimizer (``add_variable``) or a metric is made with
    its owner's scope open (``backend.name_scope(name, caller=owner)``), in Keras 3.12 to
    3.15.
    """
    global_state = keras_internal("backend.common.global_state")
    stack = global_state.get_global_attribute("name_scope_stack")
    return [getattr(scope, "caller", None) for scope in stack or ()]


KERAS_STEP_FUNCTIONS = frozenset(
    {
        "one_step_on_data",
        "one_step_on_data_distributed",
        "multi_step_on_iterator",
        "multi_step_on_data",
        "one_step_on_iterator",
    }
)
"""The names of the ``tf.function`` s Keras' TensorFlow trainer traces for ``fit``,
``evaluate`` and ``predict`` (their graphs' names; Keras 3.12 to 3.15)."""


def keras_model_files() -> ModuleType:
    """Keras' ``saving_lib``: ``_serialize_model_as_json`` (the config and metadata of a
    ``.keras`` file, also of a pickled or deep-copied model), ``_load_model_from_fileobj``
    (a ``.keras`` zip, a pickle, a deep copy) and ``_load_model_from_dir``, each looked up
    as a module global when called (Keras 3.12 to 3.15)."""
    return keras_internal("saving.saving_lib")


def keras_clone_model_homes() -> list[ModuleType]:
    """The modules that bind ``clone_model`` to Keras' function: its own
    (``keras.src.models.cloning``), ``keras.src.models`` and the public ``keras.models``
    (each import binds the function object, so each binding is replaced)."""
    import keras

    homes = [keras_internal("models.cloning"), keras_internal("models"), keras.models]
    return [home for home in homes if hasattr(home, "clone_model")]


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
        # What pickle.dumps(model) and copy.deepcopy(model) save (Keras' __reduce__).
        (saving_lib, "_save_model_to_fileobj", keras_objects),
        (saving_lib, "save_weights_only", keras_objects),
        (saving_lib, "load_weights_only", keras_objects),
    ]
