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

    if (token, section) is not in the table:   # a hash table on the lock's parameter server
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
  * Checkpoints: :func:`tables` is this coordinator's table object; put it in the
    ``tf.train.Checkpoint`` (or ``CheckpointManager``) of the variables the steps
    write. A save of it holds the mutex of every lock of an exactly-once section
    while it reads (sections in progress finish first, others wait), so each
    checkpoint holds a section's entry exactly when it holds its writes, even while
    steps run. A new coordinator that restores it and schedules every step again with
    the same tokens applies each step exactly once. Section ids come from the step's
    qualified name and the section's place in the trace, so they are the same in the
    new process. (Two *different* step functions given the same token could share a
    section id with probability about 2**-20 per pair of sections on one parameter
    server: give each function its own token range, or draw tokens.)
  * Bounded tables: each applied section keeps one entry (42-44 bytes of resident
    memory, measured with 0.5-2 million entries) until :meth:`Tables.compact` declares
    the tokens below a watermark finished and removes theirs. Compacting every ``W``
    tokens to ``below = newest - W`` keeps at most ``2 * W`` tokens' entries per table
    (times the sections a step has on that parameter server), plus one for the
    watermark. A token below the watermark is refused by :func:`schedule` and
    discarded at run time. A retry must call the same function with arguments of the
    same types and shapes (the same trace).
  * Writes made outside safevars (a plain ``tf.Variable.assign``) are not protected.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import locking, sections
from safevars.distribute import on_parameter_server
from safevars.errors import (
    InvalidArgumentError,
    NotCallableError,
    UnsupportedStrategyError,
)
from safevars.locking import SectionLock

__all__ = ["ScheduledStep", "Tables", "schedule", "tables"]

_SECTION_BITS = 20  # key = token << _SECTION_BITS | section id
_USER_TOKENS = 1 << (62 - _SECTION_BITS)  # Tokens below this are the caller's to choose.
_TOKENS = itertools.count(_USER_TOKENS)  # Drawn ones; next() is atomic in CPython.
_WATERMARK_KEY = -1  # The table entry holding the watermark (every other key is >= 0).
_LOCK = threading.Lock()
_FENCING = threading.Lock()  # Held by a checkpoint save: no new table or lock record then.

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


