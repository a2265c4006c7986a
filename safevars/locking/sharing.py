"""share_lock: variables that are always written together share one lock.

Each keeps its own version; a section over them then takes one lock (and a
``tf.function`` step one mutex) instead of one per variable. :class:`SafeOptimizer`
asks for it when it is built, for a model's weights and its own state.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import tensorflow as tf

from safevars.distribute import on_parameter_server
from safevars.locking.holding import hold_locks
from safevars.locking.lock_order import sorted_locks
from safevars.locking.runtime_mode import drop_runtime, ensure_runtime
from safevars.locking.section_lock import _GUARDS_BY_LOCK, _guards_of_lock

if TYPE_CHECKING:
    from safevars.locking.guard import Guard


def share_lock(guards: Sequence[Guard]) -> bool:
    """Makes ``guards`` share one lock, each keeping its own version, where it is safe.

    Variables that are always written together (a model's weights and its optimizer's
    state) then cost one lock per section instead of one per variable, and a
    ``tf.function`` step over them takes one mutex. The merged lock takes the earliest
    place of the merged locks in the global order.

    Returns:
      Whether all ``guards`` now share one lock. False (nothing changed) if one of the
      locks is held, is used by a traced ``tf.function`` already (its graphs take its
      old mutex), or the guards live on different devices of a parameter-server
      cluster.

    Thread safety: the locks are all held while the guards are moved, and a thread that
    waited on an old lock notices the move and takes the new one.

    Modes: eager only (call it while building, not while tracing).
    """
    locks = sorted_locks(guards)
    if len(locks) <= 1:
        return True
    if not tf.executing_eagerly():
        return False
    used = [lock for lock in locks if lock.graph_uses]
    if len(used) > 1 or any(lock._slot for lock in locks):
        return False
    if len({lock.device for lock in locks if on_parameter_server(lock.device)}) > 1:
        return False
    target = used[0] if used else locks[0]
    with hold_locks(locks):
        if any(lock.graph_uses for lock in locks if lock is not target):
            return False
        runtime = any(lock.runtime for lock in locks)
        mutexed = any(lock.mutexed for lock in locks)
        for guard in guards:
            old = guard.lock
            if old is target:
                continue
            guard.lock = target
            _GUARDS_BY_LOCK.setdefault(target, weakref.WeakSet()).add(guard)
            old_set = _GUARDS_BY_LOCK.get(old)
            if old_set is not None:
                old_set.discard(guard)
            target.names.append(guard.name)
    if (runtime and not target.runtime) or (mutexed and not target.mutexed):
        ensure_runtime(target, False, mutexed)
    for lock in locks:
        if lock is not target and not _guards_of_lock(lock):
            drop_runtime(lock)
    return True
