"""Critical sections inside ``tf.function``: mutex ops, and XLA-compiled functions.

A Python lock inside ``tf.function`` guards only tracing. What orders graph execution is
the ``tf.CriticalSection`` mutex of each :class:`~safevars.locking.SectionLock`: a
section's ops wait for a ``MutexLock`` op and the mutex is released by a
``ConsumeMutexLock`` op that waits for every op the section created.

XLA cannot compile mutex ops. A section traced inside a ``jit_compile=True`` function
therefore takes no lock itself; it records its locks on the function being traced, and
the lock is taken *around the compiled call*: eagerly by holding the locks (and their
mutexes) while the compiled function runs, inside another ``tf.function`` by a section
whose body is the call op. A compiled function thus runs as a whole under the locks of
every variable it writes: concurrent compiled steps never interleave, and they exclude
every other safevars writer of those variables. (XLA itself also holds the variables'
own resource locks for the whole compiled call.) What XLA cannot do inside (change a
variable's shape: a ``GradientAccumulator`` growing its buffer) is recorded the same way
(:func:`record_xla_preparation`) and done under those locks just before the call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import lock_coarsening as coarsening
from safevars import locking, section_gate
from safevars.distribute import on_parameter_server
from safevars.errors import InvalidArgumentError, LockOrderError, UnsupportedStrategyError
from safevars.locking import Guard, SectionLock, sorted_locks

__all__ = [
    "body_wrappers",
    "defer_count",
    "graph_body_wrappers",
    "graph_inputs",
    "graph_section",
    "held_in_graph",
    "record_xla_preparation",
]

_XLA_LOCKS = "_safevars_xla_locks"  # FuncGraph attribute: locks its compiled call needs.
# FuncGraph attribute: what its compiled call prepares under those locks before it runs,
# {key: [prepare, amount, what]} (see record_xla_preparation).
_XLA_PREPARATIONS = "_safevars_xla_preparations"


def _graph_held() -> list[tuple[Any, frozenset[SectionLock], list[Any]]]:
    """Stack of (graph, locks, write-ops) for sections being traced by this thread."""
    try:
        return locking._local.graph_held
    except AttributeError:
        locking._local.graph_held = []
        return locking._local.graph_held


def body_wrappers() -> list[tuple[Any, Callable[..., Any]]]:
    """Stack of (graph, wrapper) applied to the body of sections traced in ``graph``.

    A wrapper is called as ``wrapper(locks, fn)`` inside the section (the locks taken)
    and returns the function to trace instead of ``fn``; :mod:`safevars.exactly_once`
    uses it to skip a section whose update was already applied. Innermost last.
    """
    try:
        return locking._local.body_wrappers
    except AttributeError:
        locking._local.body_wrappers = []
        return locking._local.body_wrappers


# Graph -> wrapper, for sections traced in that graph (or a graph nested in it) by ANY
# thread: MirroredStrategy (and ParameterServerStrategy's strategy.run) trace replica
# functions in threads of their own, which a thread-local stack does not reach.
_GRAPH_WRAPPERS: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()


def graph_body_wrappers() -> weakref.WeakKeyDictionary[Any, Callable[..., Any]]:
    """Graph -> wrapper applied, as :func:`body_wrappers`, in every thread tracing into it."""
    return _GRAPH_WRAPPERS


def _graph_chain() -> list[Any]:
    """The current graph and every graph enclosing it, innermost first."""
    chain = []
    g = tfi.default_graph()
    while g is not None:
        chain.append(g)
        g = getattr(g, "outer_graph", None)
    return chain


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


def _wrapped_body(locks: list[SectionLock], fn: Callable[[], Any]) -> Callable[[], Any]:
    stack = body_wrappers()
    if not stack and not _GRAPH_WRAPPERS:
        return fn
    chain = _graph_chain()
    for graph, wrapper in stack:
        if any(graph is c for c in chain):
            fn = wrapper(locks, fn)
    for graph in reversed(chain):  # outermost first, as the stack is
        graph_wrapper = _GRAPH_WRAPPERS.get(graph)
        if graph_wrapper is not None:
            fn = graph_wrapper(locks, fn)
    return fn


def graph_inputs(after: Any) -> list[Any]:
    """The tensors and ops of ``after`` (any nest, composites included): what a section
    waits for, or its body's writes wait for."""
    return [
        x
        for x in tf.nest.flatten(after, expand_composites=True)
        if isinstance(x, (tf.Tensor, tf.Operation))
    ]


def defer_count(guard: Guard, write: Any, writes: int) -> bool:
    """Leaves the version count of a section body's one write to the section, which
    adds it to a count of the same variable it made already if it can (lock coarsening,
    :mod:`safevars.lock_coarsening`). True if it does; False outside a section body
    being traced (the caller counts the write itself)."""
    return coarsening.defer_count(guard, write, writes, len(_graph_held()))


