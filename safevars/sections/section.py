"""One critical section inside ``tf.function``: ``MutexLock`` ops around a traced body.

:func:`graph_section` (over guards) and :func:`lock_section` (over locks in the global
order) trace a body between the ``MutexLock`` ops of every lock it needs and the
``ConsumeMutexLock`` ops that release them once every op the body created has run. A
lock held by an enclosing section (:mod:`safevars.sections.tracing`) is not taken
again; a section may join the one traced just before it on the same locks
(:mod:`safevars.sections.coarsening`); its ops wait for the last ``MutexLock`` or a gate
behind it (:mod:`safevars.sections.gate`); inside an XLA-compiled function it records
its locks instead (:mod:`safevars.sections.xla`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import locking
from safevars.distribute import on_parameter_server
from safevars.errors import LockOrderError
from safevars.locking import Guard, SectionLock, sorted_locks
from safevars.sections import coarsening
from safevars.sections.gate import Ungated, narrow, op_sources, open_gate, stateful
from safevars.sections.reentry import record_graph_locks
from safevars.sections.tracing import (
    _enclosing_sections,
    _graph_held,
    _wrapped_body,
    graph_inputs,
)
from safevars.sections.xla import _check_xla_strategy, _record_xla_locks

__all__ = ["defer_count", "graph_section", "lock_section"]


def defer_count(guard: Guard, write: Any, writes: int) -> bool:
    """Leaves the version count of a section body's one write to the section, which
    adds it to a count of the same variable it made already if it can (lock coarsening,
    :mod:`safevars.sections.coarsening`). True if it does; False outside a section body
    being traced (the caller counts the write itself)."""
    return coarsening.defer_count(guard, write, writes, len(_graph_held()))


def graph_section(
    guards: Sequence[Guard], fn: Callable[[], Any], after: Any = (), gated: Sequence[Any] = ()
) -> Any:
    """Traces ``fn`` inside the critical sections of ``guards``' locks (global order).

    Args:
      guards: The guards whose locks to hold while ``fn``'s ops run.
      fn: Traces the section's ops; called once.
      after: Tensors or ops (any nest, composites included) the section waits for before
        it takes its first lock, so that computing them (gradients, the value to write)
        does not hold the lock.
      gated: Ops traced earlier that must also run inside the section (they wait for its
        gate): the reads of a step whose whole span is locked
        (:mod:`safevars.sections.step_span`). None of them may come before an op of ``after``.

    Returns ``fn()``'s result, made to depend on the release of every lock. The locks are
    released only after every op ``fn`` created has run (not only its outputs, which is
    all ``tf.CriticalSection.execute`` waits for).
    """
    return lock_section(sorted_locks(guards), fn, after, gated=gated)


def _reading_unread_results(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with each result that is a write's unread return value read in the body.

    A write with ``read_value=True`` returns the variable unread, read where it is used
    (:meth:`safevars.SafeVariable._unread`, as ``tf.Variable`` does): a write's own
    section reads nothing. What a section body *returns* (a transaction's results) is
    read inside the section, so it is the state the section made, and an exactly-once
    step's discarded section returns zeros in its place (:mod:`safevars.exactly_once`).
    """

    def body() -> Any:
        return tf.nest.map_structure(
            lambda x: tf.convert_to_tensor(x) if getattr(x, "_self_is_unread", False) else x,
            fn(),
        )

    return body


def lock_section(
    ordered: list[SectionLock],
    fn: Callable[[], Any],
    after: Any = (),
    compiled_call: bool = False,
    gated: Sequence[Any] = (),
) -> Any:
    """:func:`graph_section` over locks already sorted in the global order.

    ``compiled_call``: ``fn`` creates the call op of an XLA-compiled function; the
    section takes real mutexes around it although TensorFlow marks the calling graph as
    an XLA context while the call op is built.
    """
    me = locking._current_thread()
    # Inside an XLA-compiled function no mutex op is traced: the caller holds the locks.
    mutexed = compiled_call or not tfi.in_xla_context(tfi.default_graph())
    # Each graph is counted as a user of the lock until it is freed, from before the
    # body is traced: share_lock must not move a variable off a lock the graph being
    # traced takes (a SafeOptimizer built inside a Keras train step's section).
    switched = []
    counted = []
    try:
        for lock in ordered:
            counted.append(lock)
            if locking.use_in_graph(lock, locking._holding(lock, me), mutexed):
                switched.append(lock)
        return _traced_section(ordered, fn, after, compiled_call, gated)
    except BaseException:
        for lock in counted:
            locking.unuse_in_graph(lock)
        for lock in switched:  # A failed trace changes nothing, not even the lock mode.
            locking.undo_runtime(lock)
        raise


