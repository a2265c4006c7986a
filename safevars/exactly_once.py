"""Exactly-once writes for steps scheduled on parameter servers (``ClusterCoordinator``).

The problem: ``ClusterCoordinator.schedule`` retries a step whose worker failed, on
another worker. When the worker died *after* the step's update reached the parameter
server (it was killed while sending the result back, say), the retry applies the update
a second time: a counter updated by 300 successful steps ends at 301 or 302. No
TensorFlow API tells a retry from a first attempt.

The fix: :func:`schedule` gives every scheduled call an int64 *token* (drawn on the
coordinator, or chosen by the caller) and passes it into the step as an argument, so
every attempt of the call (the first and each retry) carries the same token. Every
safevars critical section the step traces (``SafeVariable`` writes and ``update``,
``safevars.transaction``, ``SafeOptimizer.apply_gradients``,
``GradientAccumulator.add``...) becomes, inside its locks and on the parameter server
that holds them::

    if (token, section) is not in this lock's table:   # a hash table next to the lock
        run the section; record (token, section)        # in the same critical section
    else:
        write nothing; count one discarded duplicate    # statistics().duplicates_discarded

Lookup, writes and record run under the section's locks, so two attempts of one step can
never both apply a section, whichever workers run them and in whatever order. A section
starts writing only once every tensor it uses has reached the parameter server (it runs
as one function call there), so a worker that dies while a section's inputs are in
flight leaves that section not applied, never half applied.

What a step reported as failed may have done: each section of the step was applied at
most once, but a step whose result did not come back (``fetch()`` raised, for instance
``CancelledError`` after another step failed, or the step's own error) may have applied
any of its sections. :meth:`ScheduledStep.outcome` reads the tables and says which
(``"applied"``, ``"partly_applied"`` or ``"not_applied"``); :meth:`ScheduledStep.
reschedule` (or :func:`schedule` with the same ``token=``) runs the step again with the
same token, which applies exactly the sections that are missing. So with every failed
or cancelled step scheduled again until its result is fetched, every step takes effect
exactly once.

NOTES:
  * A section is recognised by its place in the traced step. One that could run more
    than once per step, inside a ``tf.while_loop`` (or an AutoGraph ``for`` over a
    tensor) or inside another ``tf.function`` the step calls, is refused at trace time
    with :class:`~safevars.UnsupportedStrategyError`: put the loop around the scheduled
    steps, or call the inner function's Python code directly. So is a step holding a
    critical section traced without the token: a ``tf.function`` it calls that was
    traced before elsewhere, or a ``tf.CriticalSection`` of the caller's own. Writes in
    a replica function of ``strategy.run`` (traced in a thread of its own) are covered:
    the wrapper is registered for the step's graph, whichever thread traces into it.
  * A discarded section writes nothing and returns zeros (of the dtypes and shapes it
    would have returned) in place of its results: a step's result is that of the
    attempt whose result came back. Read-only sections (snapshots, ``statistics()``)
    are never recorded: a retry reads again.
  * The tables keep one entry per applied section (about 44 bytes each, measured) for
    the life of the parameter servers; they are not checkpointed. A retry must call the
    same function with arguments of the same types and shapes (the same trace).
  * Writes made outside safevars (a plain ``tf.Variable.assign``) are not protected.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import locking, sections
from safevars.errors import (
    InvalidArgumentError,
    NotCallableError,
    UnsupportedStrategyError,
)
from safevars.locking import SectionLock

__all__ = ["ScheduledStep", "schedule"]

_SECTION_BITS = 20  # key = token << _SECTION_BITS | section id
_USER_TOKENS = 1 << (62 - _SECTION_BITS)  # Tokens below this are the caller's to choose.
_TOKENS = itertools.count(_USER_TOKENS)  # Drawn ones; next() is atomic in CPython.
_SECTION_IDS = itertools.count(0)
_LOCK = threading.Lock()

# Stateful ops that only read. A section made only of these (and of stateless ops) is
# read-only and is never recorded; any other stateful op (a write, a nested If, a call)
# makes it a write.
_READ_ONLY_STATEFUL = frozenset(
    {
        "ReadVariableOp",
        "ResourceGather",
        "ResourceGatherNd",
        "VariableShape",
        "VarIsInitializedOp",
        "Assert",
        "PrintV2",
        "LookupTableFindV2",
        "LookupTableSizeV2",
    }
)
# Graphs a recorded section may be traced in, between it and the step's graph.
_ONCE_PER_STEP_GRAPHS = frozenset({"CondBranchFuncGraph"})


class _LockRecord:
    """The table of applied (token, section) keys and the discarded count of one lock.

    Both live on the lock's device (the parameter server of its variables), created
    outside any graph the first time a section over the lock is traced in a step.
    """

    def __init__(self, lock: SectionLock) -> None:
        with tf.init_scope(), tf.device(lock.device):
            # Anonymous: a table shared by name could hold another coordinator's keys.
            self.table = tf.lookup.experimental.MutableHashTable(
                tf.int64,
                tf.int64,
                default_value=-1,
                name="safevars_exactly_once",
                checkpoint=False,
                experimental_is_anonymous=True,
            )
            self.discarded = tfi.ResourceVariable(
                tf.constant(0, tf.int64),
                trainable=False,
                shape=(),
                name="safevars_duplicates_discarded",
            )

    def count(self) -> int:
        with tf.init_scope():
            return int(self.discarded.numpy())


_RECORDS: weakref.WeakKeyDictionary[SectionLock, _LockRecord] = weakref.WeakKeyDictionary()


def _record_for(lock: SectionLock) -> _LockRecord:
    with _LOCK:
        record = _RECORDS.get(lock)
        if record is None:
            record = _RECORDS[lock] = _LockRecord(lock)
        for guard in locking._guards_of_lock(lock):
            if guard not in locking.DUPLICATE_COUNTERS:
                locking.DUPLICATE_COUNTERS[guard] = functools.partial(
                    _discarded_of, weakref.ref(guard)
                )
        return record


def _discarded_of(guard_ref: weakref.ref) -> int:
    guard = guard_ref()
    record = _RECORDS.get(guard.lock) if guard is not None else None
    return record.count() if record is not None else 0


def _is_write(op: tf.Operation) -> bool:
    if op.type in _READ_ONLY_STATEFUL:
        return False
    try:
        return bool(op.op_def.is_stateful)
    except Exception:  # noqa: BLE001 - an op without a registered OpDef: assume a write
        return True


def _zeros_like_spec(t: tf.Tensor) -> tf.Tensor:
    shape = [0 if d is None else d for d in t.shape.as_list()] if t.shape.rank is not None else []
    return tf.zeros(shape, t.dtype)


class _Trace:
    """One trace of a step: its token tensor and the write sections it records."""

    def __init__(self, graph: Any, token: tf.Tensor, name: str) -> None:
        self.graph = graph
        self.token = token
        self.name = name
        self.sections: list[tuple[_LockRecord, int]] = []  # (table's record, section id)
        self.mutex_locks = 0  # MutexLock ops of the sections wrapped

    def _check_place(self, graph: Any) -> None:
        if tfi.in_xla_context(graph):
            raise UnsupportedStrategyError(
                f"safevars.exactly_once.schedule({self.name}): a safevars write inside an "
                "XLA-compiled (jit_compile=True) function cannot be recorded (hash-table "
                "ops do not compile). Schedule the step without jit_compile."
            )
        g = graph
        while g is not None and g is not self.graph:
            if not (
                getattr(g, "_safevars_exactly_once", False)
                or type(g).__name__ in _ONCE_PER_STEP_GRAPHS
            ):
                where = (
                    "a tf.while_loop (or a for loop over a tensor)"
                    if type(g).__name__.startswith("While")
                    else f"another tf.function ({getattr(g, 'name', g)!r})"
                )
                raise UnsupportedStrategyError(
                    f"safevars.exactly_once.schedule({self.name}): a safevars critical "
                    f"section is traced inside {where} that the step runs, so it may run "
                    "more than once per step and cannot be told apart from a retry. Loop "
                    "over scheduled steps instead, or call the inner function's Python "
                    "code (fn.python_function) directly in the step."
                )
            g = getattr(g, "outer_graph", None)

    def wrap(self, locks: list[SectionLock], fn: Callable[[], Any]) -> Callable[[], Any]:
        """The ``sections.body_wrappers`` hook: records ``fn``'s section under ``locks``."""
        graph = tfi.default_graph()
        self._check_place(graph)
        records = [_record_for(lock) for lock in locks]
        sid = next(_SECTION_IDS)
        if sid >= 1 << _SECTION_BITS:
            raise UnsupportedStrategyError(
                f"safevars.exactly_once: more than {1 << _SECTION_BITS} critical sections "
                "were traced in exactly-once steps in this process; retracing steps "
                "endlessly (a new Python function per schedule call?) exhausts the ids."
            )
        start = len(graph.get_operations())  # The section's MutexLock ops come next.
        return functools.partial(self._gated, records, sid, fn, start)

    def _gated(
        self, records: list[_LockRecord], sid: int, fn: Callable[[], Any], start: int
    ) -> Any:
        """The section's body: look up, then apply and record, or discard and count.

        Runs as one function call (not inlined), so it starts only once every tensor it
        uses has arrived: a section never writes half of its updates.
        """
        self.mutex_locks += sum(
            op.type == "MutexLock" for op in tfi.default_graph().get_operations()[start:]
        )
        table = records[0].table
        token = self.token
        shape: dict[str, Any] = {}

        def gate() -> list[tf.Tensor]:
            tfi.default_graph()._safevars_exactly_once = True
            key = token * (1 << _SECTION_BITS) + sid
            fresh = tf.equal(table.lookup(key), -1)

            def apply() -> list[tf.Tensor]:
                branch = tfi.default_graph()
                before = set(branch.get_operations())
                result = fn()
                created = [op for op in branch.get_operations() if op not in before]
                leaves = tf.nest.flatten(result, expand_composites=True)
                tensors = [x for x in leaves if isinstance(x, tf.Tensor)]
                shape.update(
                    result=result,
                    leaves=leaves,
                    tensors=tensors,
                    write=any(_is_write(op) for op in created),
                )
                done = []
                if shape["write"]:
                    with tf.control_dependencies(created):
                        done = [table.insert(key, tf.constant(1, tf.int64))]
                with tf.control_dependencies(done):
                    return [tf.identity(t) for t in tensors] + [tf.constant(True)]

            def skip() -> list[tf.Tensor]:
                counted = [r.discarded.assign_add(1, read_value=False) for r in records]
                with tf.control_dependencies(counted):
                    return [_zeros_like_spec(t) for t in shape["tensors"]] + [tf.constant(False)]

            return tf.cond(fresh, apply, skip)

        call = tf.function(gate, autograph=False, experimental_attributes={"_noinline": True})
        outputs = call()
        if shape["write"]:
            self.sections.append((records[0], sid))
        tensors = iter(outputs[:-1])
        leaves = []
        for leaf in shape["leaves"]:
            if isinstance(leaf, tf.Tensor):
                leaves.append(next(tensors))
            elif isinstance(leaf, tf.Operation):
                leaves.append(outputs[-1].op)
            else:
                leaves.append(leaf)
        return tf.nest.pack_sequence_as(shape["result"], leaves, expand_composites=True)

    def verify(self) -> None:
        """Refuses a step holding a critical section that was traced without the token.

        Every ``MutexLock`` op of the step (its graph and every function it calls) must
        belong to a section wrapped here. Others come from a ``tf.function`` the step
        calls that was traced before, elsewhere (TensorFlow reuses the trace), from a
        replica function of ``strategy.run`` (traced in another thread), or from a
        ``tf.CriticalSection`` of the caller's own.
        """
        graph_def = self.graph.as_graph_def()
        found = sum(n.op == "MutexLock" for n in graph_def.node) + sum(
            n.op == "MutexLock" for f in graph_def.library.function for n in f.node_def
        )
        if found != self.mutex_locks:
            raise UnsupportedStrategyError(
                f"safevars.exactly_once.schedule({self.name}): the step holds a critical "
                "section traced without its token, whose writes could be applied twice: a "
                "tf.function it calls that was traced outside this step (call the inner "
                "function's Python code, fn.python_function, instead), a safevars write "
                "in a replica function of strategy.run (write in the step itself, or "
                "through SafeOptimizer/GradientAccumulator, which merge replicas first), "
                "or a tf.CriticalSection of its own."
            )