def held_in_graph(guard: Guard) -> list[Any] | None:
    """The write-op list of the section being traced that holds ``guard``'s lock, if any.

    A write traced inside ``safevars.transaction`` (in the transaction's own graph or a
    ``tf.cond``/``tf.while_loop`` body nested in it) runs inside the transaction's
    critical section, so it must not lock again.
    """
    lock = guard.lock
    for locks, writes in _enclosing_sections():
        if lock in locks:
            return writes
    return None


def _enclosing_sections() -> list[tuple[frozenset[SectionLock], list[Any]]]:
    """(locks, write-op list) of the sections being traced around the current graph.

    Innermost first: sections traced in this graph or in a graph enclosing it (a
    ``tf.cond``/``tf.while_loop`` body, a nested ``tf.function``).
    """
    stack = _graph_held()
    if not stack:
        return []
    chain = _graph_chain()
    return [
        (locks, writes)
        for txn_graph, locks, writes in reversed(stack)
        if any(txn_graph is c for c in chain)
    ]


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
        (:mod:`safevars.step_span`). None of them may come before an op of ``after``.

    Returns ``fn()``'s result, made to depend on the release of every lock. The locks are
    released only after every op ``fn`` created has run (not only its outputs, which is
    all ``tf.CriticalSection.execute`` waits for).
    """
    return lock_section(sorted_locks(guards), fn, after, gated=gated)


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
    switched = [lock for lock in ordered if lock.ensure_runtime(locking._holding(lock, me))]
    try:
        result = _traced_section(ordered, fn, after, compiled_call, gated)
    except BaseException:
        for lock in switched:  # A failed trace changes nothing, not even the lock mode.
            lock.undo_runtime()
        raise
    for lock in ordered:
        lock.graph_uses += 1
    return result


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
        locks = _mutex_locks(new, inputs)
        gate = locks[-1]
        if gated:  # a step's span: many ops
            gate = section_gate.open_gate(new[-1], gate)
            for op in gated:
                op._add_control_inputs([gate.op])
        before = len(graph.get_operations())
        with tf.control_dependencies([gate]):
            result, pending = trace(fn)
            counts = coarsening.count_writes(graph, pending, None)
        created = graph.get_operations()[before:]
        ungated = None
        if gate is locks[-1]:
            ungated = section_gate.Ungated(new[-1], gate)
            gate = ungated.add(created)
            if gate is not ungated.opener:
                ungated = None
        return _release(
            graph, ordered, new, locks, gate, result, created, joinable, counts, ungated
        )


def _mutex_locks(new: list[SectionLock], inputs: list[Any]) -> list[tf.Tensor]:
    """``MutexLock`` ops for ``new``, one after another in order, the first after
    ``inputs``. The section's ops wait for the last one, directly or through a gate
    (:mod:`safevars.section_gate`)."""
    locks: list[tf.Tensor] = []
    for lock in new:
        with tf.control_dependencies(locks[-1:] if locks else inputs):
            locks.append(tfi.mutex_lock(lock.cs._handle))
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
        locks = _mutex_locks(new, inputs)
        gate = section_gate.open_gate(new[-1], locks[-1])  # every op waits for it
        for op in created:
            op._add_control_inputs([gate.op])
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
    ungated: section_gate.Ungated | None = None,
) -> Any:
    """The releases (after the gate and every op the body created) and the results made
    to wait.

    ``gate`` is what the section's ops wait for: the last of ``locks`` (then ``ungated``
    tracks the ops waiting for it) or a gate op behind it (``ungated`` None).

    A section traced with no enclosing one becomes the graph's open section, which the
    next section on the same locks may join (:mod:`safevars.lock_coarsening`): a joining
    body waits for the gate (the section's ``tokens``).
    """
    released = []
    with tf.control_dependencies([gate.op, *created]):
        for lock, token in zip(new, locks):
            with tfi.colocate_with(lock.cs._handle):
                released.append(tfi.consume_mutex_lock(token))
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


def _check_xla_strategy() -> None:
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            raise UnsupportedStrategyError(
                "A safevars write inside an XLA-compiled (jit_compile=True) function that "
                f"runs per replica of {type(strategy).__name__} is not supported: the lock "
                "is taken around the compiled call, and replicas waiting for each other "
                "inside it would deadlock. Use jit_compile=False under multi-replica "
                "strategies (Keras picks XLA only on a single device by default)."
            )


# ---------------------------------------------------------------------- compiled calls


def _xla_graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every graph around it that is part of the same compiled function."""
    while graph is not None and tfi.in_xla_context(graph):
        yield graph
        outer = getattr(graph, "outer_graph", None)
        # TensorFlow marks a calling graph as an XLA context only while it builds the
        # call op of a compiled function; the calling graph is part of the compiled
        # function only if the graphs around it are XLA contexts too. (Recording on the
        # caller would make the caller take the locks around its own call, and then its
        # section around the compiled call would wait for them: measured, it hung.)
        if outer is None or getattr(outer, "outer_graph", None) is None:
            break
        if not tfi.in_xla_context(outer.outer_graph):
            break
        graph = outer


def _record_xla_locks(graph: Any, locks: Sequence[SectionLock]) -> None:
    """Notes ``locks`` on every graph from ``graph`` out to the compiled function's."""
    for g in _xla_graphs(graph):
        recorded = getattr(g, _XLA_LOCKS, None)
        if recorded is None:
            recorded = set()
            setattr(g, _XLA_LOCKS, recorded)
        recorded.update(locks)


def record_xla_preparation(
    key: Any, prepare: Callable[[int], Any], amount: int, what: str
) -> None:
    """Inside an XLA-compiled function being traced: ``prepare(total)`` is to run before
    every call of it, under the locks the call takes, with ``total`` the sum of the
    ``amount`` recorded for ``key`` (by this function and the compiled functions it
    calls).

    For state that XLA cannot change the shape of: a ``GradientAccumulator``'s row
    buffer grows there, before the compiled ``add`` that needs the rows. ``prepare``
    runs eagerly when the compiled function is called eagerly, and in the calling
    graph's section (its ops are returned; the call waits for them) otherwise.

    Raises:
      InvalidArgumentError: ``what`` (the call being traced) is inside a
        ``tf.while_loop`` of the compiled function: it runs a number of times known
        only when the loop does, so nothing can be prepared for it (XLA would drop the
        writes that do not fit). Nothing is recorded.
    """
    graphs = list(_xla_graphs(tfi.default_graph()))
    if any(tfi.is_loop_body(g) for g in graphs):
        raise InvalidArgumentError(
            f"{what} inside a loop (tf.while_loop, an AutoGraph loop, tf.map_fn) of an "
            "XLA-compiled function (jit_compile=True) is not supported: XLA cannot grow "
            "its storage during the call, and how many times the loop runs is known only "
            "when it does. Call the compiled function from the loop instead of looping "
            "inside it, or compile without XLA (jit_compile=False), or use "
            "deterministic=False."
        )
    for g in graphs:
        recorded = getattr(g, _XLA_PREPARATIONS, None)
        if recorded is None:
            recorded = {}
            setattr(g, _XLA_PREPARATIONS, recorded)
        entry = recorded.setdefault(key, [prepare, 0, what])
        entry[1] += amount


def _preparations_of(function: Any) -> dict[Any, list[Any]]:
    graph = getattr(function, "_func_graph", None)
    return getattr(graph, _XLA_PREPARATIONS, None) or {}


def _prepare(preparations: dict[Any, list[Any]]) -> list[Any]:
    """Runs the preparations of a compiled call (locks held); their ops in a graph."""
    ops = []
    for prepare, total, _ in preparations.values():
        done = prepare(total)
        if done is not None and not tf.executing_eagerly():
            ops.append(done)
    return ops


def _locks_of(function: Any) -> list[SectionLock]:
    graph = getattr(function, "_func_graph", None)
    locks = getattr(graph, _XLA_LOCKS, None)
    return sorted(locks, key=lambda lock: lock.order) if locks else []


def _call_flat_under_locks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``ConcreteFunction._call_flat``: an XLA function runs under its locks."""

    def call_flat(self: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        locks = _locks_of(self)
        if not locks:
            return original(self, tensor_inputs, captured_inputs)
        preparations = _preparations_of(self)
        if tf.executing_eagerly():
            with locking.hold_locks(locks):
                _prepare(preparations)
                return original(self, tensor_inputs, captured_inputs)
        graph = tfi.default_graph()
        # TensorFlow marks the calling graph as an XLA context while it builds the call
        # op of a compiled function; the call is nested in a bigger compiled function
        # only if the graphs around the calling one are XLA contexts too.
        if tfi.in_xla_context(getattr(graph, "outer_graph", None) or graph):
            _record_xla_locks(graph, locks)
            for key, (prepare, amount, what) in preparations.items():
                record_xla_preparation(key, prepare, amount, what)
            return original(self, tensor_inputs, captured_inputs)

        def prepared_call() -> Any:
            with tf.control_dependencies(_prepare(preparations)):
                return original(self, tensor_inputs, captured_inputs)

        return lock_section(locks, prepared_call, tensor_inputs, compiled_call=True)

    call_flat.__wrapped__ = original  # type: ignore[attr-defined]
    call_flat._safevars_xla = True  # type: ignore[attr-defined]
    return call_flat


def install() -> None:
    """Installs the compiled-call wrapper once (idempotent)."""
    current = tfi.ConcreteFunction.__dict__["_call_flat"]
    if not getattr(current, "_safevars_xla", False):
        tfi.ConcreteFunction._call_flat = _call_flat_under_locks(current)


install()
