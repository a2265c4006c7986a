"""The happens-before analysis: vector clocks, lock sets and the race detector.

Per thread, a vector clock advanced by program order, ``Thread.start`` and a finished
``Thread.join`` (:class:`_Session`); per access, the locks and section instances that
protect it (:func:`_eager_protection`, and the traced sections of ``tf_function.py``);
per audit, a :class:`_Detector` that pairs each thread's read-modify-write windows and
blind writes with the unordered writes of other threads and records the races, observed
or predicted. The detection rule is stated in the package docstring
(``safevars/audit/__init__.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import weakref
from typing import Any

from safevars import locking
from safevars.audit.report import CONCURRENT_WRITE, LOST_UPDATE, OBSERVED, PREDICTED, Race

_READ = 0
_WRITE = 1
_VALIDATED_WRITE = 2  # A write that checked, under the lock, that no write intervened.

_EMPTY: frozenset[Any] = frozenset()
_SEQ = itertools.count(1)  # next() on itertools.count is atomic under the GIL.
_SECTION_IDS = itertools.count(1)

# Guards every detector, ``active._ACTIVE`` and the traced-function summaries.
_DETECT_LOCK = threading.Lock()


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


# ---------------------------------------------------------------------- accesses


@dataclasses.dataclass(slots=True, eq=False)  # identity equality: ``var`` may be a tensor
class _Access:
    """One recorded read or write (eager, or replayed from a traced function)."""

    kind: int
    var: Any
    name: str | None
    site: str
    tid: int
    tname: str
    clock: int
    vc: dict[int, int]
    begin: int
    end: int
    locks: frozenset[Any]
    sections: frozenset[Any]
    family: str | None
    context: str

    @classmethod
    def record(
        cls,
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
    ) -> _Access:
        """The access ``state``'s thread makes now (its clock and vector clock)."""
        return cls(
            kind,
            var,
            name,
            site,
            state.tid,
            state.name,
            state.vc[state.tid],
            state.vc,
            begin,
            end,
            locks,
            sections,
            family,
            context_name,
        )


def _happens_before(access: _Access, vc: dict[int, int]) -> bool:
    """Whether ``access`` happens before the point of a thread whose clock is ``vc``."""
    return access.clock <= vc.get(access.tid, 0)


# ---------------------------------------------------------------------- lock sets


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


class _Detector:
    """The findings of one audit. :meth:`observe` and what it calls run with
    ``_DETECT_LOCK`` held; :meth:`races` and :meth:`to_dict` take it."""

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

    def races(self) -> list[Race]:
        """The findings so far, frozen (``AuditReport.races``)."""
        with _DETECT_LOCK:
            return [f.frozen() for f in self.findings.values()]

    def to_dict(self) -> dict[str, Any]:
        """The audit as plain data (``AuditReport.to_dict``), a consistent copy."""
        with _DETECT_LOCK:
            return {
                "active": not self.closed,
                "predictive": self.predictive,
                "races": [dataclasses.asdict(f.frozen()) for f in self.findings.values()],
                "accesses": {
                    "eager_or_replayed_reads": self.reads,
                    "eager_or_replayed_writes": self.writes,
                    "traced": self.traced,
                },
                "threads": sorted(self.threads),
                "variables": sorted(v.name for v in self.vars.values()),
                "functions": {
                    "calls": dict(self.calls),
                    "not_analysed": dict(self.unanalysed),
                },
            }
