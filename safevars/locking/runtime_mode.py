"""Run-time mode: a lock whose variables are used by traced graphs takes a TF mutex too.

The first time a variable is written, versioned or snapshotted inside a ``tf.function``,
its lock switches to *run-time mode* (:func:`ensure_runtime`): it gets a
``tf.CriticalSection`` and a gate variable (:mod:`safevars.sections.gate`), and each
variable under it stores its version in its version variable (``lock.runtime``).

Eager sections take the mutex as well only once a graph takes it with a ``MutexLock``
op (``lock.mutexed``): a section traced in a ``tf.function`` that is not XLA-compiled.
Even then, an eager section takes it only while an eager call of a function whose graph
takes it runs (``lock.graph_calls``, counted by :mod:`safevars.sections.compiled_calls`
through :func:`~safevars.locking.acquisition.admit_call`, which first waits for an eager
section that did not take it): a ``MutexLock`` hands the lock over on the mutex's own
thread, about 100 µs, most of a small eager section. A lock whose mutex a graph may take
outside such a call is ``untracked``, and every eager section takes the mutex
(:func:`~safevars.locking.acquisition.mark_untracked`): a section traced for a
``tf.data`` transformation or in a TF1 graph (:func:`use_in_graph`), a function called
inside one, and a call on an asynchronous executor.
A section traced inside an XLA-compiled function takes no mutex op: the eager caller
holds the lock around the compiled call (:mod:`safevars.sections.compiled_calls`), so
while every graph user of a lock is compiled, the Python lock alone excludes them all
and an eager step pays no ``MutexLock`` (whose hand-off to the mutex's thread cost
about 30-50 us per call here). Switching to ``mutexed`` takes the lock eagerly first,
so no eager holder that did not take the mutex is still inside when a graph may.

Run-time mode ends with its graphs. Every graph that traces a section over the lock (or
reads a version) is counted as a *use* (:func:`use_in_graph`) until that graph is
garbage-collected: a ``FuncGraph`` lives as long as anything that can run it (its
``ConcreteFunction``, the ``tf.function`` caching it, an outer graph that calls it). When
the last is gone the next eager section over the lock switches it back to eager mode
(:func:`leave_runtime`): it takes the mutex once (waiting for a graph still running),
moves the versions back into Python, and frees the mutex, its thread and the gate. A
graph traced meanwhile counts itself before it looks at the mode, and the switch looks
at the uses again after announcing itself (``lock.leaving``), so a new graph either
keeps the lock in run-time mode or waits for the switch and makes a new mutex.

The lock's mutex is an anonymous resource: TensorFlow keeps it (and, once it was taken,
the thread that hands it over) until it is destroyed, so the lock destroys it when it
leaves run-time mode or is garbage-collected (the deleter TensorFlow's own resource
variables use), never while a graph that takes it is alive. Measured (2026-11-29, 2
cores): 10,000 SafeVariables, each written in a ``tf.function`` and eagerly, then
dropped, keep 1.07 KB each in resident memory against 0.98 KB for plain
``tf.Variable``s (``tests/locking/test_memory.py``); a write traced 1,000 times costs 178
KB per live trace against 111 KB plain, freed with the function but for 33 KB (22 KB
plain).

A trace that fails before any graph uses the mutex switches back
(:func:`undo_runtime`); :func:`drop_runtime` forgets the mode of a lock that
:func:`~safevars.locking.share_lock` emptied.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.errors import LockReentryError
from safevars.locking import acquisition
from safevars.locking.holding import hold_locks
from safevars.locking.section_lock import _guards_of_lock

if TYPE_CHECKING:
    from safevars.locking.section_lock import SectionLock

__all__ = [
    "drop_runtime",
    "ensure_runtime",
    "forget_uses",
    "leave_runtime",
    "pin",
    "undo_runtime",
    "unuse_in_graph",
    "use_in_graph",
]


def ensure_runtime(lock: SectionLock, held_here: bool, mutexed: bool = True) -> bool:
    """Switches ``lock`` to run-time mode (idempotent). Called when tracing a graph.

    The caller counted its graph's use first (:func:`use_in_graph`), so the lock cannot
    leave run-time mode under it.

    Args:
      lock: The lock.
      held_here: Whether the calling thread holds it eagerly (then a switch raises).
      mutexed: The graph being traced takes the lock's mutex with a ``MutexLock`` op
        (not a section inside an XLA-compiled function): eager sections must take it
        too from now on.

    Returns:
      Whether this call made the switch to run-time mode (so a failed trace can undo it).
    """
    if lock.runtime and not lock.leaving and (lock.mutexed or not mutexed):
        return False
    if held_here:
        if lock.runtime and (lock.mutexed or not mutexed):
            return False  # (no switch back runs while this thread holds the lock)
        raise LockReentryError(
            f"A tf.function that writes, versions or snapshots {lock.name!r} is being "
            "traced while this thread holds that variable's lock (inside "
            "safevars.locked or safevars.transaction). Running it there would wait "
            "on the lock its caller holds. Trace and call the function outside the "
            "locked block, or put the whole step inside safevars.transaction([...], "
            "fn) within the tf.function."
        )
    with tf.init_scope(), hold_locks([lock]):
        lock.leaving = False  # (a switch back interrupted before it ended)
        switched = not lock.runtime
        if switched:
            _make_runtime(lock)
        if mutexed:
            lock.mutexed = True
    return switched


def _make_runtime(lock: SectionLock) -> None:
    """The mutex, the gate and the versions in variables; the caller holds the lock."""
    with tf.device(lock.device):
        # A resource of its own: CriticalSection defaults shared_name to the name, and
        # two variables named alike would share (and deadlock) a mutex. The anonymous
        # name makes a new one each time with one eager kernel (a distinct shared_name
        # costs a cached kernel, about 34 KB, each). The deleter destroys it with the
        # lock or when the lock leaves run-time mode.
        cs = tf.CriticalSection(
            name=lock.names[0].split(":")[0] + "_safevars_lock",
            shared_name=tfi.anonymous_name(),
        )
        deleter = tfi.resource_deleter(cs._handle, lock.device)
        gate = tfi.ResourceVariable(
            initial_value=tf.constant(0, tf.int32),
            trainable=False,
            name=lock.names[0].split(":")[0] + "_safevars_gate",
            shape=(),
        )
    lock.cs, lock.cs_deleter, lock.gate = cs, deleter, gate
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
    uses them); the mutex resource is destroyed."""
    lock.runtime, lock.mutexed = False, False
    lock.cs, lock.gate, lock.cs_deleter = None, None, None


