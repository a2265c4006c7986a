"""Which locks a traced graph takes, and the eager call that would wait on its own lock.

A graph section takes its locks' ``tf.CriticalSection`` mutexes with ``MutexLock`` ops,
and an eager section holds the same mutex (run-time mode, :mod:`safevars.locking`). A
thread that holds a lock eagerly (``safevars.locked``, ``safevars.transaction``) and
then calls a ``tf.function`` whose graph takes that lock would wait for itself forever:
the graph's ``MutexLock`` waits for the eager holder, which waits for the call to
return. ``tf.CriticalSection.execute`` has the same trap, which TensorFlow detects only
within one graph.

So every graph that traces a ``MutexLock`` records the lock (:func:`record_graph_locks`,
on the graph and the graphs enclosing it: a ``tf.cond`` branch, a loop body, a function
traced inline), a call of one traced function inside another adds the callee's locks to
the caller's graph (:mod:`~safevars.sections.compiled_calls`), and an eager call of a
function whose graph takes a lock the calling thread holds raises
:class:`~safevars.LockReentryError` before anything runs (:func:`check_not_held`). That
covers a function traced elsewhere and merely called inside the block, ``model.fit``,
``evaluate`` and ``train_on_batch`` inside ``safevars.locked(model)``, and a callback
that calls one of those. An XLA-compiled function takes its locks around the call
instead (re-entrantly), so calling one inside the block is sound and runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from safevars import _tf_internal as tfi
from safevars import locking
from safevars.errors import LockReentryError
from safevars.locking import SectionLock

__all__ = ["check_not_held", "current_graph_records", "graph_locks", "record_graph_locks"]

_GRAPH_LOCKS = "_safevars_mutex_locks"  # FuncGraph attribute: locks whose MutexLock it runs
_NONE: frozenset[SectionLock] = frozenset()


def record_graph_locks(graph: Any, locks: Iterable[SectionLock]) -> None:
    """Notes that running ``graph`` takes ``locks``' mutexes (on it and every function
    graph around it; not on the eager context's global graph, where nothing reads them
    and the record would keep every lock, and its mutex, alive for good)."""
    new = frozenset(locks)
    if not new:
        return
    while isinstance(graph, tfi.FuncGraph):
        recorded = getattr(graph, _GRAPH_LOCKS, _NONE)
        if not new <= recorded:  # replaced, never changed: graph_locks hands this set out
            setattr(graph, _GRAPH_LOCKS, recorded | new)
        graph = getattr(graph, "outer_graph", None)


def graph_locks(function: Any) -> frozenset[SectionLock]:
    """The locks whose mutexes a traced function (a ``ConcreteFunction``) takes."""
    return getattr(getattr(function, "_func_graph", None), _GRAPH_LOCKS, _NONE)


def check_not_held(function: Any, locks: frozenset[SectionLock]) -> None:
    """Raises LockReentryError if the calling thread holds a lock eagerly that
    ``function``'s graph takes (``locks``: its :func:`graph_locks`), so that the call
    would wait on it forever. Nothing runs."""
    if not locks:
        return
    held = locking._held()
    if not held:
        return
    me = locking._current_thread()
    mine = [lock for lock in held if lock in locks and locking._holding(lock, me)]
    if not mine:
        return
    variables = sorted({name.split(":")[0] for lock in mine for name in lock.names})
    names = ", ".join(variables[:4]) + (
        f" and {len(variables) - 4} more" if len(variables) > 4 else ""
    )
    graph = getattr(function, "_func_graph", None)
    name = getattr(graph, "name", None) or "a tf.function"
    raise LockReentryError(
        f"Calling the tf.function {name!r} here would hang: it takes the lock of "
        f"{names} when it runs, and this thread holds that lock (inside "
        "safevars.locked or safevars.transaction), so the function would wait for its own "
        "caller forever. Call it outside the locked block (model.fit, evaluate and "
        "train_on_batch take the model's lock for each step themselves); to make the call "
        "and other writes one critical section, do them in one tf.function inside "
        "safevars.transaction([...], fn). Nothing ran."
    )


def current_graph_records(locks: Iterable[SectionLock]) -> None:
    """Records ``locks`` on the graph being traced now (a callee's, at its call)."""
    record_graph_locks(tfi.default_graph(), locks)
