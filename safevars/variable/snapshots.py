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
every transaction on them (no torn reads).

Variables in run-time mode (written inside a ``tf.function``) are snapshotted under their
``tf.CriticalSection`` mutexes, because graph writes do not move the Python sequence
numbers; such snapshots serialize with each other.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.locking import _current_thread, forget_uses, guards_of, hold, pin, sorted_locks
from safevars.sections import graph_section

__all__ = ["Snapshot", "take_snapshots"]

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


def _reader(variable: Any) -> Any:
    """A no-argument function reading ``variable``'s value (a fast path when plain)."""
    wrapped = variable.__wrapped__
    handle = getattr(variable, "_self_handle", None)
    if handle is None:
        return wrapped.read_value
    dtype = wrapped.dtype
    return lambda: tfi.read_eagerly(wrapped, handle, dtype)


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

    readers = [_reader(v) for v in variables]
    locks = sorted_locks(guards)
    if not any(lock.mutexed or lock.contended for lock in locks):
        me = _current_thread()
        before = [lock.seq for lock in locks]
        # A section the calling thread holds itself is no obstacle: its reads see its
        # own writes, and nobody else can write meanwhile.
        if not any(s & 1 and lock.holder() is not me for lock, s in zip(locks, before)):
            values = [read() for read in readers]
            versions = [g.version() if g.lock.runtime else g._version for g in guards]
            if [lock.seq for lock in locks] == before and not any(lock.mutexed for lock in locks):
                return [Snapshot(*t) for t in zip(values, versions, names)]
        for lock in locks:  # The next few snapshots of these go straight to the lock.
            lock.contended = _SKIP_OPTIMISTIC
    else:
        for lock in locks:
            if lock.contended:
                lock.contended -= 1
    with hold(guards, timeout):  # A writer was in: read under the locks, as it would.
        values = [read() for read in readers]
        versions = [g.version() for g in guards]
    return [Snapshot(*t) for t in zip(values, versions, names)]
