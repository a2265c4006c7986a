"""Run-time mode: a lock whose variables are used by traced graphs takes a TF mutex too.

The first time a variable is written, versioned or snapshotted inside a ``tf.function``,
its lock switches to *run-time mode* (:func:`ensure_runtime`): it gets a
``tf.CriticalSection`` and a gate variable (:mod:`safevars.sections.gate`), and each
variable under it stores its version in its version variable (``lock.runtime``).

Eager sections take the mutex as well only once a graph takes it with a ``MutexLock``
op (``lock.mutexed``): a section traced in a ``tf.function`` that is not XLA-compiled.
A section traced inside an XLA-compiled function takes no mutex op: the eager caller
holds the lock around the compiled call (:mod:`safevars.sections.compiled_calls`), so
while every graph user of a lock is compiled, the Python lock alone excludes them all
and an eager step pays no ``MutexLock`` (whose hand-off to the mutex's thread cost
about 30-50 us per call here). Switching to ``mutexed`` takes the lock eagerly first,
so no eager holder that did not take the mutex is still inside when a graph may.

A trace that fails before any graph uses the mutex switches back
(:func:`undo_runtime`); :func:`drop_runtime` forgets the mode of a lock that
:func:`~safevars.locking.share_lock` emptied.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.errors import LockReentryError
from safevars.locking.holding import hold_locks
from safevars.locking.section_lock import _guards_of_lock

if TYPE_CHECKING:
    from safevars.locking.section_lock import SectionLock

__all__ = ["drop_runtime", "ensure_runtime", "undo_runtime"]


def ensure_runtime(lock: SectionLock, held_here: bool, mutexed: bool = True) -> bool:
    """Switches ``lock`` to run-time mode (idempotent). Called when tracing a graph.

    Args:
      lock: The lock.
      held_here: Whether the calling thread holds it eagerly (then a switch raises).
      mutexed: The graph being traced takes the lock's mutex with a ``MutexLock`` op
        (not a section inside an XLA-compiled function): eager sections must take it
        too from now on.

    Returns:
      Whether this call made the switch to run-time mode (so a failed trace can undo it).
    """
    if lock.runtime and (lock.mutexed or not mutexed):
        return False
    if held_here:
        raise LockReentryError(
            f"A tf.function that writes, versions or snapshots {lock.name!r} is being "
            "traced while this thread holds that variable's lock (inside "
            "safevars.locked or safevars.transaction). Running it there would wait "
            "on the lock its caller holds. Trace and call the function outside the "
            "locked block, or put the whole step inside safevars.transaction([...], "
            "fn) within the tf.function."
        )
    with tf.init_scope(), hold_locks([lock]):
        switched = not lock.runtime
        if switched:
            _make_runtime(lock)
        if mutexed:
            lock.mutexed = True
    return switched


def _make_runtime(lock: SectionLock) -> None:
    """The mutex, the gate and the versions in variables; the caller holds the lock."""
    if True:  # (the block of the switch, kept as it was)
        with tf.device(lock.device):
            # A unique shared_name: CriticalSection defaults it to the name, and
            # two variables named alike would share (and deadlock) a mutex.
            lock.cs = tf.CriticalSection(
                name=lock.names[0].split(":")[0] + "_safevars_lock",
                shared_name=f"safevars_lock_{uuid.uuid4().hex}",
            )
            lock.gate = tfi.ResourceVariable(
                initial_value=tf.constant(0, tf.int32),
                trainable=False,
                name=lock.names[0].split(":")[0] + "_safevars_gate",
                shape=(),
            )
        for guard in _guards_of_lock(lock):
            guard.store_version()
        lock.runtime = True


def undo_runtime(lock: SectionLock) -> None:
    """Leaves run-time mode again if no traced graph uses the mutex yet."""
    with tf.init_scope(), hold_locks([lock]):
        if lock.runtime and lock.graph_uses == 0:
            drop_runtime(lock)


def drop_runtime(lock: SectionLock) -> None:
    """Forgets run-time mode and its graph objects (the caller checked no traced graph
    uses them)."""
    lock.runtime, lock.mutexed, lock.cs, lock.gate = False, False, None, None