@contextlib.contextmanager
def _wrapping(graph: Any, wrapper: Callable[..., Any]) -> Iterator[None]:
    """Registers ``wrapper`` for sections traced in ``graph`` while the step is traced.

    Per graph (every thread tracing into it) where ``sections`` offers it, else for the
    tracing thread; :meth:`_Trace.verify` refuses what another thread traced unwrapped.
    """
    per_graph = getattr(sections, "graph_body_wrappers", None)
    if per_graph is not None:
        per_graph()[graph] = wrapper
        try:
            yield
        finally:
            del per_graph()[graph]
        return
    stack = sections.body_wrappers()
    stack.append((graph, wrapper))
    try:
        yield
    finally:
        stack.pop()


class _StepFunction:
    """The ``tf.function`` scheduled for a user's step: ``step(token, *args, **kwargs)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        python_fn = getattr(fn, "python_function", fn)
        self.name = getattr(python_fn, "__name__", repr(python_fn))
        self.python_fn = tf.autograph.to_graph(python_fn)
        self.traces: list[_Trace] = []
        signature = getattr(fn, "input_signature", None)
        if signature is not None:
            signature = [tf.TensorSpec([], tf.int64), *signature]
        self.function = tf.function(self._body, input_signature=signature, autograph=False)

    def _body(self, token: tf.Tensor, *args: Any, **kwargs: Any) -> Any:
        graph = tfi.default_graph()
        trace = _Trace(graph, token, self.name)
        with _wrapping(graph, trace.wrap):
            result = self.python_fn(*args, **kwargs)
        trace.verify()
        with _LOCK:
            self.traces.append(trace)
        return result

    def applied(self, token: int) -> tuple[int, int]:
        """(sections recorded for ``token``, sections of the trace that recorded them)."""
        with _LOCK:
            traces = [trace.sections for trace in self.traces if trace.sections]
        with tf.init_scope():
            for recorded in traces:
                found = sum(
                    int(r.table.lookup(tf.constant((token << _SECTION_BITS) + sid, tf.int64)))
                    != -1
                    for r, sid in recorded
                )
                if found:
                    return found, len(recorded)
        return 0, len(traces[0]) if traces else 0


_FUNCTIONS: weakref.WeakKeyDictionary[Any, _StepFunction] = weakref.WeakKeyDictionary()


def _step_function(fn: Callable[..., Any]) -> _StepFunction:
    with _LOCK:
        step = _FUNCTIONS.get(fn)
    if step is None:
        step = _StepFunction(fn)
        with _LOCK:
            step = _FUNCTIONS.setdefault(fn, step)
    return step


class ScheduledStep:
    """One call scheduled by :func:`schedule`: its token and its ``RemoteValue``.

    Attributes:
      token: The call's idempotency token (every attempt of the call carries it).
      remote_value: What ``ClusterCoordinator.schedule`` returned for this attempt.
    """

    def __init__(
        self,
        coordinator: Any,
        step: _StepFunction,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        token: int,
    ) -> None:
        self.token = token
        self._coordinator, self._step, self._args, self._kwargs = coordinator, step, args, kwargs
        self.remote_value = coordinator.schedule(
            step.function, args=(tf.constant(token, tf.int64), *args), kwargs=kwargs
        )

    def fetch(self) -> Any:
        """The step's result (blocks); raises what the step raised. See ``RemoteValue``."""
        return self.remote_value.fetch()

    def outcome(self) -> str:
        """What the step did, once it is over (blocks until then).

        Returns:
          ``"done"``: the result came back; every section applied exactly once.
          ``"applied"``: the result did not come back (``fetch()`` raises), but every
          section of the step was applied, once. ``"partly_applied"``: some were.
          ``"not_applied"``: none was (the step, or the part of it that ran, wrote
          nothing through safevars).

        Thread safety: read from the parameter servers' tables at the call. An attempt
        still running elsewhere (a worker cut off but alive) may apply more sections
        later; :meth:`reschedule` is safe in every case.

        Modes: eager, on the coordinator.
        """
        try:
            self.remote_value.fetch()
        except Exception:  # noqa: BLE001 - any failure: the tables say what happened
            found, total = self._step.applied(self.token)
        else:
            return "done"
        if found == 0:
            return "not_applied"
        return "applied" if found == total else "partly_applied"

    def reschedule(self) -> ScheduledStep:
        """Schedules the same call again with the same token.

        Sections the step already applied (in any earlier attempt) are discarded; the
        others run. Use it for steps whose ``fetch()`` raised (``CancelledError``
        after another step's error, or an error that is gone now).

        Returns:
          The new :class:`ScheduledStep` (same token).

        Thread safety: safe while earlier attempts may still run: every section is
        applied at most once in total.

        Modes: eager, on the coordinator.
        """
        return ScheduledStep(self._coordinator, self._step, self._args, self._kwargs, self.token)

    def __repr__(self) -> str:
        return f"<safevars.exactly_once.ScheduledStep {self._step.name} token={self.token}>"


