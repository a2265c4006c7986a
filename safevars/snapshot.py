"""Immutable snapshots of one or several SafeVariables, taken at one instant.

Eagerly, :func:`snapshot` is a *sequence-lock* reader: it reads every guard's sequence
number, then the values and versions, then the sequence numbers again, and retries if a
critical section opened or closed on any of the variables in between. Readers therefore
never wait for each other, and a snapshot of several variables is consistent with every
transaction on them (no torn reads). After 64 unlucky retries (a writer that never
pauses) it falls back to taking the locks, which bounds its time.

Variables in run-time mode (written inside a ``tf.function``) are snapshotted under their
``tf.CriticalSection`` mutexes, because graph writes do not move the Python sequence
numbers; such snapshots serialize with each other.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars.errors import InvalidArgumentError
from safevars.locking import graph_section, guards_of, hold

__all__ = ["Snapshot", "snapshot", "take_snapshots"]

_MAX_OPTIMISTIC_TRIES = 64


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

    def __init__(self, value: tf.Tensor, version: int | tf.Tensor, name: str) -> None:
        object.__setattr__(self, "value", value)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_array", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Snapshot is immutable; cannot set {name!r}.")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Snapshot is immutable; cannot delete {name!r}.")

    def numpy(self) -> np.ndarray:
        """The value as a read-only NumPy array (eager only; computed once)."""
        if self._array is None:
            array = np.array(self.value.numpy(), copy=True)
            array.setflags(write=False)
            object.__setattr__(self, "_array", array)
        return self._array

    def __tf_tensor__(self, dtype: tf.DType | None = None, name: str | None = None) -> Any:
        if dtype is not None and dtype != self.value.dtype:
            return tf.cast(self.value, dtype, name=name)
        return self.value

    def __repr__(self) -> str:
        version = self.version
        shown = self.value.numpy() if tf.executing_eagerly() else self.value
        return f"Snapshot(name={self.name!r}, version={version}, value={shown!r})"


def take_snapshots(variables: Sequence[Any]) -> list[Snapshot]:
    """Snapshots of ``variables`` (SafeVariables), all taken at one instant."""
    guards = guards_of(variables, "variables")
    wrapped = [v.__wrapped__ for v in variables]
    names = [g.name for g in guards]
    if not tf.executing_eagerly():

        def read() -> list[tuple[tf.Tensor, tf.Tensor]]:
            return [(w.read_value(), g.version_var.read_value()) for w, g in zip(wrapped, guards)]

        pairs = graph_section(guards, read)
        return [Snapshot(value, version, n) for (value, version), n in zip(pairs, names)]

    if not any(g.runtime for g in guards):
        me = threading.get_ident()
        for _ in range(_MAX_OPTIMISTIC_TRIES):
            before = [g.seq for g in guards]
            busy = [g for g, s in zip(guards, before) if s & 1 and g._owner != me]
            if busy:
                for g in busy:  # Wait for the writer (never for another reader).
                    g._mutex.acquire()
                    g._mutex.release()
                continue
            values = [w.read_value() for w in wrapped]
            versions = [g._version for g in guards]
            if [g.seq for g in guards] == before and not any(g.runtime for g in guards):
                return [Snapshot(*t) for t in zip(values, versions, names)]
    with hold(guards):
        values = [w.read_value() for w in wrapped]
        versions = [g.version() for g in guards]
    return [Snapshot(*t) for t in zip(values, versions, names)]


def snapshot(structure: Any) -> Any:
    """Snapshots of a list, tuple or dict of SafeVariables, all taken at one instant.

    Args:
      structure: A SafeVariable, or a (nested) list, tuple or dict of them.

    Returns:
      The same structure with a :class:`Snapshot` in place of each variable.

    Raises:
      InvalidArgumentError: a leaf is not a SafeVariable.

    Thread safety: the snapshots are consistent with every ``safevars.transaction`` and
    ``safevars.locked`` section on those variables: a transaction is seen whole or not at
    all. Eagerly, readers never wait for other readers.

    Modes: in a ``tf.function``, values and versions are tensors read inside the
    variables' critical sections, taken in the global lock order.
    """
    leaves = tf.nest.flatten(structure, expand_composites=False)
    if not leaves:
        raise InvalidArgumentError(
            "snapshot(structure) needs at least one SafeVariable, got an empty structure."
        )
    guards_of(leaves, "structure")
    return tf.nest.pack_sequence_as(structure, take_snapshots(leaves))