def _device_name(device: str) -> str:
    """The checkpoint name of the table of ``device``: ``ps_0`` for parameter server 0."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.job is None:
        return "local"
    return f"{spec.job}_{spec.task or 0}"


class Tables(tf.Module):
    """The applied-section tables of this coordinator: one per parameter server.

    A table maps each applied (token, section) key to 1 and holds the *watermark*:
    tokens below it were declared finished by :meth:`compact`. It lives on its
    parameter server, where sections look their keys up and record them, inside their
    locks. :func:`tables` returns this process's object; put it in the
    ``tf.train.Checkpoint`` that holds the variables the steps write::

        ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                                   exactly_once=exactly_once.tables(strategy))

    Its children are the tables, named by parameter-server task (``ps_0``, ...): a new
    coordinator with the same cluster layout restores each into the table of the same
    parameter server.

    Thread safety: a ``tf.train.Checkpoint`` save (``save``, ``write``, and so
    ``CheckpointManager.save``) whose object graph holds this object runs while no
    critical section over a lock of an exactly-once step runs: it holds the run-time
    mutex of every such lock from before the first value is read until the files are
    written (sections in progress finish first, the others wait). So a checkpoint holds
    a table entry exactly when it holds that section's writes, also while steps run.
    Restore before scheduling steps.

    Modes: eager, on the coordinator. The tables are anonymous resources: a coordinator
    never sees another's entries unless it restores them from a checkpoint.
    """

    def __init__(self) -> None:
        super().__init__(name="safevars_exactly_once")
        self._by_device: dict[str, Any] = {}
        self._floor = 0  # The watermark this process knows, when _floor_known.
        self._floor_known = True

    def table_for(self, device: str) -> Any:
        """The table of ``device`` (its parameter server), created the first time.

        Args:
          device: The device string of a parameter server's CPU (the device of the
            variables whose sections record there).

        Returns:
          The ``tf.lookup.experimental.MutableHashTable`` of that device, a child of
          this object named after the task (``ps_0``): a restore of this object
          (pending or done) fills it when it is created.

        Thread safety: created once per device, under a process-wide lock.

        Modes: eager or while tracing (the table is created outside the graph).
        """
        name = _device_name(device)
        with _LOCK:
            table = self._by_device.get(name)
            if table is not None:
                return table
            with tf.init_scope(), tf.device(device or None):
                # Anonymous: a table shared by name could hold another coordinator's keys.
                table = tf.lookup.experimental.MutableHashTable(
                    tf.int64,
                    tf.int64,
                    default_value=-1,
                    name=f"safevars_exactly_once_{name}",
                    checkpoint=True,
                    experimental_is_anonymous=True,
                )
            self._by_device[name] = table
            setattr(self, name, table)  # tracked: a deferred restore applies here
            self._floor_known = False  # which may bring a watermark
            return table

    def size(self) -> int:
        """Entries in every table, each table's watermark entry (once set) included.

        Thread safety: each table's count is read at the call; sections running
        meanwhile may add entries.

        Modes: eager, on the coordinator (one read per parameter server).
        """
        with tf.init_scope():
            return sum(int(t.size()) for t in list(self._by_device.values()))

    @property
    def watermark(self) -> int:
        """Tokens below this were declared finished (0: none); read from the tables.

        Thread safety: read at the call; it only goes up.

        Modes: eager, on the coordinator (one read per parameter server).
        """
        floor = 0
        with tf.init_scope():
            for table in list(self._by_device.values()):
                floor = max(floor, int(table.lookup(tf.constant(_WATERMARK_KEY, tf.int64))))
        self._floor, self._floor_known = floor, True
        return floor

    def _known_floor(self) -> int:
        """The watermark, read from the tables only after a restore (else remembered)."""
        return self._floor if self._floor_known else self.watermark

    def _restoring(self) -> None:
        self._floor_known = False

    def compact(self, below: int) -> int:
        """Declares every token below ``below`` finished and removes its entries.

        Call it with a token below which no step will be scheduled again: with token =
        step number, the first step not known to be ``"done"``. Afterwards a section of
        a token below the watermark writes nothing (it is discarded as a duplicate is,
        and counted in ``statistics().duplicates_discarded``), and :func:`schedule`
        refuses such a token with :class:`~safevars.InvalidArgumentError`. The
        watermark never goes down, and it is saved in checkpoints with the tables.

        Args:
          below: The new watermark, an ``int`` in ``[0, 2**42]``. Drawn tokens
            (``token=None``) are above every token you choose.

        Returns:
          The number of entries removed.

        Raises:
          InvalidArgumentError: ``below`` is not such an ``int``.

        Thread safety: safe while steps run. The watermark is raised before any entry
        is removed, and a section reads the watermark after its lookup: an attempt of a
        finished token is discarded whether it looks up before or after the removal.
        An attempt below ``below`` that had applied nothing and passed both checks just
        before may still record its entry; the next ``compact`` removes it.

        Modes: eager, on the coordinator; the removal runs on each parameter server.
        """
        if (
            isinstance(below, bool)
            or not isinstance(below, (int, np.integer))
            or not 0 <= below <= _USER_TOKENS
        ):
            raise InvalidArgumentError(
                f"compact(below) needs an int in [0, 2**{_USER_TOKENS.bit_length() - 1}] "
                f"(a token below which every step is finished), got {below!r}."
            )
        floor = self._known_floor()
        removed = 0
        for table in list(self._by_device.values()):
            removed += int(_compact_table(table, tf.constant(int(below), tf.int64)))
        self._floor = max(floor, int(below))
        return removed


@tf.function(autograph=False)
def _compact_table(table: Any, below: tf.Tensor) -> tf.Tensor:
    """Raises ``table``'s watermark to ``below``, then removes the entries under it."""
    with tf.device(table.resource_handle.device):
        watermark_key = tf.constant(_WATERMARK_KEY, tf.int64)
        floor = tf.reshape(tf.maximum(table.lookup(watermark_key), below), [])
        raised = table.insert(watermark_key, floor)
        with tf.control_dependencies([raised]):
            keys = tf.reshape(table.export()[0], [-1])
        dropped = tf.boolean_mask(
            keys, tf.logical_and(keys >= 0, keys < floor * (1 << _SECTION_BITS))
        )
        with tf.control_dependencies([table.remove(dropped)]):
            return tf.size(dropped)


_TABLES: Tables | None = None


