"""SafeVariable: a drop-in ``tf.Variable`` with locked writes, versions and snapshots.

The problem: ``v.assign(v.read_value() + 1)`` is two operations. Between them another
thread, another ``tf.function`` or another parameter-server worker may write ``v``, and
its update is lost silently (8 threads × 2,000 such updates ended at 2,392 instead of
16,000 on a 2-core machine with TensorFlow 2.21).

The fix: :class:`SafeVariable` is a transparent proxy (``wrapt.ObjectProxy``) around a
real ``tf.Variable``. It is an instance of ``tf.Variable`` to every ``isinstance`` check,
converts to a tensor, takes part in gradients, checkpoints, SavedModels and Keras
optimizers, and every write (``assign*``, ``scatter_*``, slice assignment) goes through
the variable's :class:`~safevars.locking.Guard`: one lock, one version counter.

NOTES:
  What is *not* guaranteed:

  * Writes made on the wrapped variable directly (``v.__wrapped__.assign(...)``, or by
    code holding the original ``tf.Variable`` that was passed to :func:`wrap`) bypass the
    lock and the version. Wrap a variable before sharing it.
  * A plain read (``v.read_value()``, ``v + 1``) is atomic for *one* variable but may
    interleave with a multi-variable transaction; use :meth:`SafeVariable.snapshot` or
    :func:`safevars.snapshot` for consistent reads of several variables.
  * ``v.assign(v.read_value() + 1)`` is still two operations: use
    ``v.update(lambda x: x + 1)`` or ``with safevars.locked(v): ...``.
  * Passing a SafeVariable as an *argument* of a ``tf.function`` gives the function a
    plain variable inside; capture it by closure (the usual Keras pattern) to keep the
    locks.
  * What a write returns with ``read_value=True`` is, as with ``tf.Variable``, the
    variable *unread* (a SafeVariable sharing the lock and version): reading it later
    may see later writes. ``update(fn)`` returns the value it wrote.
  * ``repr(v)`` is plain TensorFlow's (``<tf.Variable 'w:0' shape=() ...>``), as every
    other attribute: ``type(v)``, ``v.version`` and ``v.statistics()`` show what
    safevars adds. Shape errors keep TensorFlow's words ("... are incompatible",
    "shapes must be equal") besides naming the argument and the fix.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import weakref
from typing import Any, SupportsIndex

import tensorflow as tf
import wrapt

from safevars._tf_internal import (
    ds_values,
    lazy_read,
    object_identity,
    opaque_trace_type,
    ops,
    resource_variable_ops,
    same_answer_for_every_proxy,
    tensor_conversion_registry,
)
from safevars.distribute import check_strategy
from safevars.locking import Guard, LockStatistics
from safevars.locking.saved_model import restoring_saved_model, saved_guards
from safevars.variable.checks import _static_shape
from safevars.variable.scatter import _Scatter
from safevars.variable.snapshots import Snapshot, take_snapshots
from safevars.variable.writes import _Writes

# One guard per wrapped tf.Variable, so that wrap(v) twice still excludes itself.
_GUARDS: dict[int, Guard] = {}
_GUARDS_LOCK = threading.Lock()


def _guard_for(variable: tf.Variable, version: int = 0, lock: Any = None) -> Guard:
    key = id(variable)
    with _GUARDS_LOCK:
        guard = _GUARDS.get(key)
        if guard is None:
            guard = Guard(variable, version, lock)
            _GUARDS[key] = guard
            weakref.finalize(variable, _GUARDS.pop, key, None)
        return guard


class SafeVariable(_Writes, _Scatter, wrapt.ObjectProxy):
    """A ``tf.Variable`` whose writes are locked and versioned and whose reads snapshot.

    ``SafeVariable(initial_value, **kwargs)`` takes exactly what ``tf.Variable`` takes
    and creates one (so inside ``strategy.scope()`` the strategy creates it);
    :func:`wrap` wraps an existing variable instead. ``isinstance(v, tf.Variable)`` holds,
    and every ``tf.Variable`` attribute not listed here is the wrapped variable's.

    Thread safety:
      ``assign``, ``assign_add``, ``assign_sub``, the ``scatter_*`` family, slice
      assignment (``v[0].assign(x)``), :meth:`update` and :meth:`compare_and_assign` are
      atomic with respect to each other and to :func:`safevars.locked`,
      :func:`safevars.transaction` and :func:`safevars.snapshot` on the same variable, in
      any thread. Each completed write adds exactly 1 to :attr:`version`. Plain reads
      take no lock and never wait.

    Modes:
      Eagerly, the lock is a re-entrant per-variable ``threading.Lock`` and the version a
      Python ``int`` (the cost is one uncontended lock acquisition). The first time the
      variable is written, versioned or snapshotted inside a ``tf.function`` it switches
      to run-time mode for good: graph writes run inside a ``tf.CriticalSection`` placed
      on the variable's device, eager writes exclude running graphs (they take the same
      mutex while a call of a function whose graph takes it runs, and such a call waits
      for an eager section that did not), and the version lives in an int64 resource
      variable. Run-time mode makes eager writes dearer (a version add each, and a
      ``MutexLock`` op while such a call runs).
      Under ``tf.distribute`` see :mod:`safevars.distribute`.
    """

    # ------------------------------------------------------------------ construction

    def __init__(self, initial_value: Any = None, **kwargs: Any) -> None:
        check_strategy()
        variable = tf.Variable(initial_value, **kwargs)
        if isinstance(variable, SafeVariable):  # created inside safevars.scope()
            variable = variable.__wrapped__
        super().__init__(variable)
        self._self_init(variable, 0)

    @classmethod
    def _from_variable(
        cls, variable: tf.Variable, version: int = 0, lock: Any = None
    ) -> SafeVariable:
        proxy = cls.__new__(cls)
        wrapt.ObjectProxy.__init__(proxy, variable)
        proxy._self_init(variable, version, lock)
        return proxy

    def _self_init(self, variable: tf.Variable, version: int, lock: Any = None) -> None:
        # Cached: every write reads them, and the wrapped variable's never change.
        self._self_guard = _guard_for(variable, version, lock)
        self._self_static_shape = _static_shape(variable)
        self._self_dtype = variable.dtype
        # Writes inside strategy.run are merged across replicas first, except for a
        # sync-on-read variable (Keras metrics): each replica writes its own copy.
        self._self_mirrored = isinstance(
            variable, ds_values.DistributedVariable
        ) and not isinstance(variable, ds_values.SyncOnReadVariable)
        # A Python number the op converts itself (float32 <- float, int32 <- int).
        self._self_number_kind = {tf.float32: float, tf.int32: int}.get(variable.dtype)
        # For a plain eager resource variable the write kernels are called directly:
        # ResourceVariable.assign* adds only graph bookkeeping that is empty eagerly, and
        # its Python cost would dominate a scalar write (see the eager benchmark).
        plain = (
            _writes_are_the_kernels(type(variable))
            and variable._cached_value is None
            and isinstance(variable.handle, ops.EagerTensor)
        )
        self._self_handle = variable.handle if plain else None
        self._self_validate_shape = bool(
            plain and variable._validate_shape and variable.shape.is_fully_defined()
        )
        self._self_unread: SafeVariable | None = None  # what eager writes return, made once
        self._self_is_unread = False

    # ------------------------------------------------------------------ identity

    def ref(self) -> object_identity.Reference:
        """A hashable reference to this SafeVariable (``ref().deref()`` is ``self``)."""
        return object_identity.Reference(self)

    experimental_ref = ref

    def __tf_tracing_type__(self, context: Any) -> Any:
        """Passed to a ``tf.function``, a SafeVariable is the object itself inside.

        TensorFlow turns a variable argument into a plain variable over a placeholder of
        its handle; that variable would have no lock and no version. A SafeVariable is
        instead traced as the object it is (the way a ``tf.function`` treats an argument
        it cannot convert, and the way a variable captured by closure is seen), so
        writes through the argument are locked and counted. A function called with
        another SafeVariable is traced again for it.
        """
        return opaque_trace_type(self)

    def __repr__(self) -> str:
        # Plain TensorFlow's, as every other attribute (TensorFlow's own tests compare it);
        # type(v), v.version and v.statistics() tell a SafeVariable apart.
        return repr(self.__wrapped__)

    def _unread(self, write: Any) -> Any:
        """What a write returns with ``read_value=True``, as ``tf.Variable``'s writes do:
        the variable, unread, its reads ordered after ``write`` (the write's op in a
        graph, ``None`` eagerly).

        It is a SafeVariable over TensorFlow's unread variable (``name`` is
        ``"UnreadVariable"`` eagerly, the op's name in a graph) sharing this variable's
        guard, so writes through it are locked and counted here. Nothing is read until
        it is used: a ``tf.function`` that only assigns holds no ``ReadVariableOp``, and a
        read sees the variable when it is made, later writes included, as with plain
        TensorFlow. Eagerly one such view is made per variable and reused. A distributed
        variable makes no unread variable: eagerly ``self``, in a graph a read after
        ``write``.
        """
        eager = write is None
        if eager and self._self_unread is not None:
            return self._self_unread
        if eager and self._self_is_unread:
            return self
        unread = lazy_read(self.__wrapped__, write)
        if unread is None:
            if eager:
                return self
            with tf.control_dependencies([write]):
                return self.__wrapped__.read_value()
        view = type(self).__new__(type(self))
        wrapt.ObjectProxy.__init__(view, unread)
        for attribute in (
            "_self_guard",
            "_self_static_shape",
            "_self_dtype",
            "_self_mirrored",
            "_self_number_kind",
            "_self_handle",
            "_self_validate_shape",
        ):
            setattr(view, attribute, getattr(self, attribute))
        view._self_unread = None
        view._self_is_unread = True
        if eager:
            self._self_unread = view
        return view

    def __copy__(self) -> SafeVariable:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SafeVariable:
        """An independent SafeVariable with the same value and version and a new lock."""
        snap = self.snapshot()
        with tf.init_scope():
            twin = copy.deepcopy(self.__wrapped__, memo)
            twin.assign(snap.value)
        clone = type(self)._from_variable(twin, int(snap.version))
        memo[id(self)] = clone
        return clone

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """Pickles like a plain ``tf.Variable``: value, name, dtype, trainable, constraint.

        The value and the version are taken together (a snapshot); the unpickled
        SafeVariable starts from that version, with a lock of its own (locks are
        per process and never shared with the original). Like a plain variable, only an
        eager, non-distributed variable pickles.
        """
        wrapped = self.__wrapped__
        if type(wrapped) is not resource_variable_ops.ResourceVariable:
            return wrapped.__reduce_ex__(protocol)  # raises where plain TensorFlow does
        snap = self.snapshot()
        return (
            functools.partial(
                _unpickle,
                initial_value=snap.numpy(),
                version=snap.version,
                trainable=wrapped.trainable,
                name=wrapped._shared_name,
                dtype=wrapped.dtype,
                constraint=wrapped.constraint,
            ),
            (),
        )

    def __reduce__(self) -> Any:
        return self.__reduce_ex__(2)

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> int | tf.Tensor:
        """Number of completed writes (restored from checkpoints).

        Returns:
          Eagerly, a Python ``int``. Inside a ``tf.function``, an int64 scalar tensor read
          when the graph runs (reading it there switches the variable to run-time mode).
        """
        return self._self_guard.version()

    def statistics(self) -> LockStatistics:
        """A frozen record of this variable's lock state and write count, for debugging."""
        return self._self_guard.statistics()

    @property
    def guard(self) -> Guard:
        """The :class:`~safevars.locking.Guard` (lock and version) of this variable."""
        return self._self_guard

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, timeout: float | None = None) -> Snapshot:
        """An immutable :class:`~safevars.Snapshot` of value and version, taken together.

        Args:
          timeout: Eagerly, seconds to wait at most when the snapshot has to wait for a
            writer (None: no limit); :class:`~safevars.LockTimeoutError` after that.

        Thread safety: value and version belong to the same instant; later writes never
        change the snapshot. Readers do not wait for other readers eagerly (they retry
        if a writer intervened).

        Modes: in a ``tf.function`` the snapshot's ``value`` and ``version`` are tensors
        read inside the variable's critical section.
        """
        return take_snapshots([self], timeout)[0]

    # ------------------------------------------------------------------ checkpoints

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        guard = self._self_guard
        children = dict(self.__wrapped__._trackable_children(save_type, **kwargs))
        if save_type == "savedmodel":
            # What its traced writes capture besides the variable (version, mutex,
            # gate), under a module: the loaded variable is a plain one, which
            # restores no children of its own (safevars.locking.saved_model; it syncs
            # the version variable itself).
            children["safevars"] = saved_guards([guard])
        elif not restoring_saved_model():  # a SavedModel's checkpoint has no versions
            guard.sync_version_var()
            children["safevars_version"] = guard.version_var
        return children

    def _export_to_saved_model_graph(
        self,
        object_map: Any = None,
        tensor_map: Any = None,
        options: Any = None,
        **kwargs: Any,
    ) -> list[Any]:
        # The SavedModel maps the *proxy* to the exported copy of the wrapped variable.
        wrapped = self.__wrapped__
        handles = wrapped._export_to_saved_model_graph(
            object_map=object_map, tensor_map=tensor_map, options=options, **kwargs
        )
        object_map[self] = object_map[wrapped]
        return handles