def schedule(
    coordinator: Any,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    token: int | None = None,
) -> ScheduledStep:
    """``coordinator.schedule(fn, args, kwargs)`` whose safevars writes take effect once.

    Example::

        @tf.function
        def step(batch):
            counter.update(lambda x: x + 1.0)
            opt.apply_gradients(zip(grads_of(batch), model.trainable_variables))

        steps = [safevars.exactly_once.schedule(coordinator, step, args=(it,))
                 for _ in range(300)]
        coordinator.join()        # counter == 300, even if workers died and steps retried

    Args:
      coordinator: A ``tf.distribute.coordinator.ClusterCoordinator``.
      fn: The step: a ``tf.function`` or a Python function. Its Python code is traced
        (with AutoGraph) in a ``tf.function`` that also takes the token; pass the same
        object each time so the trace is reused.
      args: Positional arguments, as for ``ClusterCoordinator.schedule`` (per-worker
        values such as iterators included).
      kwargs: Keyword arguments, likewise.
      token: The call's idempotency key, an ``int`` in ``[0, 2**42)``; calls of ``fn``
        with the same token (and arguments of the same types and shapes) take effect
        once in all. Pass the step number, for instance, to schedule again every step
        not known to be done after the coordinator reported an error. None (the
        default) draws a new token, never equal to one you choose.

    Returns:
      A :class:`ScheduledStep` (``fetch()``, ``outcome()``, ``reschedule()``).

    Raises:
      NotCallableError: ``fn`` is not callable.
      InvalidArgumentError: ``coordinator`` has no ``schedule`` method, or ``token`` is
        not an ``int`` in range.
      UnsupportedStrategyError: when the step is traced: a section inside a loop, a
        nested ``tf.function`` or an XLA-compiled function (see the module notes).
      Exception: whatever ``coordinator.schedule`` raises (an earlier step's error:
        ClusterCoordinator then cancels every queued step, this one included).

    Thread safety: each section the step traces is applied at most once over every
    attempt of every call with this token, and exactly once if a result is fetched;
    concurrent steps exclude each other through the variables' locks as usual.

    Modes: call it eagerly on the coordinator. Outside a step scheduled this way safevars
    writes work as before, at no extra cost.
    """
    if not callable(fn):
        raise NotCallableError(
            f"schedule(coordinator, fn) needs a tf.function or a function as fn, got {fn!r}."
        )
    if not callable(getattr(coordinator, "schedule", None)):
        raise InvalidArgumentError(
            f"coordinator must be a tf.distribute.coordinator.ClusterCoordinator, got "
            f"{coordinator!r}."
        )
    if token is None:
        token = next(_TOKENS)
    elif (
        isinstance(token, bool)
        or not isinstance(token, (int, np.integer))
        or not 0 <= token < _USER_TOKENS
    ):
        raise InvalidArgumentError(
            f"token must be an int in [0, 2**{_USER_TOKENS.bit_length() - 1}) (for example "
            f"the step number), got {token!r}. Pass token=None to draw one."
        )
    return ScheduledStep(
        coordinator, _step_function(fn), tuple(args or ()), dict(kwargs or {}), int(token)
    )
