"""Lock coarsening in ``tf.function``: consecutive sections on the same locks share one.

Eight ``v.assign_add(d)`` in a traced function are eight critical sections, each a
``MutexLock``, the write, the version count and a ``ConsumeMutexLock``; the mutex kernel
hands every acquisition to a thread pool, which costs more than a small write. When a
section follows one traced just before it on exactly the same locks, it joins that
section instead: its ops run under the earlier section's lock (control dependencies on
the op that opens it, the gate after its ``MutexLock`` ops) and the earlier release waits
for them too. Other threads then
see both writes or neither, which is stronger than what separate sections promise, and
the lock is taken once.

A join must not create a cycle or a wait out of the global lock order, so it is made
only when all of this holds, and the section is traced on its own otherwise:

* the earlier section is the last one traced in this graph, by this thread, on the same
  locks, with no enclosing section and no ``tf.distribute`` strategy (replica threads
  trace into one graph concurrently), and no op traced since depends on a section's ops
  or on an op that may wait (as below), or is a stateful op without a resource input
  (automatic control dependencies order those after the earlier release, and the new
  body may depend on them: a cycle);
* no op of the new body, the value it writes included, depends on a section's ops
  (``MutexLock`` or ``ConsumeMutexLock``) besides the lock it joins, or on an op that
  may wait for the outside or run other sections (a function call, control flow, a
  queue, an iterator, a collective, a Python function): a joined body runs with the lock
  held, so a value that waits for another lock would be hold-and-wait, the deadlock
  :func:`safevars.sections._traced_section` is built to avoid, and a value computed from
  the earlier section's results (which now wait for the later body) would be a cycle;
* the new body creates no stateful op without a resource input (``Assert``, ``PrintV2``,
  a nested section's release): TensorFlow's automatic control dependencies chain such
  ops in program order after the earlier release, which now waits for the body (a
  cycle).

If the body turns out not to qualify once traced, it gets mutexes of its own (the
section is then exactly what it would have been, only built after its body).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable
from typing import Any

import tensorflow as tf

from safevars.locking import SectionLock

__all__ = [
    "OpenSection",
    "after_release",
    "can_join",
    "join",
    "may_wait_or_lock",
    "open_section",
    "record",
]

_SECTION_OPS = frozenset(("MutexLock", "ConsumeMutexLock"))
# Ops that may wait for something outside the function (another thread's enqueue, a
# peer, Python) or run a graph that may take other locks: a joined section must not
# hold its lock while waiting for one of them.
_MAY_WAIT = frozenset(
    (
        "PartitionedCall",
        "StatefulPartitionedCall",
        "If",
        "StatelessIf",
        "While",
        "StatelessWhile",
        "Case",
        "StatelessCase",
        "EagerPyFunc",
        "PyFunc",
        "PyFuncStateless",
        "QueueDequeueV2",
        "QueueDequeueManyV2",
        "QueueDequeueUpToV2",
        "IteratorGetNext",
        "IteratorGetNextSync",
        "IteratorGetNextAsOptional",
        "CollectiveReduceV2",
        "CollectiveGatherV2",
        "CollectiveBcastRecvV2",
        "CollectiveAllToAllV2",
        "_Recv",
        "Recv",
        "Barrier",
        "BarrierTakeMany",
    )
)


@dataclasses.dataclass(eq=False)
class OpenSection:
    """The last section traced in a graph, which a following one may join."""

    locks: tuple[SectionLock, ...]
    thread: threading.Thread
    tokens: list[tf.Tensor]  # what a joining body waits for: the gate (sections._mutex_locks)
    releases: list[Any]  # the ConsumeMutexLock ops
    end: int  # how many ops the graph had when the section's results were made


# Per-graph state lives on the graph object itself, never in a map keyed by graph: the
# state holds the graph's ops, which hold the graph, so a WeakKeyDictionary entry would
# keep every traced graph alive for good (it did: a leak of one FuncGraph per trace).
# The attributes form a cycle with the graph that the garbage collector frees with it.
_OPEN_ATTRIBUTE = "_safevars_open_section"  # the section the next one may join; popped
# by every section traced in the graph, so only consecutive ones join
_DEPENDS_ATTRIBUTE = "_safevars_depends_on_section"  # {op: depends on a section op?};
# ops do not change once created except the releases (section ops in any case) and
# automatic control dependencies, which are added when the function is finished
_LOCK = threading.Lock()


def open_section(graph: Any) -> OpenSection | None:
    """Takes the graph's open section (none is open afterwards)."""
    with _LOCK:
        section: OpenSection | None = getattr(graph, _OPEN_ATTRIBUTE, None)
        setattr(graph, _OPEN_ATTRIBUTE, None)
        return section


