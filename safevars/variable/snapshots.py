"""Snapshots of one or several SafeVariables, taken at one instant: how they are read.

:class:`Snapshot` is the immutable record; :func:`take_snapshots` reads SafeVariables
(``SafeVariable.snapshot`` and :func:`safevars.snapshot` call it).

Eagerly, it first tries a *sequence-lock* read: it reads every lock's sequence number,
then the values and versions, then the sequence numbers again. If no critical section
was open and none opened or closed in between, the read is consistent and took no lock:
readers with no writer around never wait, not even for each other. If a writer was in
(or came in), the snapshot does not retry optimistically (under a writer that never
pauses, retries re-read tensors for nothing: 9-18 snapshots against 537 locked reads in
one measured window); it takes the locks, as Linux's ``read_seqbegin_or_lock`` does,
and the next few snapshots of those locks go straight to the locks before trying
optimistically again, so under a busy writer a snapshot costs what a locked read of the
same variables costs. Either way a snapshot of several variables is consistent with
every transaction on them (no torn reads). A snapshot waiting for a lock is let in before
the next thread that enters it (``reader``, :mod:`safevars.locking.acquisition`):
``threading.Lock`` is not fair, and a writer that never pauses took the lock back
before a waiting snapshot woke, so a snapshot waited for many of its sections.

Variables in run-time mode (written inside a ``tf.function``) are snapshotted under their
``tf.CriticalSection`` mutexes, because graph writes do not move the Python sequence
numbers; such snapshots serialize with each other.

Variables under one lock (a model built in a scope) are read under it through
``Guard.call_locked``, the one-lock path writes take, without :class:`hold`'s
bookkeeping (its lists, sorts and finalizer): ``snapshot(model)`` of a 4-weight model in
run-time mode took 361-397 µs through ``hold`` and takes 348-356 µs (2026-11-30, three
alternating processes; reading the 4 weights took 210-230 µs). The rest is two eager
ops: the mutex's ``MutexLock``, which completes on the mutex's own thread (about
120 µs), and the one read of values and versions.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.locking import (
    Guard,
    _current_thread,
    forget_uses,
    guards_of,
    hold,
    pin,
    sorted_locks,
)
from safevars.sections import graph_section

__all__ = ["Snapshot", "scope_weights", "take_snapshots"]

# After an optimistic read fails (a writer was in), this many snapshots of the same
# locks take the locks directly before trying optimistically again: under a writer
# that never pauses, an optimistic read is nearly always wasted work.
_SKIP_OPTIMISTIC = 16


class Snapshot:
    """The value and version of one variable at one instant. Immutable.

    Attributes:
      value: The value, a tensor. Later writes to the variable never change it.
      version: The version at that instant: an ``int`` eagerly, an int64 tensor inside a
        ``tf.function``.
      name: The variable's name.
    """

    __slots__ = ("value", "version", "name", "_array")

    value: tf.Tensor
    version: int | tf.Tensor
    name: str
    _array: np.ndarray | None

    def __init__(self, value: tf.Tensor, version: int | tf.Tensor, name: str) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_array", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Snapshot is immutable; cannot set {name!r}.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Snapshot is immutable; cannot delete {name!r}.")

    @property
    def shape(self) -> tf.TensorShape:
        """The value's shape (so Keras' ``set_weights`` accepts a list of snapshots)."""
        return self.value.shape

    @property
    def dtype(self) -> tf.DType:
        """The value's dtype."""
        return self.value.dtype

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.numpy()
        if dtype is not None and array.dtype != dtype:
            return array.astype(dtype)
        return np.array(array) if copy else array

    def numpy(self) -> np.ndarray:
        """The value as a read-only NumPy array (eager only; computed once)."""
        array = self._array
        if array is None:
            array = np.array(self.value.numpy(), copy=True)
            array.setflags(write=False)
            object.__setattr__(self, "_array", array)
        return array

    def __tf_tensor__(self, dtype: tf.DType | None = None, name: str | None = None) -> Any:
        if dtype is not None and dtype != self.value.dtype:
            return tf.cast(self.value, dtype, name=name)
        return self.value

    def __repr__(self) -> str:
        version = self.version
        shown = self.value.numpy() if tf.executing_eagerly() else self.value
        return f"Snapshot(name={self.name!r}, version={version}, value={shown!r})"


def _read_eagerly(variables: Sequence[Any]) -> list[tf.Tensor]:
    """Each variable's value, eagerly (one ``ReadVariableOp`` each when plain)."""
    values = []
    for variable in variables:
        wrapped = variable.__wrapped__
        handle = getattr(variable, "_self_handle", None)
        if handle is None:
            values.append(wrapped.read_value())
        else:
            values.append(tfi.read_eagerly(wrapped, handle, wrapped.dtype))
    return values