# ---------------------------------------------------------------------- graph uses

# A graph's attribute: {lock: [its token in lock.graph_users, its sections over lock]}.
_USES = "_safevars_lock_uses"
_USES_LOCK = threading.Lock()  # (taken while tracing only, never by a finalizer)


def use_in_graph(lock: SectionLock, held_here: bool, mutexed: bool = True) -> bool:
    """Counts the graph being traced as a user of ``lock``, then switches ``lock`` to
    run-time mode (:func:`ensure_runtime`).

    The use lasts until that graph is garbage-collected (or :func:`unuse_in_graph` takes
    it back after a failed trace).

    Returns:
      Whether this call made the switch to run-time mode.
    """
    graph = tfi.default_graph()
    with _USES_LOCK:
        uses = getattr(graph, _USES, None)
        if uses is None:
            uses = {}
            setattr(graph, _USES, uses)
            weakref.finalize(graph, _graph_freed, uses).atexit = False
        entry = uses.get(lock)
        if entry is None:
            token = object()
            lock.graph_users.append(token)  # before the mode is read (see leave_runtime)
            uses[lock] = [token, 1]
        else:
            entry[1] += 1
    switched = ensure_runtime(lock, held_here, mutexed)
    if mutexed and not lock.untracked and tfi.graph_runs_outside_python_calls():
        acquisition.mark_untracked([lock])
    return switched


def unuse_in_graph(lock: SectionLock) -> None:
    """Takes back one :func:`use_in_graph` of the graph being traced (a failed trace)."""
    graph = tfi.default_graph()
    with _USES_LOCK:
        uses = getattr(graph, _USES, {})
        entry = uses.get(lock)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del uses[lock]
            _discard(lock.graph_users, entry[0])


def forget_uses(graph: Any) -> None:
    """Stops counting ``graph`` as a user of its locks: a cached helper function that
    runs only while its caller holds a :func:`pin` on those locks (one that keeps its
    locks in run-time mode only while it runs, not while it is cached)."""
    with _USES_LOCK:
        uses = getattr(graph, _USES, None) or {}
        for lock, (token, _) in list(uses.items()):
            _discard(lock.graph_users, token)
        uses.clear()


@contextlib.contextmanager
def pin(locks: Sequence[SectionLock]) -> Iterator[bool]:
    """Keeps ``locks`` in run-time mode while inside (their mutexes stay the same).

    Yields whether every lock takes its mutex eagerly and is not being switched back
    (then a function traced over their current mutexes may run inside).
    """
    tokens = [object() for _ in locks]
    for lock, token in zip(locks, tokens):
        lock.graph_users.append(token)  # before the mode is read (see leave_runtime)
    try:
        yield all(lock.mutexed and not lock.leaving for lock in locks)
    finally:
        for lock, token in zip(locks, tokens):
            _discard(lock.graph_users, token)


def _graph_freed(uses: dict[Any, list[Any]]) -> None:
    """A graph's finalizer: its locks lose its uses. No lock is taken (a finalizer runs
    wherever the garbage collector runs); ``list.remove`` is one atomic call."""
    for lock, (token, _) in list(uses.items()):
        _discard(lock.graph_users, token)


def _discard(users: list[Any], token: Any) -> None:
    try:
        users.remove(token)
    except ValueError:
        pass


def leave_runtime(lock: SectionLock) -> None:
    """Switches ``lock`` back to eager mode: no graph uses it any more.

    Called by :func:`~safevars.locking.acquisition.enter` with the lock just taken
    (depth 1, sequence number odd), when ``lock.runtime`` and no graph uses it. Every
    prefix leaves a consistent lock: the versions are moved into Python before the
    mode changes, and the mutex is freed last.
    """
    lock.leaving = True
    if lock.graph_users:  # a graph traced meanwhile: it keeps run-time mode
        lock.leaving = False
        return
    if lock.mutexed and lock.cs is not None:
        # Wait for a graph still running (one called asynchronously), then let go.
        token = tfi.mutex_lock(lock.cs._handle)
        del token
    guards = _guards_of_lock(lock)
    versions = [int(g.version_var.numpy()) + g._joint_value() for g in guards]
    for guard, version in zip(guards, versions):
        guard._version = version
    lock.mutexed = False
    lock.runtime = False
    for guard in guards:
        guard.graph_reads = 0  # no graph reads a version without the joint counter now
    lock.cs, lock.gate, lock.cs_deleter = None, None, None
    lock.leaving = False


acquisition.LEAVE_RUNTIME[:] = [leave_runtime]
