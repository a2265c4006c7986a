"""Run-time mode: a lock whose variables are used by traced graphs takes a TF mutex too.

The first time a variable is written, versioned or snapshotted inside a ``tf.function``,
its lock switches to *run-time mode* (:func:`ensure_runtime`): it gets a
``tf.CriticalSection`` (whose mutex graph sections and, from then on, eager sections
take) and a gate variable (:mod:`safevars.sections.gate`), and each variable under it
stores its version in its version variable. A trace that fails before any graph uses
the mutex switches back (:func:`undo_runtime`); :func:`drop_runtime` forgets the mode
of a lock that :func:`~safevars.locking.share_lock` emptied.
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


def ensure_runtime(lock: SectionLock, held_here: bool) -> bool:
    """Switches ``lock`` to run-time mode (idempotent). Called when tracing a graph.

    Returns:
      Whether this call made the switch (so a failed trace can undo it).
    """
    if lock.runtime:
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
        if lock.runtime:
            return False
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
    return True


def undo_runtime(lock: SectionLock) -> None:
    """Leaves run-time mode again if no traced graph uses the mutex yet."""
    with tf.init_scope(), hold_locks([lock]):
        if lock.runtime and lock.graph_uses == 0:
            drop_runtime(lock)


def drop_runtime(lock: SectionLock) -> None:
    """Forgets run-time mode and its graph objects (the caller checked no traced graph
    uses them)."""
    lock.runtime, lock.cs, lock.gate = False, None, None
