"""The happens-before analysis: accesses, lock sets and the race detector.

Per access, its thread's clock and run (``clocks.py``) and the locks and section
instances that protect it (:func:`_eager_protection`, and the traced sections of
``tf_function.py``). Per audit, a :class:`_Detector` that pairs each thread's
read-modify-write windows and blind writes with the unordered writes of other threads,
and each thread's reads of several variables (a *view*) with the updates other threads
make of them, and records the races, observed or predicted. The detection rules are
stated in the package docstring (``safevars/audit/__init__.py``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import Any

from safevars import locking
from safevars.audit.clocks import Clock, _Run, _ThreadState
from safevars.audit.report import (
    CONCURRENT_WRITE,
    LOST_UPDATE,
    OBSERVED,
    PREDICTED,
    TORN_READ,
    Race,
    fix_for,
)

_READ = 0
_WRITE = 1
# A write that is not based on an earlier read of the variable: ``compare_and_assign``
# checked, under the lock, that no write intervened; Keras' metric resets and
# ``set_weights`` write values that do not come from a read.
_VALIDATED_WRITE = 2

_EMPTY: frozenset[Any] = frozenset()
_SEQ = itertools.count(1)  # next() on itertools.count is atomic under the GIL.
_SECTION_IDS = itertools.count(1)
_UNIT_IDS = itertools.count(1)  # one per snapshot call: its reads are one consistent unit

# Guards every detector, ``active._ACTIVE`` and the traced-function summaries.
_DETECT_LOCK = threading.Lock()

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
    vc: Clock
    begin: int
    end: int
    locks: frozenset[Any]
    sections: frozenset[Any]
    family: str | None
    context: str
    run: _Run
    unit: Any  # reads of one snapshot call share it; None: the read is its own unit
    api: str | None  # the Keras call the access came from (``"train_on_batch"``)

    @classmethod
    def record(
        cls,
        kind: int,
        var: Any,
        name: str | None,
        site: str,
        run: _Run,
        begin: int,
        end: int,
        locks: frozenset[Any],
        sections: frozenset[Any],
        family: str | None,
        context_name: str,
        unit: Any = None,
        api: str | None = None,
    ) -> _Access:
        """The access the thread of ``run`` makes now (the run's clocks)."""
        return cls(
            kind,
            var,
            name,
            site,
            run.tid,
            run.tname,
            run.clock,
            run.vc,
            begin,
            end,
            locks,
            sections,
            family,
            context_name,
            run,
            unit,
            api,
        )


def _happens_before(access: _Access, vc: Clock) -> bool:
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


def _lock_keys(instances: frozenset[Any]) -> set[Any]:
    return {s[0] for s in instances}


# ---------------------------------------------------------------------- the detector


class _Window:
    __slots__ = ("read", "write", "protect")

    def __init__(self, read: _Access, write: _Access) -> None:
        self.read = read
        self.write = write
        # Locks held continuously from the read to the write (same section instance).
        self.protect = frozenset(s[0] for s in read.sections & write.sections)


class _ReadMark:
    """A run's reads of one variable: the snapshot calls that read it (the latest few),
    the section instances common to all its reads, the first read and the last end."""

    __slots__ = ("snapshots", "sections", "first", "end")

    def __init__(self, access: _Access) -> None:
        self.snapshots: list[Any] = [] if access.unit is None else [access.unit]
        self.sections = access.sections
        self.first = access
        self.end = access.end


_SNAPSHOTS_KEPT = 8


class _Update:
    """A run's writes made under the same section instances: one update (the latest
    write of each variable)."""

    __slots__ = ("writes", "cover")

    def __init__(self, cover: frozenset[Any]) -> None:
        self.writes: dict[Any, _Access] = {}
        self.cover = _lock_keys(cover)


class _RunView:
    """What one audit saw of one run."""

    __slots__ = ("reads", "updates")

    def __init__(self) -> None:
        self.reads: dict[Any, _ReadMark] = {}
        self.updates: dict[frozenset[Any], _Update] = {}


class _VarState:
    __slots__ = ("name", "pending", "writes", "windows", "blind", "read_runs", "write_runs")

    def __init__(self) -> None:
        self.name = "variable"
        self.pending: dict[int, _Access] = {}
        self.writes: dict[tuple[Any, ...], _Access] = {}
        self.windows: dict[tuple[Any, ...], _Window] = {}
        self.blind: dict[tuple[Any, ...], _Access] = {}
        # The latest run of each thread that read (wrote) the variable.
        self.read_runs: dict[int, _Run] = {}
        self.write_runs: dict[int, _Run] = {}


class _Finding:
    __slots__ = (
        "kind",
        "variables",
        "read_sites",
        "write_sites",
        "threads",
        "observed",
        "count",
        "contexts",
        "calls",
    )

    def __init__(
        self,
        kind: str,
        variables: tuple[str, ...],
        read_sites: tuple[str, ...],
        write_sites: tuple[str, ...],
    ) -> None:
        self.kind = kind
        self.variables = variables
        self.read_sites = read_sites
        self.write_sites = write_sites
        self.threads: set[str] = set()
        self.observed = False
        self.count = 0
        self.contexts: set[str] = set()
        self.calls: set[str] = set()

    def frozen(self) -> Race:
        calls = tuple(sorted(self.calls))
        return Race(
            kind=self.kind,
            variable=self.variables[0],
            threads=tuple(sorted(self.threads)),
            read_site=self.read_sites[0] if self.kind == LOST_UPDATE else None,
            write_sites=self.write_sites,
            evidence=OBSERVED if self.observed else PREDICTED,
            count=self.count,
            contexts=tuple(sorted(self.contexts)),
            variables=self.variables,
            read_sites=self.read_sites,
            calls=calls,
            fix=fix_for(self.kind, self.variables, calls),
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
        run = access.run
        view = run.views.get(self)
        if view is None:
            view = run.views[self] = _RunView()
        if access.kind == _READ:
            self.reads += 1
            var.pending[tid] = access
            mark = view.reads.get(access.var)
            if mark is None:
                view.reads[access.var] = _ReadMark(access)
            else:  # what a _ReadMark adds, inline: this runs at every read
                if access.unit is not None and access.unit not in mark.snapshots:
                    mark.snapshots.append(access.unit)
                    del mark.snapshots[:-_SNAPSHOTS_KEPT]
                if mark.sections:
                    mark.sections = mark.sections & access.sections
                mark.end = access.end
            var.read_runs[tid] = run
            if len(view.reads) > 1:
                self._torn_after_read(var, access, run, view)
            return
        self.writes += 1
        self._lost_or_concurrent(var, access)
        update = view.updates.get(access.sections)
        if update is None:
            update = view.updates[access.sections] = _Update(access.sections)
        update.writes[access.var] = access
        var.write_runs[tid] = run
        if len(update.writes) > 1:
            self._torn_after_write(var, access, run, update)

    # -- lost updates and concurrent writes

    def _lost_or_concurrent(self, var: _VarState, access: _Access) -> None:
        tid = access.tid
        read = var.pending.pop(tid, None)
        if access.kind == _VALIDATED_WRITE:
            read = None  # never based on a stale read
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
                        (
                            access.api or other.api or access.var,
                            CONCURRENT_WRITE,
                            tuple(sorted((other.site, access.site))),
                        ),
                        CONCURRENT_WRITE,
                        (var.name,),
                        (),
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
        write_sites = (window.write.site, other.site)
        # The variables of one Keras call (a model's weights, an optimizer's slots) race
        # at the same lines: one finding lists them all.
        self._record(
            (window.write.api or other.api or key, LOST_UPDATE, window.read.site, write_sites),
            LOST_UPDATE,
            (var.name,),
            (window.read.site,),
            write_sites,
            (window.read, window.write, other),
            observed,
        )

    # -- torn reads

    def _torn_after_read(self, var: _VarState, access: _Access, run: _Run, view: _RunView) -> None:
        for wtid, wrun in var.write_runs.items():
            if wtid == access.tid:
                continue
            wview = wrun.views.get(self)
            if wview is None:
                continue
            for update in wview.updates.values():
                if access.var in update.writes and len(update.writes) > 1:
                    self._torn(run, view, wrun, update)

    def _torn_after_write(
        self, var: _VarState, access: _Access, run: _Run, update: _Update
    ) -> None:
        for rtid, rrun in var.read_runs.items():
            if rtid == access.tid:
                continue
            rview = rrun.views.get(self)
            if rview is not None and len(rview.reads) > 1:
                self._torn(rrun, rview, run, update)

    def _torn(self, rrun: _Run, rview: _RunView, wrun: _Run, update: _Update) -> None:
        """Whether a view (reads of ``rrun``) can fall in the middle of an update."""
        reads = rview.reads
        shared = [v for v in update.writes if v in reads]
        if len(shared) < 2:
            return
        common = set(reads[shared[0]].snapshots)
        for v in shared[1:]:
            if not common:
                break
            common.intersection_update(reads[v].snapshots)
        if common:
            return  # One snapshot read them all: at one instant.
        if wrun.clock <= rrun.vc.get(wrun.tid, 0) or rrun.clock <= wrun.vc.get(rrun.tid, 0):
            return  # The whole update happened before the reads, or after them.
        cover = reads[shared[0]].sections
        for v in shared[1:]:
            cover = cover & reads[v].sections
        if update.cover & _lock_keys(cover):
            return  # One lock held across the reads and across the update.
        marks = [reads[v] for v in shared]
        writes = [update.writes[v] for v in shared]
        first = min(m.first.begin for m in marks)
        last = max(m.end for m in marks)
        observed = any(w.begin < last and w.end > first for w in writes)
        names = tuple(sorted(self.vars[v].name for v in shared))
        read_sites = tuple(sorted({m.first.site for m in marks}))
        write_sites = tuple(sorted({w.site for w in writes}))
        # Views of Keras calls (every weight read at the line of the call) are one
        # finding per pair of lines, listing every variable.
        apis = frozenset(a.api for a in (*(m.first for m in marks), *writes) if a.api)
        self._record(
            (TORN_READ, apis or frozenset(shared), read_sites, write_sites),
            TORN_READ,
            names,
            read_sites,
            write_sites,
            (*(m.first for m in marks), *writes),
            observed,
        )

    # -- findings

    def _record(
        self,
        fkey: tuple[Any, ...],
        kind: str,
        variables: tuple[str, ...],
        read_sites: tuple[str, ...],
        write_sites: tuple[str, ...],
        accesses: tuple[_Access, ...],
        observed: bool,
    ) -> None:
        if not observed and not self.predictive:
            return
        finding = self.findings.get(fkey)
        if finding is None:
            finding = self.findings[fkey] = _Finding(kind, variables, read_sites, write_sites)
        if finding.variables != variables:
            finding.variables = tuple(sorted({*finding.variables, *variables}))
        finding.count += 1
        finding.observed = finding.observed or observed
        for access in accesses:
            finding.threads.add(access.tname)
            finding.contexts.add(access.context)
            if access.api:
                finding.calls.add(access.api)

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