def tables(strategy: Any = None) -> Tables:
    """This process's exactly-once tables, to checkpoint with the variables they protect.

    Example::

        once = exactly_once.tables(strategy)
        ckpt = tf.train.Checkpoint(model=model, exactly_once=once)
        manager = tf.train.CheckpointManager(ckpt, directory, max_to_keep=3)
        manager.restore_or_initialize()   # a new coordinator: before scheduling steps
        ...
        manager.save()                    # while steps run: tables and variables agree
        once.compact(below=first_step_not_done)   # keeps the tables bounded

    Args:
      strategy: A ``ParameterServerStrategy``: a table is created now on each of its
        parameter servers, so that a restore finds them. None: the tables created so
        far (a table is created when a section over a lock on its device is first
        traced in a scheduled step).

    Returns:
      The :class:`Tables` of this process (the same object at every call).

    Raises:
      InvalidArgumentError: ``strategy`` has no ``ps`` job.

    Thread safety: safe from any thread.

    Modes: eager, on the coordinator.
    """
    global _TABLES
    with _LOCK:
        if _TABLES is None:
            _TABLES = Tables()
        result = _TABLES
    if strategy is not None:
        # The cluster's devices, as the coordinator connected to them.
        devices = [
            d.name for d in tf.config.list_logical_devices("CPU") if on_parameter_server(d.name)
        ]
        if not devices or not hasattr(strategy, "extended"):
            raise InvalidArgumentError(
                f"tables(strategy) needs a ParameterServerStrategy, on a coordinator "
                f"connected to parameter servers, got {strategy!r}. Pass None for the "
                "tables created so far."
            )
        for device in devices:
            result.table_for(device)
    return result


