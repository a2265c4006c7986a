"""A scheduled step's sections, recorded: each write section of a trace becomes "look its
(token, section) key up in its parameter server's table; apply and record it, or discard
it and count a duplicate", inside its locks (:class:`_Trace`, the ``sections`` body
wrapper :func:`_wrapping` registers while the step is traced)."""

from __future__ import annotations

import contextlib
import functools
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import locking, sections
from safevars.errors import UnsupportedStrategyError
from safevars.exactly_once.applied_tables import tables
from safevars.exactly_once.state import (
    _FENCING,
    _LOCK,
    _SECTION_BITS,
    _WATERMARK_KEY,
    get_or_make,
)
from safevars.locking import SectionLock

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
        record = get_or_make(_RECORDS, lock, lambda: _LockRecord(lock))
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
