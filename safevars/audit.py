"""``safevars.audit()``: find unsynchronized variable access in existing code.

The problem: ``v.assign(v.read_value() + 1)`` on a ``tf.Variable`` shared by threads
loses updates, silently, and only sometimes. Thread sanitizers see C++ memory, not a
Python read-then-write of a variable, and a lost update leaves no trace in the result
except a number that is a little off. ::

    with safevars.audit() as report:
        train_with_threads()
    print(report)          # each race: variable, threads, file:line of the read and writes

While an audit is active, every ``tf.Variable`` used by any thread (plain ones, Keras
variables' backing variables and the variables inside :class:`~safevars.SafeVariable`)
is watched: reads (``read_value``, ``value``, ``numpy``, tensor conversion, ``v + 1``,
``sparse_read``, ``gather_nd``) and writes (``assign``, ``assign_add``, ``assign_sub``,
the ``scatter_*`` family, slice assignment) are recorded with the thread, the user code
line that made them (the first stack frame outside TensorFlow, Keras, wrapt, safevars and
the threading machinery) and the safevars locks the thread holds.

Detection rule
==============

Each recorded access gets two numbers from one global counter: ``begin`` before the
TensorFlow call and ``end`` after it returns. For each variable and thread, the thread's
*pending read* is its last read of the variable since its own last write of it.

* **Window.** When thread A writes ``v`` while it has a pending read of ``v``, the pair
  (that read, this write) is a *read-modify-write window*: A's write may be based on what
  it read. A window is *protected by* a lock if the read and the write happened inside
  one continuous hold of it (same ``safevars.locked``/``update``/``transaction``
  section of a safevars guard, same ``tf.CriticalSection.execute``). A write with no
  pending read is a *blind* write.
* **lost_update.** A window of thread A and a write of the same variable by another
  thread B conflict when B's write is *not ordered* with respect to the window (see
  below), unless the window is protected by a lock that B also held for its write, or
  both writes are commutative updates of one family (``assign_add``/``assign_sub``/
  ``scatter_add``/..., whose effects cannot be lost). Whether B's write actually fell
  between A's read and A's write is irrelevant: the detector reports what *can* happen,
  so it does not depend on the scheduler producing a lost update during the audit.
* **concurrent_write.** Two blind writes of ``v`` by different threads conflict when
  they are not ordered, they hold no common safevars lock, and they are not commutative
  updates of one family (last writer wins, nondeterministically).
* safevars' own bookkeeping is not audited: the version counters of SafeVariables, and
  the read SafeVariable returns after a graph write. A ``compare_and_assign`` write
  checked under the lock that no write intervened since the caller's snapshot, so it
  opens no window (it is still a write other threads' windows can conflict with).

*Ordering* is happens-before, tracked with vector clocks over the synchronization the
audit can see: program order in a thread, ``threading.Thread.start`` (everything the
parent did before ``start`` happens before the child) and a ``Thread.join`` that
returned with the thread finished (everything the thread did happens before what the
joiner does next). Initialising a variable before starting the workers and reading or
resetting it after joining them is therefore never reported; two workers that run at the
same time always are, however the GIL happened to interleave them.

Every finding carries an ``evidence``: ``"observed"`` when the recorded intervals
actually overlapped (B's write ``[begin, end]`` intersects A's window ``[read.begin,
write.end]``: the operations were in flight at the same time, or B's write fell between
A's read and write), ``"predicted"`` when the conflict comes from the ordering alone.
With ``predictive=False`` only observed findings are reported, for code that orders its
accesses by means the audit cannot see.

Findings are deduplicated by (variable, kind, read site, write sites); each keeps the
names of every thread involved (``"name #n"`` when two threads share a name), how many
times the pattern matched and whether it came from eager code or a ``tf.function``.
Variables are identified by their resource handle and shown by name.

Inside ``tf.function``
======================

Graph execution happens in C++ and is invisible to Python patching. What the audit does
instead:

* Accesses made while a function is being *traced* are not run-time accesses (they
  happen once, when the graph is built); they are recorded, in program order, as the
  function's access list, with the ``tf.CriticalSection`` s and safevars graph sections
  they were traced in (SafeVariable's run-time locks) and the user lines they come from (AutoGraph's
  generated code is mapped back to the source).
* Each eager call of a concrete function traced while an audit was active replays that
  list as accesses of the calling thread, spanning the call, with its sections counted
  per call. Two threads running functions that read then write a shared variable (or a
  function racing with eager code) are then reported like eager code, with
  ``context`` naming the function. A nested function call adds its list to the caller's.

A variable passed to the function as an argument, rather than captured, is attributed
to the variable passed in each call.

What it cannot see: functions traced before any audit was active (their calls are
counted under "not analysed" in the report: trace them inside the block), accesses made
with raw ops on a handle (``tf.raw_ops.AssignVariableOp``), and data dependence: a
``tf.cond`` branch or loop body counts as executed once per call, so a conditional write
counts as a write and a loop's read-then-write as one window.

Cost
====

Nothing is patched when no audit is active: the first audit installs the patches, the
last one to end removes them and restores the original functions, also when its block
raises. While active, every variable access walks a few stack frames and takes one lock
(the benchmark family ``audit`` measures it).

Audits may nest and may be active in several threads at once: each one sees every access
made by any thread while it is active.

NOTES:
  What is *not* understood as synchronization: ``threading.Lock``, queues, events,
  barriers, futures. Code that orders variable accesses only with those is reported as
  racy (``evidence="predicted"``); make the read-modify-write atomic with
  :meth:`SafeVariable.update` or ``safevars.locked``, which the audit understands, or
  pass ``predictive=False``. Writes to disjoint indices (``scatter_update`` on
  different rows) are treated as writes of the whole variable. Under ``tf.distribute``
  each component variable is audited on its own.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import linecache
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from safevars import locking, sections
from safevars import variable as variable_module
from safevars._tf_internal import (
    autograph_source_map,
    concrete_function,
    critical_section_ops,
    func_graph_module,
    ops,
    resource_variable_ops,
)
from safevars._tf_internal import eager_context_module as context
from safevars.errors import InvalidArgumentError, RaceDetectedError

__all__ = [
    "CONCURRENT_WRITE",
    "LOST_UPDATE",
    "OBSERVED",
    "PREDICTED",
    "AuditReport",
    "Race",
    "audit",
]

LOST_UPDATE = "lost_update"
CONCURRENT_WRITE = "concurrent_write"
OBSERVED = "observed"
PREDICTED = "predicted"

_READ = 0
_WRITE = 1
_VALIDATED_WRITE = 2  # A write that checked, under the lock, that no write intervened.

_READ_METHODS = ("_read_variable_op", "sparse_read", "gather_nd")
_WRITE_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "scatter_add",
    "scatter_sub",
    "scatter_max",
    "scatter_min",
    "scatter_mul",
    "scatter_div",
    "scatter_update",
    "batch_scatter_update",
    "scatter_nd_add",
    "scatter_nd_sub",
    "scatter_nd_update",
    "scatter_nd_max",
    "scatter_nd_min",
    "_strided_slice_assign",
)
# Writes of one family commute: applied in any order they give the same value, so one
# cannot make another's effect disappear.
_COMMUTATIVE = {
    "assign_add": "add",
    "assign_sub": "add",
    "scatter_add": "add",
    "scatter_sub": "add",
    "scatter_nd_add": "add",
    "scatter_nd_sub": "add",
    "scatter_mul": "mul",
    "scatter_div": "mul",
    "scatter_max": "max",
    "scatter_nd_max": "max",
    "scatter_min": "min",
    "scatter_nd_min": "min",
}

_EMPTY: frozenset[Any] = frozenset()
_SEQ = itertools.count(1)  # next() on itertools.count is atomic under the GIL.
_SECTION_IDS = itertools.count(1)


# ---------------------------------------------------------------------- public records


@dataclasses.dataclass(frozen=True)
class Race:
    """One finding of :func:`audit`. Immutable.

    Attributes:
      kind: ``"lost_update"`` (a thread's read-then-write of the variable can be
        interleaved with another thread's write) or ``"concurrent_write"`` (blind writes
        by different threads, unordered, last writer wins).
      variable: The variable's name (``"counter:0"``).
      threads: Names of every thread seen taking part, sorted.
      read_site: ``"file:line"`` of the read the write was based on (``lost_update``),
        else ``None``.
      write_sites: For ``lost_update``: the reading thread's own write first, then the
        other thread's write that can come in between. For ``concurrent_write``: the two
        writes, sorted. Each ``"file:line"``.
      evidence: ``"observed"`` if the conflicting operations were recorded in flight at
        the same time at least once, ``"predicted"`` if they are merely unordered.
      count: How many times the pattern matched (each new window or write is compared
        with the latest access of every other thread and site).
      contexts: Where the accesses ran: ``"eager"`` and/or ``"tf.function 'name'"``.
    """

    kind: str
    variable: str
    threads: tuple[str, ...]
    read_site: str | None
    write_sites: tuple[str, ...]
    evidence: str
    count: int
    contexts: tuple[str, ...]

    def __str__(self) -> str:
        title = "lost update" if self.kind == LOST_UPDATE else "concurrent unlocked writes"
        lines = [
            (
                f"{title} on {self.variable!r}: threads {', '.join(self.threads)} "
                f"({self.evidence}, matched {self.count}x, {', '.join(self.contexts)})"
            )
        ]
        if self.kind == LOST_UPDATE:
            lines.append(_site_line("read ", self.read_site, "value read here"))
            lines.append(_site_line("write", self.write_sites[0], "written back here"))
            lines.append(
                _site_line("write", self.write_sites[1], "another thread can write in between")
            )
            lines.append(
                "    fix: make the read and the write one step: SafeVariable.update(fn), "
                "or both inside `with safevars.locked(v):`"
            )
        else:
            for site in self.write_sites:
                lines.append(_site_line("write", site, ""))
            lines.append(
                "    fix: hold the variable's lock for both writes (safevars.locked / a "
                "SafeVariable) or order them (join the writer first)"
            )
        return "\n".join(lines)


def _site_line(label: str, site: str | None, note: str) -> str:
    shown = _short_path(site) if site else "?"
    code = ""
    if site and ":" in site:
        path, _, line = site.rpartition(":")
        if line.isdigit():
            code = linecache.getline(path, int(line)).strip()
    text = f"    {label}  {shown}"
    if code:
        text += f"  `{code}`"
    if note:
        text += f"  ({note})"
    return text


def _short_path(site: str) -> str:
    try:
        relative = os.path.relpath(site)
    except ValueError:  # pragma: no cover - other drive on Windows
        return site
    return relative if len(relative) < len(site) else site


# ---------------------------------------------------------------------- stack sites

_INTERNAL = 1
_SAFEVARS = 2
_USER = 0


def _package_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
    dirs = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
    return tuple(dirs)


_INTERNAL_DIRS = _package_dirs(("tensorflow", "keras", "tf_keras", "wrapt", "absl")) + (
    os.path.join(os.path.dirname(os.path.abspath(threading.__file__)), "concurrent", ""),
)
_INTERNAL_FILES = frozenset(
    os.path.abspath(m.__file__) for m in (threading, contextlib, functools)
)
_SAFEVARS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_FILE_KIND: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    kind = _FILE_KIND.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_SAFEVARS_DIR):
            kind = _SAFEVARS
        elif (
            path in _INTERNAL_FILES
            or path.startswith(_INTERNAL_DIRS)
            or filename.startswith("<frozen")
        ):
            kind = _INTERNAL
        else:
            kind = _USER
        _FILE_KIND[filename] = kind
    return kind


_PLAIN = 0
_IGNORE = 1
_VALIDATE = 2


def _nested_codes(code: Any) -> set[Any]:
    """``code`` and every function body defined inside it (closures, lambdas)."""
    found = {code}
    for const in code.co_consts:
        if hasattr(const, "co_consts"):
            found |= _nested_codes(const)
    return found


def _caller_roles() -> dict[Any, int]:
    """What an access means when safevars itself makes it (first non-TensorFlow frame).

    * SafeVariable's graph writes return a read of the new value, made for the caller:
      bookkeeping, not the start of a read-modify-write (ignored).
    * ``compare_and_assign`` writes only if the version did not move since the caller's
      snapshot, so its write is never based on a stale read (it discards the pending
      read and counts as a write validated under the lock).
    """
    roles = {variable_module.SafeVariable._graph_write_body.__code__: _IGNORE}
    for code in _nested_codes(variable_module.SafeVariable.compare_and_assign.__code__):
        roles[code] = _VALIDATE
    return roles


_CALLER_ROLES = _caller_roles()


def _user_site(frame: Any) -> tuple[str, int]:
    """``("file:line", role)`` for the first user frame at or above ``frame``."""
    role = None
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind != _INTERNAL and role is None:
            role = _CALLER_ROLES.get(code, _PLAIN)
            if role == _IGNORE:
                return "", role
        if kind == _USER:
            filename, lineno = code.co_filename, frame.f_lineno
            if "__autograph_generated_file" in filename:
                filename, lineno = _autograph_origin(filename, lineno)
            return f"{filename}:{lineno}", role or _PLAIN
        frame = frame.f_back
    return "<unknown>", role or _PLAIN


def _autograph_origin(filename: str, lineno: int) -> tuple[str, int]:
    """Maps a line of AutoGraph's generated code back to the user's source line."""
    try:  # Private TensorFlow API: if it moves, sites point at the generated file.
        mapper = autograph_source_map()[threading.get_ident()][-1]
        origin = mapper.get_effective_source_map().get((filename, lineno))
    except Exception:  # noqa: BLE001 - any failure only loses the mapping
        origin = None
    if origin:
        return origin[0], origin[1]
    return filename, lineno


# ---------------------------------------------------------------------- threads, clocks


class _ThreadState:
    """Per-thread audit state: a vector clock and the critical sections being executed."""

    __slots__ = ("tid", "name", "vc", "sections", "write_depth", "__weakref__")

    def __init__(self, tid: int, name: str, inherited: dict[int, int]) -> None:
        self.tid = tid
        self.name = name
        # Vector clocks are never mutated in place: a new dict replaces the old one, so
        # an access can keep a reference to the clock it was made at.
        self.vc: dict[int, int] = {**inherited, tid: 1}
        # (lock key, section instance, graph or None) for every CriticalSection.execute
        # this thread is inside, eager (graph None) or being traced.
        self.sections: list[tuple[int, int, Any]] = []
        self.write_depth = 0


class _Session:
    """Happens-before state shared by every audit active at the same time."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.ids = itertools.count(1)
        self.forks: weakref.WeakKeyDictionary[threading.Thread, dict[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self.states: weakref.WeakKeyDictionary[threading.Thread, _ThreadState] = (
            weakref.WeakKeyDictionary()
        )
        # id(handle) -> (handle, name) of every variable seen. Variables are keyed by the
        # id of their resource handle (shared by ``_UnreadVariable`` results and by the
        # arguments a traced function receives); holding the handle keeps the id unique
        # for the whole session.
        self.handles: dict[int, tuple[Any, str | None]] = {}
        self.names: set[str] = set()
        self.names_lock = threading.Lock()

    def register(self, handle: Any, name: str | None) -> None:
        known = self.handles.get(id(handle))
        if known is None or (name and not known[1]):
            self.handles[id(handle)] = (handle, name)

    def name_of(self, key: int) -> str | None:
        known = self.handles.get(key)
        return known[1] if known else None

    def state(self) -> _ThreadState:
        try:
            return self.local.state
        except AttributeError:
            pass
        thread = threading.current_thread()
        inherited = self.forks.pop(thread, None) or {}
        tid = next(self.ids)
        name = thread.name
        with self.names_lock:
            if name in self.names:  # Two threads with one name: keep them apart.
                name = f"{name} #{tid}"
            self.names.add(name)
        state = _ThreadState(tid, name, inherited)
        self.local.state = state
        self.states[thread] = state
        return state

    def fork(self, child: threading.Thread) -> None:
        parent = self.state()
        self.forks[child] = parent.vc
        parent.vc = {**parent.vc, parent.tid: parent.vc[parent.tid] + 1}

    def joined(self, child: threading.Thread) -> None:
        finished = self.states.get(child)
        if finished is None:
            return
        me = self.state()
        merged = dict(me.vc)
        for tid, clock in finished.vc.items():
            if merged.get(tid, 0) < clock:
                merged[tid] = clock
        me.vc = merged


_SESSION: _Session | None = None


# ---------------------------------------------------------------------- accesses


class _Access:
    """One recorded read or write (eager, or replayed from a traced function)."""

    __slots__ = (
        "kind",
        "var",
        "name",
        "site",
        "tid",
        "tname",
        "clock",
        "vc",
        "begin",
        "end",
        "locks",
        "sections",
        "family",
        "context",
    )

    def __init__(
        self,
        kind: int,
        var: Any,
        name: str | None,
        site: str,
        state: _ThreadState,
        begin: int,
        end: int,
        locks: frozenset[Any],
        sections: frozenset[Any],
        family: str | None,
        context_name: str,
    ) -> None:
        self.kind = kind
        self.var = var
        self.name = name
        self.site = site
        self.tid = state.tid
        self.tname = state.name
        self.vc = state.vc
        self.clock = state.vc[state.tid]
        self.begin = begin
        self.end = end
        self.locks = locks
        self.sections = sections
        self.family = family
        self.context = context_name


def _happens_before(access: _Access, vc: dict[int, int]) -> bool:
    """Whether ``access`` happens before the point of a thread whose clock is ``vc``."""
    return access.clock <= vc.get(access.tid, 0)


class _Traced:
    """One access recorded while tracing a function, replayed at each call."""

    __slots__ = ("kind", "var", "name", "site", "locks", "sections", "family", "position")

    def __init__(
        self,
        kind: int,
        var: Any,
        name: str | None,
        site: str,
        locks: frozenset[Any],
        sections: frozenset[Any],
        family: str | None,
        position: int | None = None,
    ) -> None:
        self.position = position
        self.kind = kind
        self.var = var
        self.name = name
        self.site = site
        self.locks = locks
        self.sections = sections
        self.family = family


class _Summary:
    """The accesses of one traced function, in program order."""

    __slots__ = ("name", "accesses", "positions")

    def __init__(self, name: str) -> None:
        self.name = name
        self.accesses: list[_Traced] = []
        # id(handle seen at trace time) -> index of the graph input that carries it at
        # run time (a capture, or an argument: then each call may pass another variable).
        self.positions: dict[int, int | None] = {}

    def position(self, graph: Any, handle_id: int) -> int | None:
        if handle_id not in self.positions:
            self.positions[handle_id] = _input_position(graph, handle_id)
        return self.positions[handle_id]


def _input_position(graph: Any, handle_id: int) -> int | None:
    """Index of the input of ``graph`` that carries the handle ``id`` (or None)."""
    # While a function is being traced, its inputs list holds the arguments' external
    # handles; afterwards the internal placeholders.
    captures = getattr(graph, "_function_captures", None)
    internal = getattr(captures, "by_val_internal", {}).get(handle_id)
    for index, placeholder in enumerate(graph.inputs):
        if id(placeholder) == handle_id or (internal is not None and placeholder is internal):
            return index
    return None


# FuncGraph -> accesses traced into it while an audit was active. Weak keys: a summary
# lives exactly as long as its graph, so keeping it between audits costs nothing.
_SUMMARIES: weakref.WeakKeyDictionary[Any, _Summary] = weakref.WeakKeyDictionary()


# ---------------------------------------------------------------------- the detector


class _Window:
    __slots__ = ("read", "write", "protect")

    def __init__(self, read: _Access, write: _Access) -> None:
        self.read = read
        self.write = write
        # Locks held continuously from the read to the write (same section instance).
        self.protect = frozenset(s[0] for s in read.sections & write.sections)


class _VarState:
    __slots__ = ("name", "pending", "writes", "windows", "blind")

    def __init__(self) -> None:
        self.name = "variable"
        self.pending: dict[int, _Access] = {}
        self.writes: dict[tuple[Any, ...], _Access] = {}
        self.windows: dict[tuple[Any, ...], _Window] = {}
        self.blind: dict[tuple[Any, ...], _Access] = {}


class _Finding:
    __slots__ = (
        "kind",
        "variable",
        "read_site",
        "write_sites",
        "threads",
        "observed",
        "count",
        "contexts",
    )

    def __init__(
        self, kind: str, variable: str, read_site: str | None, write_sites: tuple[str, ...]
    ) -> None:
        self.kind = kind
        self.variable = variable
        self.read_site = read_site
        self.write_sites = write_sites
        self.threads: set[str] = set()
        self.observed = False
        self.count = 0
        self.contexts: set[str] = set()

    def frozen(self) -> Race:
        return Race(
            kind=self.kind,
            variable=self.variable,
            threads=tuple(sorted(self.threads)),
            read_site=self.read_site,
            write_sites=self.write_sites,
            evidence=OBSERVED if self.observed else PREDICTED,
            count=self.count,
            contexts=tuple(sorted(self.contexts)),
        )


_DETECT_LOCK = threading.Lock()


class _Detector:
    """The findings of one audit. Every method runs with ``_DETECT_LOCK`` held."""

    def __init__(self, predictive: bool) -> None:
        self.predictive = predictive
        self.closed = False
        self.vars: dict[Any, _VarState] = {}
        self.findings: dict[tuple[Any, ...], _Finding] = {}
        self.reads = 0
        self.writes = 0
        self.traced = 0
        self.calls: collections.Counter[str] = collections.Counter()
        self.unanalysed: collections.Counter[str] = collections.Counter()
        self.threads: set[str] = set()

    def observe(self, access: _Access) -> None:
        var = self.vars.get(access.var)
        if var is None:
            var = self.vars[access.var] = _VarState()
        if access.name:
            var.name = access.name
        self.threads.add(access.tname)
        tid = access.tid
        if access.kind == _READ:
            self.reads += 1
            var.pending[tid] = access
            return
        self.writes += 1
        read = var.pending.pop(tid, None)
        if access.kind == _VALIDATED_WRITE:
            read = None  # compare_and_assign: never based on a stale read.
        if read is not None:
            window = _Window(read, access)
            for other in var.writes.values():  # earlier writes of other threads
                if other.tid != tid and not _happens_before(other, read.vc):
                    self._conflict(var, access.var, window, other)
            var.windows[(tid, read.site, access.site, window.protect)] = window
        else:
            for other in var.blind.values():
                if (
                    other.tid != tid
                    and not _happens_before(other, access.vc)
                    and not (other.locks & access.locks)
                    and not (access.family and other.family == access.family)
                ):
                    self._record(
                        access.var,
                        var,
                        CONCURRENT_WRITE,
                        None,
                        tuple(sorted((other.site, access.site))),
                        (other, access),
                        other.end > access.begin,
                    )
            var.blind[(tid, access.site, access.locks, access.family)] = access
        for window in var.windows.values():  # earlier windows of other threads
            if window.write.tid != tid and not _happens_before(window.write, access.vc):
                self._conflict(var, access.var, window, access)
        var.writes[(tid, access.site, access.locks, access.family)] = access

    def _conflict(self, var: _VarState, key: Any, window: _Window, other: _Access) -> None:
        if window.protect & other.locks:
            return  # Both inside the same lock: the write cannot come in between.
        if other.family and window.write.family == other.family:
            return  # Commutative updates: neither effect can be lost.
        observed = other.begin < window.write.end and other.end > window.read.begin
        self._record(
            key,
            var,
            LOST_UPDATE,
            window.read.site,
            (window.write.site, other.site),
            (window.read, window.write, other),
            observed,
        )

    def _record(
        self,
        key: Any,
        var: _VarState,
        kind: str,
        read_site: str | None,
        write_sites: tuple[str, ...],
        accesses: tuple[_Access, ...],
        observed: bool,
    ) -> None:
        if not observed and not self.predictive:
            return
        fkey = (key, kind, read_site, write_sites)
        finding = self.findings.get(fkey)
        if finding is None:
            finding = self.findings[fkey] = _Finding(kind, var.name, read_site, write_sites)
        finding.variable = var.name
        finding.count += 1
        finding.observed = finding.observed or observed
        for access in accesses:
            finding.threads.add(access.tname)
            finding.contexts.add(access.context)


_ACTIVE: tuple[_Detector, ...] = ()
_INSTALL_LOCK = threading.Lock()


def _deliver(accesses: list[_Access]) -> None:
    with _DETECT_LOCK:
        for detector in _ACTIVE:
            if not detector.closed:
                for access in accesses:
                    detector.observe(access)


# ---------------------------------------------------------------------- recording


def _eager_protection(state: _ThreadState) -> tuple[frozenset[Any], frozenset[Any]]:
    """(locks, section instances) protecting an eager access of the calling thread."""
    held = locking._held()
    sections = [s for s in state.sections if s[2] is None]
    if not held and not sections:
        return _EMPTY, _EMPTY
    locks = {id(g) for g in held}
    instances: set[Any] = {(id(g), g.seq) for g in held}
    for key, instance, _ in sections:
        locks.add(key)
        instances.add((key, instance))
    return frozenset(locks), frozenset(instances)


def _top_func_graph() -> Any:
    graph = ops.get_default_graph()
    top = None
    while isinstance(graph, func_graph_module.FuncGraph):
        top = graph
        graph = graph.outer_graph
    return top


def _variable_key_and_name(variable: Any, session: _Session) -> tuple[int, str | None]:
    handle = variable._handle
    name = getattr(variable, "_handle_name", None) or None
    session.register(handle, name)
    return id(handle), name or session.name_of(id(handle))


def _record_access(variable: Any, kind: int, method: str | None, begin: int) -> None:
    end = next(_SEQ)
    session = _SESSION
    if session is None or not _ACTIVE:
        return
    site, role = _user_site(sys._getframe(2))
    if role == _IGNORE:
        return
    if role == _VALIDATE and kind == _WRITE:
        kind = _VALIDATED_WRITE
    key, name = _variable_key_and_name(variable, session)
    family = _COMMUTATIVE.get(method) if method else None
    state = session.state()
    if context.executing_eagerly():
        locks, sections = _eager_protection(state)
        _deliver(
            [_Access(kind, key, name, site, state, begin, end, locks, sections, family, "eager")]
        )
        return
    top = _top_func_graph()
    if top is None:
        return  # A TF1-style graph: not audited.
    traced_sections = frozenset((k, i) for k, i, g in state.sections if g is not None)
    # Arguments are mapped to their graph inputs only while tracing: resolve it now.
    traced = _Traced(
        kind,
        key,
        name,
        site,
        frozenset(k for k, _ in traced_sections),
        traced_sections,
        family,
        _input_position(top, key),
    )
    with _DETECT_LOCK:
        summary = _SUMMARIES.get(top)
        if summary is None:
            summary = _SUMMARIES[top] = _Summary(top.name)
        summary.accesses.append(traced)
        for detector in _ACTIVE:
            if not detector.closed:
                detector.traced += 1


def _is_internal_variable(variable: Any) -> bool:
    # safevars' own version counters are bookkeeping under safevars' locks.
    return isinstance(variable, locking._VersionVariable)


def _read_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_internal_variable(self):
            return original(self, *args, **kwargs)
        begin = next(_SEQ)
        result = original(self, *args, **kwargs)
        _record_access(self, _READ, None, begin)
        return result

    return audited_read


def _write_wrapper(original: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = _SESSION
        if session is None or _is_internal_variable(self):
            return original(self, *args, **kwargs)
        state = session.state()
        if state.write_depth:  # A write implemented with another write: count once.
            return original(self, *args, **kwargs)
        state.write_depth += 1
        begin = next(_SEQ)
        try:
            result = original(self, *args, **kwargs)
        finally:
            state.write_depth -= 1
        _record_access(self, _WRITE, method, begin)
        return result

    return audited_write


def _writer(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda original: _write_wrapper(original, method)


def _execute_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_execute(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        session = _SESSION
        if session is None:
            return original(self, fn, *args, **kwargs)
        state = session.state()
        graph = None if context.executing_eagerly() else ops.get_default_graph()
        entry = (id(self), next(_SECTION_IDS), graph)
        state.sections.append(entry)
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            state.sections.remove(entry)

    return audited_execute


def _section_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``sections._traced_section``: the graph sections of safevars locks."""

    @functools.wraps(original)
    def audited_section(ordered: list[Any], fn: Any, after: Any, *rest: Any) -> Any:
        session = _SESSION
        if session is None:
            return original(ordered, fn, after, *rest)
        state = session.state()
        graph = ops.get_default_graph()
        # Locks an enclosing section already holds keep that section's instance: a
        # read there and a write here are one continuous hold.
        enclosing = set().union(*(locks for locks, _ in sections._enclosing_sections()))
        entries = [
            (id(lock), next(_SECTION_IDS), graph) for lock in ordered if lock not in enclosing
        ]
        state.sections.extend(entries)
        try:
            return original(ordered, fn, after, *rest)
        finally:
            for entry in entries:
                state.sections.remove(entry)

    return audited_section


def _call_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_call_flat(self: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        if _SESSION is None:
            return original(self, tensor_inputs, captured_inputs)
        if not context.executing_eagerly():
            _merge_nested(self)
            return original(self, tensor_inputs, captured_inputs)
        begin = next(_SEQ)
        result = original(self, tensor_inputs, captured_inputs)
        _replay(self, [*tensor_inputs, *captured_inputs], begin)
        return result

    return audited_call_flat


def _merge_nested(function: Any) -> None:
    """A function called while tracing another: its accesses become the caller's."""
    graph = getattr(function, "_func_graph", None)
    inner = _SUMMARIES.get(graph) if graph is not None else None
    top = _top_func_graph()
    if inner is None or top is None or top is graph:
        return
    session = _SESSION
    if session is None:
        return
    state = session.state()
    extra = frozenset((k, i) for k, i, g in state.sections if g is not None)
    extra_locks = frozenset(k for k, _ in extra)
    with _DETECT_LOCK:
        outer = _SUMMARIES.get(top)
        if outer is None:
            outer = _SUMMARIES[top] = _Summary(top.name)
        for t in list(inner.accesses):
            outer.accesses.append(
                _Traced(
                    t.kind,
                    t.var,
                    t.name,
                    t.site,
                    t.locks | extra_locks,
                    t.sections | extra,
                    t.family,
                )
            )


def _replay(function: Any, inputs: list[Any], begin: int) -> None:
    """Feeds a finished eager call's traced accesses to the active audits.

    ``inputs`` are the call's flat graph inputs (arguments, then captures): a traced
    access of a variable that reached the graph as an argument is attributed to the
    variable passed in this call.
    """
    end = next(_SEQ)
    session = _SESSION
    if session is None:
        return
    graph = getattr(function, "_func_graph", None)
    summary = _SUMMARIES.get(graph) if graph is not None else None
    name = getattr(graph, "name", "?")
    if summary is None:
        if graph is not None and graph.variables and not name.startswith("__backward"):
            with _DETECT_LOCK:
                for detector in _ACTIVE:
                    detector.unanalysed[name] += 1
        return
    state = session.state()
    locks, sections = _eager_protection(state)
    call = next(_SECTION_IDS)
    label = f"tf.function {summary.name!r}"
    accesses = []
    for t in list(summary.accesses):
        key, name = t.var, t.name
        position = t.position
        if position is None:
            position = summary.position(graph, t.var)
        if position is not None and position < len(inputs):
            handle = inputs[position]
            key = id(handle)
            if key != t.var:
                name = session.name_of(key) or f"argument of {summary.name!r}"
            session.register(handle, name)
        accesses.append(
            _Access(
                t.kind,
                key,
                name,
                t.site,
                state,
                begin,
                end,
                t.locks | locks,
                frozenset((k, i, call) for k, i in t.sections) | sections,
                t.family,
                label,
            )
        )
    with _DETECT_LOCK:
        for detector in _ACTIVE:
            if not detector.closed:
                detector.calls[summary.name] += 1
                for access in accesses:
                    detector.observe(access)


def _to_tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    # A variable passed to a tf.function as an argument is flattened to its handle
    # here; remember its name so the replayed accesses can show it.
    @functools.wraps(original)
    def audited_to_tensors(self: Any, value: Any) -> Any:
        tensors = original(self, value)
        session = _SESSION
        if session is not None and isinstance(value, resource_variable_ops.BaseResourceVariable):
            session.register(value._handle, getattr(value, "_handle_name", None) or None)
        return tensors

    return audited_to_tensors


def _start_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_start(self: threading.Thread) -> Any:
        session = _SESSION
        if session is not None:
            session.fork(self)
        return original(self)

    return audited_start


def _join_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_join(self: threading.Thread, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        session = _SESSION
        if session is not None and not self.is_alive():
            session.joined(self)
        return result

    return audited_join


# ---------------------------------------------------------------------- patching


def _variable_classes() -> list[type]:
    """``BaseResourceVariable`` and all its subclasses loaded so far (TensorFlow's own
    ``ResourceVariable`` re-wraps ``assign``/``assign_add``/``assign_sub``, so patching
    the base class alone would miss them)."""
    found: list[type] = []
    pending = [resource_variable_ops.BaseResourceVariable]
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found


def _patch_targets() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, wrapper factory) for everything an audit patches."""
    targets: list[tuple[Any, str, Callable[[Any], Any]]] = []
    for cls in _variable_classes():
        if cls is locking._VersionVariable:
            continue
        for method in _READ_METHODS:
            if method in cls.__dict__:
                targets.append((cls, method, _read_wrapper))
        for method in _WRITE_METHODS:
            if method in cls.__dict__:
                targets.append((cls, method, _writer(method)))
    for owner, name, factory in (
        (critical_section_ops.CriticalSection, "execute", _execute_wrapper),
        (sections, "_traced_section", _section_wrapper),
        (concrete_function.ConcreteFunction, "_call_flat", _call_wrapper),
        (resource_variable_ops.VariableSpec, "to_tensors", _to_tensors_wrapper),
        (threading.Thread, "start", _start_wrapper),
        (threading.Thread, "join", _join_wrapper),
    ):
        if name in owner.__dict__:  # A TensorFlow release without it: less to see.
            targets.append((owner, name, factory))
    return targets


_ORIGINALS: list[tuple[Any, str, Any]] = []
# (owner, name) -> (original, wrapper): wrappers are built once and reused by later
# audits, as long as the attribute still holds the same original.
_WRAPPERS: dict[tuple[Any, str], tuple[Any, Any]] = {}


def _install() -> None:
    variable_module._direct_kernel_writes = False  # SafeVariable writes via the methods.
    for owner, name, factory in _patch_targets():
        original = owner.__dict__[name]
        cached = _WRAPPERS.get((owner, name))
        if cached is None or cached[0] is not original:
            cached = _WRAPPERS[(owner, name)] = (original, factory(original))
        _ORIGINALS.append((owner, name, original))
        setattr(owner, name, cached[1])


def _uninstall() -> None:
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        setattr(owner, name, original)
    variable_module._direct_kernel_writes = True


def _activate(detector: _Detector) -> None:
    global _ACTIVE, _SESSION
    with _INSTALL_LOCK:
        if not _ACTIVE:
            _SESSION = _Session()
            try:
                _install()
            except BaseException:
                _uninstall()
                _SESSION = None
                raise
        with _DETECT_LOCK:
            _ACTIVE = (*_ACTIVE, detector)


def _deactivate(detector: _Detector) -> None:
    global _ACTIVE, _SESSION
    with _INSTALL_LOCK:
        with _DETECT_LOCK:
            detector.closed = True
            _ACTIVE = tuple(d for d in _ACTIVE if d is not detector)
        if not _ACTIVE:
            _uninstall()
            _SESSION = None


# ---------------------------------------------------------------------- the report


class AuditReport:
    """What an :func:`audit` found: live while the block runs, frozen after it.

    Thread safety: every method may be called from any thread at any time, also while
    other threads are being audited; each call returns a consistent copy.

    Modes: one report covers eager accesses and the replayed accesses of
    ``tf.function`` calls (see :mod:`safevars.audit`).
    """

    def __init__(self, detector: _Detector) -> None:
        self._detector = detector

    @property
    def active(self) -> bool:
        """Whether the audit is still recording."""
        return not self._detector.closed

    @property
    def races(self) -> list[Race]:
        """The findings so far, in the order they were first found (frozen copies).

        Thread safety: a consistent copy, safe to call while threads are running.

        Modes: eager and replayed ``tf.function`` accesses alike.
        """
        with _DETECT_LOCK:
            return [f.frozen() for f in self._detector.findings.values()]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable).

        Returns:
          ``{"active", "predictive", "races": [...], "accesses": {...}, "threads",
          "variables", "functions": {"calls", "not_analysed"}}``; each race is
          :class:`Race`'s fields as a dict.

        Thread safety: a consistent copy, safe to call while threads are running.

        Modes: as :attr:`races`.
        """
        with _DETECT_LOCK:
            d = self._detector
            return {
                "active": not d.closed,
                "predictive": d.predictive,
                "races": [dataclasses.asdict(f.frozen()) for f in d.findings.values()],
                "accesses": {
                    "eager_or_replayed_reads": d.reads,
                    "eager_or_replayed_writes": d.writes,
                    "traced": d.traced,
                },
                "threads": sorted(d.threads),
                "variables": sorted(v.name for v in d.vars.values()),
                "functions": {
                    "calls": dict(d.calls),
                    "not_analysed": dict(d.unanalysed),
                },
            }

    def __str__(self) -> str:
        data = self.to_dict()
        races = self.races
        accesses = data["accesses"]
        state = "running" if data["active"] else "finished"
        head = (
            f"safevars.audit ({state}): {len(races)} race(s) found in "
            f"{accesses['eager_or_replayed_reads']} reads and "
            f"{accesses['eager_or_replayed_writes']} writes of "
            f"{len(data['variables'])} variable(s) by {len(data['threads'])} thread(s)"
        )
        lines = [head]
        for index, race in enumerate(races, 1):
            lines.append(f"[{index}] {race}")
        notes = []
        calls = data["functions"]["calls"]
        if accesses["traced"] or calls:
            notes.append(
                f"{accesses['traced']} access(es) were traced inside tf.function; "
                f"{sum(calls.values())} call(s) replayed them in traced order (graph "
                "execution itself is not observed: branches and loop bodies count as "
                "run once per call)."
            )
        skipped = data["functions"]["not_analysed"]
        if skipped:
            names = ", ".join(f"{n!r} ({c}x)" for n, c in sorted(skipped.items()))
            notes.append(
                f"not analysed: calls of functions traced before the audit began: {names}. "
                "Trace them inside the audit to include them."
            )
        if not data["predictive"]:
            notes.append("predictive=False: only interleavings actually observed are listed.")
        if any(r.evidence == PREDICTED for r in races):
            notes.append(
                "evidence 'predicted': the accesses are not ordered by anything the audit "
                "understands (safevars locks, Thread.start/join), so the interleaving can "
                "happen even if it did not in this run."
            )
        lines.extend(f"note: {n}" for n in notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<safevars.AuditReport races={len(self.races)} active={self.active}>"


def audit(
    raise_on_race: bool = False, *, predictive: bool = True
) -> contextlib.AbstractContextManager[AuditReport]:
    """Context manager watching every ``tf.Variable`` access for races while it is active.

    Example::

        with safevars.audit() as report:
            run_threads()
        for race in report.races:
            print(race)

        # In a test suite: fail the test on any finding.
        with safevars.audit(raise_on_race=True):
            run_threads()

    Args:
      raise_on_race: If True, raise :class:`~safevars.RaceDetectedError` (an
        ``AssertionError``) when the block ends normally and the report lists a race.
        A block that raises keeps its own exception.
      predictive: If True (default), report conflicts between accesses that nothing
        orders (see the module docstring); if False, only those whose operations were
        recorded in flight at the same time.

    Returns:
      A context manager; ``with`` gives the :class:`AuditReport`.

    Raises:
      InvalidArgumentError: an argument is not a bool.
      RaceDetectedError: at the end of the block, with ``raise_on_race=True``.

    Thread safety: records accesses from every thread while active. Audits may nest and
    overlap across threads; each sees every access made while it is active. The patches
    are installed by the first active audit and removed by the last, also on exceptions.

    Modes: eager accesses are seen as they happen; ``tf.function`` accesses are seen at
    trace time and replayed at each eager call of the function (graph execution itself
    is invisible; see :mod:`safevars.audit`).
    """
    for name, value in (("raise_on_race", raise_on_race), ("predictive", predictive)):
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {value!r}.")
    return _audit(raise_on_race, predictive)


@contextlib.contextmanager
def _audit(raise_on_race: bool, predictive: bool) -> Iterator[AuditReport]:
    detector = _Detector(predictive)
    report = AuditReport(detector)
    _activate(detector)
    try:
        yield report
    finally:
        _deactivate(detector)
    if raise_on_race and report.races:
        raise RaceDetectedError(
            "safevars.audit(raise_on_race=True) found unsynchronized variable access:\n"
            + str(report)
        )
