"""Joint versions: one add counts a write of every variable in a set written together.

A :class:`SafeOptimizer` step writes every model variable once. Counting that with one
int64 add per variable version costs a kernel each (52 on a 52-variable model, about
0.2 ms of a 2.3 ms step on a 2-core CPU), and TensorFlow has no op that adds to several
variables at once. Variables that share a lock and are always written together can
instead share one *joint counter*: a step that writes exactly that set adds 1 to the
counter, once, and each member's version is

    version = its version variable + the joint counter

in run-time mode (eagerly before that, the Python ``int`` of :class:`Guard` is the
version, as for any variable). Every other write of a member (a single ``assign``, a
step that writes only some of the set) adds to its own version variable as before, so
each variable's version still counts exactly its own writes.

Invariants, all kept under the members' locks (every write of the counter is made by a
section that holds the lock of every member; every reader holds one member's lock or
validates with the lock's sequence number):

* The members and their counter are fixed once made: :func:`join_versions` refuses when
  any member's lock has been used by a traced graph already, so every graph that reads a
  member's version reads the counter too.
* The version variable stores the version minus the counter: switching to run-time mode,
  ``set_version`` and checkpoint restores subtract it, checkpoint saves add it back. A
  checkpoint holds the same entry, under the same key, as before joint versions: plain
  and joint-counted variables read each other's files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars.locking.holding import hold_locks
from safevars.locking.joint_counter import JointCounter

if TYPE_CHECKING:
    from safevars.locking.guard import Guard

__all__ = ["bump_eager_together", "bump_graph_together", "join_versions"]


def join_versions(guards: Sequence[Guard]) -> bool:
    """Gives ``guards`` one joint counter, where that is safe.

    Returns:
      Whether they now share a counter. False (nothing changed) when fewer than two
      guards are given, they do not share one lock (:func:`share_lock` first), a guard
      already has a counter, or a traced graph has read the version of one of them
      (such a graph reads the version without the counter).

    Thread safety: made with the shared lock held. A graph traced meanwhile that reads
    a member's version counts itself in ``Guard.graph_reads`` before it looks at
    ``joint``, which is checked again once the counter is set: either that graph sees
    the counter or the join is undone (a counter never added to adds nothing).

    Modes: eagerly, or while tracing (the counter is made in the init scope).
    """
    guards = list(dict.fromkeys(guards))
    if len(guards) < 2:
        return False
    lock = guards[0].lock
    if any(g.lock is not lock or g.joint is not None or g.graph_reads for g in guards):
        return False
    with tf.init_scope(), hold_locks([lock]):
        if any(g.lock is not lock or g.joint is not None or g.graph_reads for g in guards):
            return False
        counter = JointCounter(guards, guards[0].version_var.device)
        # The counter starts at 0, so each version variable already stores its version
        # minus the counter: nothing to move. Set last: a guard with a counter is complete.
        for guard in guards:
            guard.joint = counter
        if any(g.graph_reads for g in guards):  # a graph read a version meanwhile
            for guard in guards:
                guard.joint = None
            return False
    return True


def _distinct_counter(guards: Sequence[Guard]) -> JointCounter | None:
    if len(guards) < 2:
        return None
    counter = guards[0].joint
    if counter is None or not counter.counts_exactly(guards):
        return None
    return counter


def bump_graph_together(guards: Sequence[Guard], after: Any, writes: Any = 1) -> None:
    """Graph ops adding ``writes`` to each guard's version once ``after`` has run.

    One add on the joint counter when ``guards`` are exactly its members, else one add
    per guard. The caller traces it inside a section holding every guard's lock.
    """
    counter = _distinct_counter(guards)
    if counter is None:
        for guard in guards:
            guard.bump_graph(after, writes)
        return
    with tf.control_dependencies([after] if after is not None else []):
        counter.variable.assign_add(writes, read_value=False)


def bump_eager_together(guards: Sequence[Guard], writes: int = 1) -> None:
    """Adds ``writes`` to each guard's version, eagerly; the caller holds their locks.

    In run-time mode, with ``guards`` exactly a joint counter's members, one kernel;
    otherwise each guard counts its own (a Python ``int`` before run-time mode).
    """
    counter = _distinct_counter(guards)
    if counter is None or not all(g.lock.runtime for g in guards):
        for guard in guards:
            guard.bump_eager(writes)
        return
    for guard in guards:
        guard._writes += writes
    counter.variable.assign_add(writes, read_value=False)