def scope_weights(structure: Any) -> list[Any] | None:
    """The SafeVariables behind a Keras layer's or model's weights when each weight was
    made in ``safevars.scope()`` (its ``_value`` is a SafeVariable), else None.

    What ``as_safe_variables`` gives for such a layer (each weight's ``wrap`` is its
    ``_value``), without walking a nest: ``snapshot(model)`` of a small model paid
    about as much for that walk as for reading its weights (issue 44).
    """
    keras = sys.modules.get("keras")
    if keras is None or not isinstance(structure, keras.layers.Layer):
        return None
    found = []
    for weight in structure.weights:
        backing = getattr(weight, "_value", None)
        # A SafeVariable is the one object with a guard (this module cannot import its
        # class: safe_variable imports this module).
        if not isinstance(getattr(backing, "_self_guard", None), Guard):
            return None
        found.append(backing)
    return found or None


def _eager_versions(guards: Sequence[Any]) -> list[int]:
    """Each guard's version, eagerly; the caller holds the locks or validates the read.

    What ``Guard.version()`` gives, for fewer ops: a guard in run-time mode counts its
    version variable plus its joint counter, and each of those variables is read with
    one ``ReadVariableOp`` (``version()`` reads through ``ResourceVariable.numpy``: a
    read, an identity and the Python between them), a joint counter once for all its
    members. A guard not in run-time mode counts in Python (``_version``).
    """
    counts: dict[int, int] = {}
    read = tfi.gen_resource_variable_ops.read_variable_op  # (no gradient tape records it)

    def count(variable: Any) -> int:
        key = id(variable)
        if key not in counts:
            counts[key] = int(read(variable.handle, tf.int64))
        return counts[key]

    return [
        count(g.version_var) + (0 if g.joint is None else count(g.joint.variable))
        if g.lock.runtime
        else g._version
        for g in guards
    ]


def _local_cpu(device: str) -> bool:
    return device.startswith("/job:localhost/") and "/device:CPU:" in device


def _read_together(
    variables: Sequence[Any], guards: Sequence[Any]
) -> tuple[list[tf.Tensor], list[int]] | None:
    """Every value and version, eagerly, in one op; the caller holds the locks or
    validates the read. None (nothing read) unless every variable is a plain resource
    variable on one local CPU with its version there too, and no gradient tape records
    (the one op has no gradient; a tape gets one ``ReadVariableOp`` per variable).

    ``_ReadVariablesOp`` reads N variables for the cost of one op: a snapshot of a
    4-weight model read 10 variables (4 values, 4 versions, the joint counter, beside its
    lock's ``MutexLock``) with 9 ops, most of its cost (issue 44). The reads are
    reported to variable watchers as each read would be.
    """
    if tfi.recording_gradients():
        return None
    handles: list[Any] = []
    dtypes: list[Any] = []
    for variable in variables:
        handle = getattr(variable, "_self_handle", None)
        if handle is None:
            return None
        handles.append(handle)
        dtypes.append(variable.__wrapped__.dtype)
    count = len(handles)
    index: dict[int, int] = {}  # id(counter variable) -> its output

    def output(counter: Any) -> int:
        key = id(counter)
        if key not in index:
            index[key] = len(handles)
            handles.append(counter.handle)
            dtypes.append(tf.int64)
        return index[key]

    places = [
        (output(g.version_var), -1 if g.joint is None else output(g.joint.variable))
        if g.lock.runtime
        else None
        for g in guards
    ]
    device = handles[0].device
    if not _local_cpu(device) or any(h.device != device for h in handles):
        return None
    outputs = tfi.read_variables(handles, dtypes)
    for variable in variables:
        tfi.variable_accessed(variable.__wrapped__)
    numbers = [0] * count + [int(counter) for counter in outputs[count:]]  # (each once)
    versions = [
        g._version
        if place is None
        else numbers[place[0]] + (0 if place[1] < 0 else numbers[place[1]])
        for g, place in zip(guards, places)
    ]
    return list(outputs[:count]), versions


def _values_and_versions(
    variables: Sequence[Any], guards: Sequence[Any]
) -> tuple[list[tf.Tensor], list[int]]:
    """Every value and version, eagerly (in one op where :func:`_read_together` can)."""
    together = _read_together(variables, guards)
    if together is not None:
        return together
    return _read_eagerly(variables), _eager_versions(guards)


# Snapshots of at least this many variables whose locks are all in run-time mode read
# every value and version in one call of a traced function (a section of its own),
# instead of taking the locks eagerly and reading each value and version apart.
_BATCH_FROM = 8

# First guard -> {ids of the guards: (weak references to them, their locks, the read)}.
# The traced read holds the handles of the variables and versions, never the guards, so
# an entry goes with its first guard.
_BATCHED: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()
_BATCHED_LOCK = threading.Lock()


