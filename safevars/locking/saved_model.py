"""What ``tf.saved_model.save`` needs to export functions that take safevars locks.

A traced write captures, besides the variable, resources that no user object tracks:
the lock's ``tf.CriticalSection`` mutex (not trackable at all), the lock's gate variable
and the variable's version variable (and a joint version counter). Exporting such a
function failed ("references an 'untracked' resource"). Each is exported here as a
``tf.saved_model.experimental.TrackableResource`` holding the handle the functions
captured: the SavedModel maps it to a resource its loader creates, and initializes a
variable to the value it had when saved.

They are not saved as variables: a loaded SavedModel turns a :class:`~safevars.SafeVariable`
into a plain variable, which restores no children of its own, so variables hung off it
would stay uninitialized (the loaded function then failed on its first version add).
A loaded function takes its mutex as the original did: loaded functions that shared a
lock exclude each other.

Keras' ``ExportArchive`` (``model.export``) does not save the objects its endpoints were
traced from: just before writing it tracks the variables their graphs used, which are
the plain ``tf.Variable`` s a SafeVariable wraps, not the SafeVariables that carry these
resources. :func:`tracks_guarded_state` wraps the archive's method that does it: the
guards of those variables (found with :func:`~safevars.locking.guard.guard_of`) are
tracked too, under a ``_safevars`` child, so an endpoint that writes (a layer's state,
a seed generator's, ``training=True``) exports, whether or not the archive ``track`` s
the model.

Loading inside :func:`safevars.scope` makes every variable the loader recreates a
SafeVariable, whose checkpoint children include its version variable; but a SavedModel's
checkpoint never holds one (it saves the resources above instead, or nothing: a
SavedModel written without safevars), and the loader asserts that every object it built
got a value ("Found N Python objects that were not bound to checkpointed values").
:func:`restoring_saved_model` tells a SafeVariable that the loader is restoring, and
:func:`restores_without_versions` wraps the loader's restore in it: there, a SafeVariable
has no version child (its version starts at 0, as a new variable's).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars.locking.guard import guard_of

if TYPE_CHECKING:
    from safevars.locking.guard import Guard

__all__ = [
    "SavedResource",
    "restores_without_versions",
    "restoring_saved_model",
    "saved_guards",
    "saved_mutex",
    "saved_variable",
    "tracks_guarded_state",
]


def _unique_name() -> str:
    # One resource per exported object, never shared by two (a section over two locks
    # that resolved to one mutex would wait on itself).
    return f"safevars_{uuid.uuid4().hex}"


class SavedResource(tf.saved_model.experimental.TrackableResource):
    """A captured resource handle, exported as a resource its loader creates.

    Args:
      handle: The handle traced functions captured.
      create: Creates the resource (in the export graph and when loaded).
      initial: For a variable, returns its value now (read when the SavedModel is
        written; the loaded variable starts at it).
    """

    def __init__(
        self, handle: Any, create: Callable[[], Any], initial: Callable[[], Any] | None = None
    ) -> None:
        super().__init__()
        self._resource_handle = handle
        self._create = create
        self._initial = initial

    def _create_resource(self) -> Any:
        return self._create()

    def _initialize(self) -> None:
        if self._initial is not None:
            with tf.init_scope():
                value = self._initial()
            tf.raw_ops.AssignVariableOp(resource=self.resource_handle, value=value)


# One exported object per mutex and per variable, whichever variables reach it (locks
# and joint counters are shared), kept on the object it exports (variables are not
# hashable); it holds no strong reference back.
_ATTRIBUTE = "_safevars_saved_resource"


def saved_mutex(critical_section: tf.CriticalSection) -> SavedResource:
    """The mutex of ``critical_section``, for a SavedModel."""
    saved = getattr(critical_section, _ATTRIBUTE, None)
    if saved is None:
        saved = SavedResource(
            critical_section._handle,
            lambda: tf.raw_ops.MutexV2(container="", shared_name=_unique_name()),
        )
        setattr(critical_section, _ATTRIBUTE, saved)
    return saved


def _value_of(ref: weakref.ref[Any]) -> tf.Tensor:
    variable = ref()
    if variable is None:  # the SavedResource lives on the variable: it cannot outlive it
        raise RuntimeError("safevars: a saved counter's variable was garbage-collected.")
    return tf.constant(variable.numpy())


def saved_variable(variable: tf.Variable) -> SavedResource:
    """``variable`` (a scalar counter or flag) as a resource that the loaded SavedModel
    creates and initializes to the value it had when the SavedModel was written."""
    saved = getattr(variable, _ATTRIBUTE, None)
    if saved is None:
        dtype, shape, ref = variable.dtype, variable.shape, weakref.ref(variable)
        saved = SavedResource(
            variable.handle,
            lambda: tf.raw_ops.VarHandleOp(dtype=dtype, shape=shape, shared_name=_unique_name()),
            lambda: _value_of(ref),
        )
        setattr(variable, _ATTRIBUTE, saved)
    return saved


def saved_guards(guards: Iterable[Guard]) -> tf.Module:
    """A module holding what functions that write under ``guards`` capture: each
    guard's version, its lock's mutex and gate (in run-time mode) and its joint version
    counter, each once. ``tf.saved_model.save`` finds it as a child of the object that
    returns it from ``_trackable_children(save_type="savedmodel")``."""
    resources: dict[int, SavedResource] = {}  # by id, in order: each once
    for guard in guards:
        guard.sync_version_var()  # an eager-mode version lives in Python until then
        found = [saved_variable(guard.version_var)]
        lock = guard.lock
        if lock.runtime:
            found += [saved_mutex(lock.cs), saved_variable(lock.gate)]
        if guard.joint is not None:
            found.append(saved_variable(guard.joint.variable))
        for resource in found:
            resources.setdefault(id(resource), resource)
    state = tf.Module(name="safevars")
    state.resources = list(resources.values())
    return state


def tracks_guarded_state(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``ExportArchive._filter_and_track_resources`` (see the module
    docstring): after it, the archive's root also tracks :func:`saved_guards` of the
    guards of the variables the endpoints use (``_tf_trackable._all_variables``)."""

    @functools.wraps(original)
    def _filter_and_track_resources(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        root = self._tf_trackable
        found = (guard_of(v) for v in getattr(root, "_all_variables", ()))
        guards = {id(g): g for g in found if g is not None}
        if guards:
            root._safevars = saved_guards(guards.values())
        return result

    _filter_and_track_resources._safevars = True  # type: ignore[attr-defined]
    return _filter_and_track_resources


# ------------------------------------------------------------------ loading a SavedModel

_loading = threading.local()  # .depth: SavedModel restores running in this thread


def restoring_saved_model() -> bool:
    """Whether this thread is inside a SavedModel loader's restore of its variables."""
    return getattr(_loading, "depth", 0) > 0


@contextlib.contextmanager
def _restoring() -> Iterator[None]:
    _loading.depth = getattr(_loading, "depth", 0) + 1
    try:
        yield
    finally:
        _loading.depth -= 1


def restores_without_versions(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps the SavedModel loader's ``_restore_checkpoint`` in :func:`_restoring`."""

    @functools.wraps(original)
    def _restore_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _restoring():
            return original(self, *args, **kwargs)

    _restore_checkpoint._safevars = True  # type: ignore[attr-defined]
    return _restore_checkpoint