def _traced_section(
    ordered: list[SectionLock],
    fn: Callable[[], Any],
    after: Any,
    compiled_call: bool = False,
    gated: Sequence[Any] = (),
) -> Any:
    """The ops of one section: lock every new lock, run ``fn``, release them all.

    The mutexes are taken with the ops ``CriticalSection.execute`` uses (``MutexLock``,
    then ``ConsumeMutexLock`` once the section's ops have run), but flat: one after
    another in the global order, all released together after the body. Nesting one
    ``execute`` per lock would chain every release behind the inner ones. A lock
    already held by a section traced in an enclosing graph (``held_in_graph``) is not
    taken again. A section traced inside another may add only locks that sort after the
    ones held (as eagerly), and every section takes its first lock only once ``after``
    is computed: a lock taken while the section still waits for a value that another
    section produces could deadlock against a graph doing the same the other way round
    (``a.assign(b.update(f))`` in one thread, ``b.assign(a.update(g))`` in another;
    measured here: it hung). ``gated`` ops (traced earlier) are made to wait for the
    gate too; such a section neither joins nor is joined (lock coarsening).
    """
    graph = tfi.default_graph()
    enclosing = _enclosing_sections()
    held: set[SectionLock] = set().union(*(locks for locks, _ in enclosing))
    new = [lock for lock in ordered if lock not in held]
    if not new:
        return fn()
    fn = _wrapped_body(ordered, _reading_unread_results(fn))
    if held:
        top = max(held, key=lambda lock: lock.order)
        if new[0].order < top.order:  # Same rule as eager hold(): no lock out of order.
            raise LockOrderError(
                f"A section traced inside a section holding {top.name!r} takes the lock "
                f"of {new[0].name!r}, which comes earlier in safevars' global lock "
                "order; two such graphs running at once could deadlock. Name every "
                "variable up front: safevars.transaction([a, b, ...], fn)."
            )
    writes: list[Any] = []
    stack = _graph_held()
    if not compiled_call and tfi.in_xla_context(graph):
        # No mutex op compiles: record the locks; the compiled call takes them.
        _check_xla_strategy()
        _record_xla_locks(graph, new)
        stack.append((graph, frozenset(ordered), writes))
        try:
            return fn()
        finally:
            stack.pop()
    inputs = graph_inputs(after)
    previous = coarsening.open_section(graph)
    joinable = not held and not compiled_call and not gated

    def trace(body: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """The body's result and the version counts it left to the section."""
        stack.append((graph, frozenset(ordered), writes))
        try:
            with coarsening.deferring(graph, len(stack)) as pending:
                return body(), pending
        finally:
            stack.pop()

    with tf.device(_section_device(ordered)):
        if joinable and previous is not None and coarsening.can_join(graph, previous, ordered):
            return coarsening.join(
                graph,
                previous,
                fn,
                trace,
                lambda result, created, counts: _own_section(
                    graph, ordered, new, inputs, result, created, joinable, counts
                ),
            )
        locks = _mutex_locks(new, [*inputs, *_previous_releases(graph, gated)])
        gate = locks[-1]
        if gated:  # a step's span: many ops
            gate = open_gate(new[-1], gate)
            for op in gated:
                op._add_control_inputs([gate.op])
        before = len(graph.get_operations())
        with tf.control_dependencies([gate]):
            result, pending = trace(fn)
            counts = coarsening.count_writes(graph, pending, None)
        created = graph.get_operations()[before:]
        narrow(gate.op, created)
        ungated = None
        if gate is locks[-1]:
            ungated = Ungated(new[-1], gate)
            gate = ungated.add(created)
            if gate is not ungated.opener:
                ungated = None
        return _release(
            graph, ordered, new, locks, gate, result, created, joinable, counts, ungated
        )


#: Per tracing thread, the releases (``ConsumeMutexLock`` ops) of the section it traced
#: last in a graph (program order is a thread's: the replica functions of
#: ``strategy.run`` are traced into one graph by a thread each).
_RELEASES_ATTRIBUTE = "_safevars_last_releases"
#: Graphs traced for one op of the graph around them (never reused elsewhere).
_BRANCH_GRAPHS = frozenset({"CondBranchFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph"})


def _previous_releases(graph: Any, gated: Sequence[Any] = ()) -> list[Any]:
    """The releases of the section traced before in ``graph``: the next one takes its
    first lock only after them, in program order, as eagerly.

    Without that edge a graph could hold the locks of its second section while its first
    still waits for a lock (the second's release waits for the first's, TensorFlow's
    automatic control dependencies order them): ``c.update(f)`` then
    ``transaction([a, b], g)`` held ``a`` and ``b`` while waiting for ``c``, and deadlocked
    against anyone taking ``c`` then ``a`` in the global order (an exactly-once save's
    fence, a checkpoint, ``transaction([c, a])``). Not when the earlier releases depend
    on a ``gated`` op (a step span's reads): they wait for this section's gate, and the
    edge would close a cycle. The first section of a ``tf.cond`` branch or a
    ``tf.while_loop`` body comes after the section before the ``If`` or ``While`` op.
    Per tracing thread: the replicas of ``strategy.run``, traced into one graph by a
    thread each, are not ordered after one another.
    """
    me = threading.current_thread()
    g, previous = graph, []
    while g is not None:
        releases = getattr(g, _RELEASES_ATTRIBUTE, None) or {}
        previous = [op for op in releases.get(me, ()) if op.graph is g]
        if previous or type(g).__name__ not in _BRANCH_GRAPHS:
            break
        # The first section of a tf.cond branch or tf.while_loop body: after the last one
        # of the graph around (a control capture: the If or While op waits for it).
        g = getattr(g, "outer_graph", None)
    if previous and gated and _depends_on(previous, set(gated)):
        return []
    return previous


def _depends_on(ops: list[Any], targets: set[Any]) -> bool:
    """Whether any of ``ops`` depends (through inputs or control inputs, in its graph) on
    an op of ``targets``."""
    seen: set[Any] = set()
    stack = list(ops)
    while stack:
        op = stack.pop()
        if op in targets:
            return True
        for parent in op_sources(op):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return False


def _mutex_locks(new: list[SectionLock], inputs: list[Any]) -> list[tf.Tensor]:
    """``MutexLock`` ops for ``new``, one after another in order, the first after
    ``inputs``. The section's ops wait for the last one, directly or through a gate
    (:mod:`safevars.sections.gate`)."""
    locks: list[tf.Tensor] = []
    for lock in new:
        with tf.control_dependencies(locks[-1:] if locks else inputs):
            locks.append(tfi.mutex_lock(lock.cs._handle))
    record_graph_locks(tfi.default_graph(), new)  # an eager holder must not call it
    return locks


def _own_section(
    graph: Any,
    ordered: list[SectionLock],
    new: list[SectionLock],
    inputs: list[Any],
    result: Any,
    created: list[Any],
    joinable: bool,
    counts: dict[Any, Any],
) -> Any:
    """Mutexes of its own around a body already traced (one that may not join)."""
    with tf.device(_section_device(ordered)):
        locks = _mutex_locks(new, [*inputs, *_previous_releases(graph)])
        gate = open_gate(new[-1], locks[-1])  # every stateful op waits for it
        narrow(gate.op, created)
        return _release(graph, ordered, new, locks, gate, result, created, joinable, counts)


def _release(
    graph: Any,
    ordered: list[SectionLock],
    new: list[SectionLock],
    locks: list[tf.Tensor],
    gate: tf.Tensor,
    result: Any,
    created: list[Any],
    joinable: bool,
    counts: dict[Any, Any],
    ungated: Ungated | None = None,
) -> Any:
    """The releases (after the gate and every stateful op the body created) and the
    results made to wait.

    ``gate`` is what the section's ops wait for: the last of ``locks`` (then ``ungated``
    tracks the ops waiting for it) or a gate op behind it (``ungated`` None).

    A section traced with no enclosing one becomes the graph's open section, which the
    next section on the same locks may join (:mod:`safevars.sections.coarsening`): a joining
    body waits for the gate (the section's ``tokens``).
    """
    released = []
    with tf.control_dependencies([gate.op, *stateful(created)]):
        for lock, token in zip(new, locks):
            with tfi.colocate_with(lock.cs._handle):
                released.append(tfi.consume_mutex_lock(token))
    releases = getattr(graph, _RELEASES_ATTRIBUTE, None)
    if releases is None:
        releases = weakref.WeakKeyDictionary()
        setattr(graph, _RELEASES_ATTRIBUTE, releases)
    releases[threading.current_thread()] = released
    with tf.control_dependencies(released):
        leaves = [coarsening.after_release(x) for x in tf.nest.flatten(result)]
    if joinable:
        section = coarsening.OpenSection(
            tuple(ordered),
            threading.current_thread(),
            [gate],
            list(released),
            len(graph.get_operations()),
            counts,
            set(created),
            ungated,
        )
        coarsening.record(graph, section)
    return tf.nest.pack_sequence_as(result, leaves)


def _section_device(ordered: list[SectionLock]) -> str | None:
    """Where a section's ops run: the parameter server holding every guarded variable.

    A section's ops default to the calling worker's device, so each read, computation
    and write of a variable on a parameter server would be a separate round trip while
    the lock is held. When every lock lives on one parameter-server task, the section's
    ops are placed there instead (one round trip, the lock held for less time):
    measured with 3 workers and 1 PS, ``update`` went from 1.72x to 0.77x the time of
    an unlocked read-then-write. Ops that ``fn`` places explicitly keep their device.
    Anywhere else (one machine, mirrored copies, several tasks), None.
    """
    devices = {lock.device for lock in ordered}
    if len(devices) != 1:
        return None
    (device,) = devices
    return device if on_parameter_server(device) else None