class _LockRecord:
    """The table a lock's sections record in, and the lock's discarded count.

    The table is its device's (shared by the locks of one parameter server: a key
    names one section, and every attempt of it holds that section's locks); the count
    lives next to the lock. Created outside any graph the first time a section over the
    lock is traced in a step.
    """

    def __init__(self, lock: SectionLock) -> None:
        self.table = tables().table_for(lock.device)
        with tf.init_scope(), tf.device(lock.device):
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
    with _FENCING:  # A save in progress fences the locks it found: none may be added.
        with _LOCK:
            record = _RECORDS.get(lock)
        if record is None:
            record = _LockRecord(lock)
            with _LOCK:
                record = _RECORDS.setdefault(lock, record)
    with _LOCK:
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

    def __init__(self, graph: Any, token: tf.Tensor, name: str, key: str) -> None:
        self.graph = graph
        self.token = token
        self.name = name
        self.key = key  # The step's qualified name: section ids derive from it.
        self.sections: list[tuple[_LockRecord, int]] = []  # (table's record, section id)
        self.ids: set[int] = set()  # Section ids of this trace, in use.
        self.mutex_locks = 0  # MutexLock ops of the sections wrapped

    def _section_id(self) -> int:
        """The next section's id: the same in every process that traces this step.

        Derived from the step's qualified name and the section's place in the trace
        (not from a process-wide counter), so that a coordinator that restored the
        tables from a checkpoint finds the keys of the sections applied before.
        Distinct within the trace (a collision probes on).
        """
        place = len(self.ids)
        salt = 0
        while True:
            digest = zlib.crc32(f"{self.key}#{place}#{salt}".encode())
            sid = digest & ((1 << _SECTION_BITS) - 1)
            if sid not in self.ids:
                self.ids.add(sid)
                return sid
            salt += 1

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
        sid = self._section_id()
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
            found = table.lookup(key)
            # Read after the lookup: compact() raises the watermark before it removes.
            with tf.control_dependencies([found]):
                floor = table.lookup(tf.constant(_WATERMARK_KEY, tf.int64))
            fresh = tf.logical_and(tf.equal(found, -1), token >= floor)

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
        self.key = (
            f"{getattr(python_fn, '__module__', '')}."
            f"{getattr(python_fn, '__qualname__', self.name)}"
        )
        self.python_fn = tf.autograph.to_graph(python_fn)
        self.traces: list[_Trace] = []
        signature = getattr(fn, "input_signature", None)
        if signature is not None:
            signature = [tf.TensorSpec([], tf.int64), *signature]
        self.function = tf.function(self._body, input_signature=signature, autograph=False)

    def _body(self, token: tf.Tensor, *args: Any, **kwargs: Any) -> Any:
        graph = tfi.default_graph()
        trace = _Trace(graph, token, self.name, self.key)
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

        Raises:
          InvalidArgumentError: the token is below the watermark of
            :meth:`Tables.compact`.

        Thread safety: safe while earlier attempts may still run: every section is
        applied at most once in total.

        Modes: eager, on the coordinator.
        """
        _check_not_finished(self.token)
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
      InvalidArgumentError: ``coordinator`` has no ``schedule`` method, ``token`` is
        not an ``int`` in range, or it is below the watermark of
        :meth:`Tables.compact` (that step was declared finished).
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
    _check_not_finished(int(token))
    return ScheduledStep(
        coordinator, _step_function(fn), tuple(args or ()), dict(kwargs or {}), int(token)
    )


def _check_not_finished(token: int) -> None:
    """Refuses a token below the watermark :meth:`Tables.compact` set."""
    floor = _TABLES._known_floor() if _TABLES is not None else 0
    if token < floor:
        raise InvalidArgumentError(
            f"token {token} is below the exactly-once watermark {floor}: "
            "Tables.compact declared every step below it finished and removed their "
            "entries, so whether this one was applied is no longer known. Schedule "
            "new steps with tokens at or above the watermark."
        )


# ------------------------------------------------------------------ checkpoints


def _fenced_locks() -> list[SectionLock]:
    """The locks of exactly-once sections that a save must fence itself, in order.

    Those whose eager holders take the mutex on a parameter server: the savers'
    own locking (:mod:`safevars.locking.checkpoints`) leaves them out. It holds the
    others itself (a fence over them would deadlock against it).
    """
    with _LOCK:
        locks = [
            lock
            for lock in list(_RECORDS.keys())
            if lock.mutexed and lock.cs is not None and on_parameter_server(lock.device)
        ]
    return sorted(locks, key=lambda lock: lock.order)


@contextlib.contextmanager
def _fence(locks: list[SectionLock]) -> Iterator[None]:
    """Holds the run-time mutex of every lock of ``locks`` (in order) while the body runs.

    A ``tf.function`` takes the mutexes (``MutexLock``, as a section does, so sections in
    progress finish first), then waits in a ``py_function`` until the body is over, then
    releases them. It runs in a thread of its own: a mutex is held by the op's output,
    so it must stay inside one running function.
    """
    if not locks:
        yield
        return
    held, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def wait() -> np.int64:
        held.set()
        done.wait()
        return np.int64(0)

    @tf.function(autograph=False)
    def hold() -> tf.Tensor:
        tokens: list[tf.Tensor] = []
        for lock in locks:
            with tf.control_dependencies(tokens[-1:]), tfi.colocate_with(lock.cs._handle):
                tokens.append(tfi.mutex_lock(lock.cs._handle))
        with tf.control_dependencies(tokens):
            waited = tf.py_function(wait, [], tf.int64)
        released = []
        with tf.control_dependencies([waited]):
            for lock, token in zip(locks, tokens):
                with tfi.colocate_with(lock.cs._handle):
                    released.append(tfi.consume_mutex_lock(token))
        with tf.control_dependencies(released):
            return tf.identity(waited)

    def run() -> None:
        try:
            hold()
        except BaseException as e:  # noqa: BLE001 - reported to the saving thread
            failed.append(e)
            held.set()

    thread = threading.Thread(target=run, name="safevars-exactly-once-fence", daemon=True)
    thread.start()
    try:
        held.wait()
        if failed:
            raise failed[0]
        yield
    finally:
        done.set()
        thread.join()


def _saving(save: Callable[..., Any]) -> Callable[..., Any]:
    """``TrackableSaver.save`` fenced when the saved object graph holds the tables."""

    @functools.wraps(save)
    def fenced_save(saver: Any, *args: Any, **kwargs: Any) -> Any:
        if _TABLES is None or not tfi.executing_eagerly():
            return save(saver, *args, **kwargs)
        objects, _ = saver._graph_view.breadth_first_traversal()
        if not any(obj is _TABLES for obj in objects):
            return save(saver, *args, **kwargs)
        with _FENCING, _fence(_fenced_locks()):
            return save(saver, *args, **kwargs)

    fenced_save._safevars_exactly_once = True  # type: ignore[attr-defined]
    return fenced_save


def _restoring(restore: Callable[..., Any]) -> Callable[..., Any]:
    """``TrackableSaver.restore``: the watermark the process knows is read again."""

    @functools.wraps(restore)
    def restore_tables(saver: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return restore(saver, *args, **kwargs)
        finally:
            if _TABLES is not None:
                _TABLES._restoring()

    restore_tables._safevars_exactly_once = True  # type: ignore[attr-defined]
    return restore_tables


def _install() -> None:
    """Wraps ``TrackableSaver.save`` and ``restore`` (over safevars.locking's wrappers)."""
    entry_points = tfi.checkpoint_entry_points(None, None)
    for owner, name, _ in entry_points[:2]:  # TrackableSaver.save, .restore
        current = getattr(owner, name)
        if not getattr(current, "_safevars_exactly_once", False):
            setattr(owner, name, (_saving if name == "save" else _restoring)(current))


_install()
