"""Lock coarsening in ``tf.function``: consecutive sections on the same locks share one.

Eight ``v.assign_add(d)`` in a traced function are eight critical sections, each a
``MutexLock``, the write, the version count and a ``ConsumeMutexLock``; the mutex kernel
hands every acquisition to a thread pool, which costs more than a small write. When a
section follows one traced just before it on exactly the same locks, it joins that
section instead: its ops run under the earlier section's lock (control dependencies on
the op that opens it: its last ``MutexLock`` or a gate behind it, see
:mod:`safevars.sections.gate`) and the earlier release waits for them too. Other threads
then see both writes or neither, which is stronger than what separate sections promise,
and the lock is taken once.

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
  :func:`safevars.sections.section._traced_section` is built to avoid, and a value computed from
  the earlier section's results (which now wait for the later body) would be a cycle;
* the new body creates no stateful op without a resource input (``Assert``, ``PrintV2``,
  a nested section's release): TensorFlow's automatic control dependencies chain such
  ops in program order after the earlier release, which now waits for the body (a
  cycle).

If the body turns out not to qualify once traced, it gets mutexes of its own (the
section is then exactly what it would have been, only built after its body).

Version counts. A plain write (``v.assign(x)``, ``assign_add``, ``assign_sub``: a
section whose body is that one write) leaves its version count to the section
(:func:`deferring`, :func:`defer_count`): the count is traced after the body
(:func:`count_writes`), and a write that joins a section where its variable was
counted already adds to that count instead of tracing one more: eight joined
``v.assign_add(d)`` add 8 to the version with one ``AssignAddVariableOp`` that runs after
the eighth write, not eight. Other threads see the version move by 8 at once, with the
eight writes, which is what the joined section promises them anyway. A count is not
merged when an op traced since it uses the version variable (a read of ``v.version``
between the writes sees the count of the writes before it), under a ``tf.distribute``
strategy, or when the count is not a single ``AssignAddVariableOp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.locking import SectionLock
from safevars.sections.gate import Ungated, narrow, op_sources, stateful

__all__ = [
    "OpenSection",
    "after_release",
    "can_join",
    "count_writes",
    "defer_count",
    "deferring",
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
class Count:
    """A section's version count of one variable: its ``AssignAddVariableOp``, how many
    writes it counts, and how many ops the graph had when it was made or last merged
    into (the ops before are known not to use its version variable)."""

    op: Any
    writes: int
    end: int


@dataclasses.dataclass(eq=False)
class OpenSection:
    """The last section traced in a graph, which a following one may join."""

    locks: tuple[SectionLock, ...]
    thread: threading.Thread
    tokens: list[tf.Tensor]  # what a joining body waits for: the last MutexLock or a gate
    releases: list[Any]  # the ConsumeMutexLock ops
    end: int  # how many ops the graph had when the section's results were made
    counts: dict[Any, Count]  # guard -> the version count a joining write may add to
    members: set[Any]  # the ops of its bodies (the releases wait for the stateful ones)
    # While the section waits for its last MutexLock directly: the ops that wait for it
    # (safevars.sections.gate); None once it has a gate.
    ungated: Ungated | None = None


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
# Per thread: a stack of [graph, depth, deferred counts] for the section bodies being
# traced (sections.section._traced_section pushes one around each body).
_local = threading.local()


@contextlib.contextmanager
def deferring(graph: Any, depth: int) -> Iterator[list[tuple[Any, Any, int]]]:
    """While a section body is traced: collects the version counts its plain write leaves
    to the section (:func:`defer_count`) as ``(guard, write op, writes)``.

    ``depth`` is the length of the stack of section bodies being traced
    (``tracing._graph_held``) with this one pushed: a count is deferred only by the
    body at the top, never into an enclosing section's list.
    """
    stack = _local.__dict__.setdefault("deferred", [])
    pending: list[tuple[Any, Any, int]] = []
    stack.append((graph, depth, pending))
    try:
        yield pending
    finally:
        stack.pop()


def defer_count(guard: Any, write: Any, writes: int, depth: int) -> bool:
    """Leaves the count of ``writes`` versions of ``guard`` for ``write`` to the section
    whose body is being traced at ``depth``: True if it does (the caller traces no
    count), False if no such body is being traced in the write's graph, the write is not
    one op (a slice assignment returns the variable), or a strategy is in scope (the
    caller counts it itself)."""
    stack = getattr(_local, "deferred", None)
    if not stack or not isinstance(write, tf.Operation) or tf.distribute.has_strategy():
        return False
    graph, top, pending = stack[-1]
    if graph is not write.graph or top != depth:
        return False
    pending.append((guard, write, writes))
    return True


def count_writes(
    graph: Any, pending: list[tuple[Any, Any, int]], section: OpenSection | None
) -> dict[Any, Count]:
    """Traces the counts a body deferred; returns the counts of the section.

    With ``section`` (a body that joined it) a variable it counted already gets its
    writes added to that count, unless an op traced since uses the version variable;
    without (a section of its own), every variable gets a count of its own. Each count
    runs after its writes.
    """
    counts: dict[Any, Count] = {} if section is None else section.counts
    for guard, write, writes in pending:
        count = counts.get(guard)
        if count is not None and not _version_used_since(graph, count):
            count.writes += writes
            with tf.control_dependencies(None):
                total = tf.constant(count.writes, tf.int64)
            tfi.set_input(count.op, 1, total)
            count.op._add_control_inputs([write])
            count.end = len(graph.get_operations())  # checked up to here: scan each op once
            continue
        op = guard.bump_graph(write, writes)
        if isinstance(op, tf.Operation) and op.type == "AssignAddVariableOp":
            # bump_graph's control dependency on the write reaches the op through its
            # constant input (TensorFlow adds none to an op whose inputs were made in
            # the same control-dependency scope), which a merge replaces: make it
            # explicit.
            op._add_control_inputs([write])
            counts[guard] = Count(op, writes, len(graph.get_operations()))
        else:
            counts.pop(guard, None)
    return counts


def _version_used_since(graph: Any, count: Count) -> bool:
    """Whether an op traced after ``count`` uses its version variable (a read of the
    version, another count): adding to ``count`` would then change what it sees."""
    handle = count.op.inputs[0]
    return any(t is handle for op in graph.get_operations()[count.end :] for t in op.inputs)


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
    trace: Callable[[Callable[[], Any]], tuple[Any, list[tuple[Any, Any, int]]]],
    own_section: Callable[[Any, list[Any], dict[Any, Count]], Any],
) -> Any:
    """Traces ``fn`` into ``section``; returns its results made to wait for the release.

    ``trace(fn)`` traces the body with the section stack set up and returns its result
    and the counts it deferred (:func:`deferring`); ``own_section(result, created,
    counts)`` builds separate mutexes around an already traced body: the fallback when
    the body may not join (:func:`_may_join`), which also covers a value to write that
    comes from a section (an input of the body's write op).
    """
    before = len(graph.get_operations())
    with tf.control_dependencies(section.tokens):
        result, pending = trace(fn)
    if not _may_join(graph, section, graph.get_operations()[before:]):
        counts = count_writes(graph, pending, None)
        return own_section(result, graph.get_operations()[before:], counts)
    count_writes(graph, pending, section)
    created = graph.get_operations()[before:]
    narrow(section.tokens[0].op, created)
    if section.ungated is not None:  # no gate yet: one if the lock now readies many ops
        gate = section.ungated.add(created)
        if gate is not section.ungated.opener:
            section.tokens, section.ungated = [gate], None
    for release in section.releases:
        release._add_control_inputs(stateful(created))
    section.members.update(created)
    with tf.control_dependencies(section.releases):
        leaves = [after_release(x) for x in tf.nest.flatten(result)]
    section.end = len(graph.get_operations())
    record(graph, section)
    return tf.nest.pack_sequence_as(result, leaves)


def _may_join(graph: Any, section: OpenSection, created: list[Any]) -> bool:
    """Whether a traced body may run under ``section``'s lock (see the module doc)."""
    if any(_orders_after_release(op) for op in created):
        return False
    # The section's own ops: the new body, its locks and gates, and the bodies already
    # joined. Depending on those is no cycle: they run under the same locks, before the
    # releases (a write waits for the version count of the previous write of its
    # variable: safevars.variable.write_order).
    own = set(created) | {t.op for t in section.tokens} | section.members
    for release in section.releases:
        own.update(release.control_inputs)
    return not any(
        _depends_on_section(graph, source)
        for op in created
        for source in op_sources(op)
        if source not in own
    )


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
        pending = [s for s in op_sources(current) if s not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[current] = any(memo[s] for s in op_sources(current))
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