def record(graph: Any, section: OpenSection) -> None:
    """Marks ``section`` as the one the next section of ``graph`` may join."""
    with _LOCK:
        setattr(graph, _OPEN_ATTRIBUTE, section)


def can_join(graph: Any, section: OpenSection, ordered: list[SectionLock]) -> bool:
    """Whether a section on ``ordered`` may try to join ``section`` (see :func:`join`).

    Not if an op traced since ``section`` depends on a section's ops (its results, say)
    or will (a stateful op without a resource input, such as an ``Assert``, which
    TensorFlow's automatic control dependencies order after the earlier release): the
    new body may depend on such an op, or be ordered after it (a read of the same
    variable), and it would wait for a release that waits for the body.
    """
    if section.thread is not threading.current_thread() or section.locks != tuple(ordered):
        return False
    if tf.distribute.has_strategy():
        return False
    since = graph.get_operations()[section.end :]
    return not any(_orders_after_release(op) or _depends_on_section(graph, op) for op in since)


def join(
    graph: Any,
    section: OpenSection,
    fn: Callable[[], Any],
    trace: Callable[[Callable[[], Any]], Any],
    own_section: Callable[[Any, list[Any]], Any],
) -> Any:
    """Traces ``fn`` into ``section``; returns its results made to wait for the release.

    ``trace(fn)`` traces the body with the section stack set up; ``own_section(result,
    created)`` builds separate mutexes around an already traced body: the fallback when
    the body may not join (:func:`_may_join`), which also covers a value to write that
    comes from a section (an input of the body's write op).
    """
    before = len(graph.get_operations())
    with tf.control_dependencies(section.tokens):
        result = trace(fn)
    created = graph.get_operations()[before:]
    if not _may_join(graph, section, created):
        return own_section(result, created)
    for release in section.releases:
        release._add_control_inputs(created)
    with tf.control_dependencies(section.releases):
        leaves = [after_release(x) for x in tf.nest.flatten(result)]
    section.end = len(graph.get_operations())
    record(graph, section)
    return tf.nest.pack_sequence_as(result, leaves)


def _may_join(graph: Any, section: OpenSection, created: list[Any]) -> bool:
    """Whether a traced body may run under ``section``'s lock (see the module doc)."""
    if any(_orders_after_release(op) for op in created):
        return False
    # The section's own ops: the new body, its locks and the bodies already joined (what
    # its releases wait for). Depending on those is no cycle: they run under the same
    # locks, before the releases (a write waits for the version count of the previous
    # write of its variable: safevars.variable.write_order).
    own = set(created) | {t.op for t in section.tokens}
    for release in section.releases:
        own.update(release.control_inputs)
    return not any(
        _depends_on_section(graph, source)
        for op in created
        for source in _sources(op)
        if source not in own
    )


def _sources(op: Any) -> Iterable[Any]:
    yield from (t.op for t in op.inputs)
    yield from op.control_inputs


def _orders_after_release(op: Any) -> bool:
    """A stateful op without a resource input: automatic control dependencies would order
    it after the earlier release, which is about to wait for it."""
    if not op._is_stateful:
        return False
    return not any(t.dtype == tf.resource for t in op.inputs)


def may_wait_or_lock(op: Any) -> bool:
    """Whether ``op`` is a section's op (``MutexLock``, ``ConsumeMutexLock``) or may wait
    for something outside the function or run a graph that may take other locks
    (``_MAY_WAIT``): a lock must not be held while it runs."""
    return op.type in _SECTION_OPS or op.type in _MAY_WAIT


def _depends_on_section(graph: Any, op: Any) -> bool:
    """Whether ``op`` is, or depends on, a section's op (``MutexLock``,
    ``ConsumeMutexLock``) or an op that may wait or take other locks (``_MAY_WAIT``: a
    function call, control flow, a queue, an iterator, a collective, Python), iteratively,
    memoized per graph."""
    with _LOCK:
        memo: dict[Any, bool] | None = getattr(graph, _DEPENDS_ATTRIBUTE, None)
        if memo is None:
            memo = {}
            setattr(graph, _DEPENDS_ATTRIBUTE, memo)
    stack = [op]
    while stack:
        current = stack[-1]
        if current in memo:
            stack.pop()
            continue
        if may_wait_or_lock(current):
            memo[current] = True
            stack.pop()
            continue
        pending = [s for s in _sources(current) if s not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[current] = any(memo[s] for s in _sources(current))
        stack.pop()
    return memo[op]


def after_release(x: Any) -> Any:
    """``x`` as seen after a section's release (built under its control dependency):
    a tensor through an identity, an op (a write with ``read_value=False``) as a no-op."""
    if isinstance(x, tf.Tensor):
        return tf.identity(x)
    if isinstance(x, tf.Operation):
        return tf.no_op()
    return x