def _batched_read(variables: Sequence[Any], guards: list[Any]) -> Any:
    """A function reading ``variables``' values and versions in one traced section.

    Made once per list of guards (and again if one of them moved to another lock or got
    a joint counter); each version is its own count plus its joint counter's, read once
    per counter.
    """
    key = tuple(map(id, guards))
    state = tuple((g.lock, g.lock.cs, g.joint) for g in guards)
    with _BATCHED_LOCK:
        entry = _BATCHED.get(guards[0], {}).get(key)
    if entry is not None:
        refs, traced_state, cached = entry
        if traced_state == state and all(r() is g for r, g in zip(refs, guards)):
            return cached
    wrapped = [v.__wrapped__ for v in variables]
    counters = list({id(g.joint): g.joint for g in guards if g.joint is not None}.values())
    which = [0 if g.joint is None else 1 + counters.index(g.joint) for g in guards]

    def section() -> tuple[list[tf.Tensor], tf.Tensor]:
        def body() -> tuple[list[tf.Tensor], tf.Tensor]:
            values = [tfi.read_value_op(w) for w in wrapped]
            own = [tfi.read_value_op(g.version_var) for g in guards]
            shared = [tfi.read_value_op(c.variable) for c in counters]
            return values, tf.stack([tf.constant(0, tf.int64), *shared, *own])

        return graph_section(guards, body)

    function = tf.function(section, autograph=False).get_concrete_function()
    # Cached, it does not keep the locks in run-time mode: it runs under a pin only.
    forget_uses(function.graph)
    first = len(counters) + 1

    def read() -> tuple[list[tf.Tensor], list[int]]:
        values, counts = function()
        numbers = counts.numpy()
        return values, (numbers[first:] + numbers[which]).tolist()

    with _BATCHED_LOCK:
        _BATCHED.setdefault(guards[0], {})[key] = (tuple(map(weakref.ref, guards)), state, read)
    return read


def take_snapshots(
    variables: Sequence[Any], timeout: float | None = None, guards: list[Any] | None = None
) -> list[Snapshot]:
    """Snapshots of ``variables`` (SafeVariables), all taken at one instant."""
    if guards is None:
        guards = guards_of(variables, "variables")
    names = [g.name for g in guards]
    if (
        len(guards) >= _BATCH_FROM
        and timeout is None
        and tf.executing_eagerly()
        and all(g.lock.mutexed for g in guards)
    ):
        me = _current_thread()
        if not any(g.lock.holder() is me for g in guards):  # (its own: the eager path)
            with pin(sorted_locks(guards)) as mutexed:  # (no switch back meanwhile)
                if mutexed:
                    values, versions = _batched_read(variables, guards)()
                    return [Snapshot(*t) for t in zip(values, versions, names)]
    if not tf.executing_eagerly():
        wrapped = [v.__wrapped__ for v in variables]

        def read() -> list[tuple[tf.Tensor, tf.Tensor]]:
            return [(w.read_value(), g.graph_version()) for w, g in zip(wrapped, guards)]

        pairs = graph_section(guards, read)
        return [Snapshot(value, version, n) for (value, version), n in zip(pairs, names)]

    locks = sorted_locks(guards)
    if not any(lock.mutexed or lock.contended for lock in locks):
        me = _current_thread()
        before = [lock.seq for lock in locks]
        # A section the calling thread holds itself is no obstacle: its reads see its
        # own writes, and nobody else can write meanwhile.
        if not any(s & 1 and lock.holder() is not me for lock, s in zip(locks, before)):
            values, versions = _values_and_versions(variables, guards)
            if [lock.seq for lock in locks] == before and not any(lock.mutexed for lock in locks):
                return [Snapshot(*t) for t in zip(values, versions, names)]
        for lock in locks:  # The next few snapshots of these go straight to the lock.
            lock.contended = _SKIP_OPTIMISTIC
    else:
        for lock in locks:
            if lock.contended:
                lock.contended -= 1
    # A writer was in (or the locks are in run-time mode): read under the locks.
    taken = None
    if len(locks) == 1:  # (a model built in a scope: one lock, without hold's bookkeeping)
        first = guards[0]

        def read_locked() -> tuple[list[tf.Tensor], list[int]] | None:
            lock = first.lock
            if any(g.lock is not lock for g in guards):
                return None  # share_lock regrouped them meanwhile: hold sorts it out
            return _values_and_versions(variables, guards)

        taken = first.call_locked(read_locked, timeout=timeout, reader=True)
    if taken is None:
        with hold(guards, timeout, reader=True):
            taken = _values_and_versions(variables, guards)
    values, versions = taken
    return [Snapshot(*t) for t in zip(values, versions, names)]
