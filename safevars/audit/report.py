"""What an audit reports: :class:`AuditReport`, each :class:`Race` and their text.

The race kinds (``LOST_UPDATE``, ``CONCURRENT_WRITE``) and evidences (``OBSERVED``,
``PREDICTED``) are defined here; the analysis that finds them is in
``happens_before.py``, above this module: a report asks its detector for a copy of its
findings (:class:`Detecting`).
"""

from __future__ import annotations

import dataclasses
import linecache
import os
from typing import Any, Protocol

__all__ = [
    "CONCURRENT_WRITE",
    "LOST_UPDATE",
    "OBSERVED",
    "PREDICTED",
    "AuditReport",
    "Race",
]

LOST_UPDATE = "lost_update"
CONCURRENT_WRITE = "concurrent_write"
OBSERVED = "observed"
PREDICTED = "predicted"


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


# ---------------------------------------------------------------------- the report


class Detecting(Protocol):
    """What a report needs of its audit's detector (``happens_before._Detector``): each
    method returns a consistent copy, taken under the detector's lock."""

    closed: bool

    def races(self) -> list[Race]:
        """The findings so far, frozen, in the order they were first found."""

    def to_dict(self) -> dict[str, Any]:
        """The data of :meth:`AuditReport.to_dict`."""


class AuditReport:
    """What an :func:`audit` found: live while the block runs, frozen after it.

    Thread safety: every method may be called from any thread at any time, also while
    other threads are being audited; each call returns a consistent copy.

    Modes: one report covers eager accesses and the replayed accesses of
    ``tf.function`` calls (see :mod:`safevars.audit`).
    """

    def __init__(self, detector: Detecting) -> None:
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
        return self._detector.races()

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-serialisable).

        Returns:
          ``{"active", "predictive", "races": [...], "accesses": {...}, "threads",
          "variables", "functions": {"calls", "not_analysed"}}``; each race is
          :class:`Race`'s fields as a dict.

        Thread safety: a consistent copy, safe to call while threads are running.

        Modes: as :attr:`races`.
        """
        return self._detector.to_dict()

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