def _to_tensor(
    value: SafeVariable,
    dtype: tf.DType | None = None,
    name: str | None = None,
    as_ref: bool = False,
) -> tf.Tensor:
    # TensorFlow looks conversion functions up by type(value); the proxy's type is not a
    # tf.Variable subclass, so it needs its own entry (a read of the wrapped variable,
    # recorded on gradient tapes like any variable read).
    return value.__wrapped__._dense_var_to_tensor(dtype=dtype, name=name, as_ref=as_ref)


tensor_conversion_registry.register_tensor_conversion_function(SafeVariable, _to_tensor)
# Every SafeVariable passed to a tf.function is flattened alike, whichever TensorFlow saw
# first (opaque_trace_type).
same_answer_for_every_proxy(SafeVariable, wrapt.ObjectProxy.__init__)


def _constructor_signature() -> inspect.Signature:
    """``SafeVariable(...)``'s parameters: ``tf.Variable``'s, which it forwards.

    Set as the class's ``__signature__``: without it ``inspect.signature(SafeVariable)``
    (notebooks, IDEs, help) followed the ``__wrapped__`` that the proxy class defines (a
    descriptor, not a callable) and raised ``ValueError``.
    """
    plain = inspect.signature(tf.Variable.__init__)
    return plain.replace(parameters=list(plain.parameters.values())[1:])


SafeVariable.__signature__ = _constructor_signature()  # type: ignore[attr-defined]


def _unpickle(version: int, **kwargs: Any) -> SafeVariable:
    # As plain TensorFlow unpickles: a ResourceVariable made directly, so neither a
    # strategy nor a creator scope (safevars.scope) is involved.
    variable = resource_variable_ops.ResourceVariable(**kwargs)
    return SafeVariable._from_variable(variable, version)


# Pickles made before safevars.variable became a package name it there; new ones too.
_unpickle.__module__ = "safevars.variable"


_WRITE_METHODS = ("assign", "assign_add", "assign_sub")
_KERNEL_WRITES: dict[type, bool] = {}  # class -> _writes_are_the_kernels(class)


def _writes_are_the_kernels(cls: Any) -> bool:
    """Whether the eager writes of a variable of class ``cls`` only call the write
    kernels (then :meth:`SafeVariable.assign` calls them itself): ``ResourceVariable``
    (its writes are ``BaseResourceVariable``'s, behind the dtype wrapper of TensorFlow's
    numpy behaviour, which the SafeVariable's own conversion replaces) and a variable
    created while tracing (``UnliftedInitializerVariable``, an ``UninitializedVariable``:
    the metrics and layers Keras builds inside a traced step), whose writes are
    ``BaseResourceVariable``'s. A class that overrides a write (a user's subclass, a
    distributed variable) keeps its own."""
    answer = _KERNEL_WRITES.get(cls)
    if answer is None:
        base = resource_variable_ops.BaseResourceVariable
        answer = cls is resource_variable_ops.ResourceVariable or (
            issubclass(cls, resource_variable_ops.UninitializedVariable)
            and all(getattr(cls, m) is getattr(base, m) for m in _WRITE_METHODS)
        )
        _KERNEL_WRITES[cls] = answer
    return answer
