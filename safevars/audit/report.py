"""What an audit reports: :class:`AuditReport`, each :class:`Race` and their text.

The race kinds (``LOST_UPDATE``, ``CONCURRENT_WRITE``, ``TORN_READ``), the evidences
(``OBSERVED``, ``PREDICTED``) and the fix each finding suggests (:func:`fix_for`) are
defined here; the analysis that finds them is in ``happens_before.py``, above this
module: a report asks its detector for a copy of its findings (:class:`Detecting`).
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
    "TORN_READ",
    "AuditReport",
    "Race",
]

LOST_UPDATE = "lost_update"
CONCURRENT_WRITE = "concurrent_write"
TORN_READ = "torn_read"
OBSERVED = "observed"
PREDICTED = "predicted"


# ---------------------------------------------------------------------- public records


@dataclasses.dataclass(frozen=True)
class Race:
    """One finding of :func:`audit`. Immutable.

    Attributes:
      kind: ``"lost_update"`` (a thread's read-then-write of the variable can be
        interleaved with another thread's write), ``"concurrent_write"`` (blind writes
        by different threads, unordered, last writer wins) or ``"torn_read"`` (a thread
        reads several variables that another thread writes as one update, and the reads
        can fall in the middle of it: values from before and after the update mixed).
      variable: The variable's name: its Keras ``path`` (``"sequential/dense/kernel"``,
        ``"adam/sequential_dense_kernel_momentum"``) when it is a Keras variable, else
        its TensorFlow name (``"counter:0"``). For ``torn_read``, the first of
        :attr:`variables`.
      threads: Names of every thread seen taking part, sorted.
      read_site: ``"file:line"`` of the read the write was based on (``lost_update``),
        else ``None``.
      write_sites: For ``lost_update``: the reading thread's own write first, then the
        other thread's write that can come in between. For ``concurrent_write``: the two
        writes, sorted. For ``torn_read``: the writes of the update, sorted. Each
        ``"file:line"``.
      evidence: ``"observed"`` if the conflicting operations were recorded in flight at
        the same time at least once, ``"predicted"`` if they are merely unordered.
      count: How many times the pattern matched (each new access is compared with the
        latest accesses of every other thread and site).
      contexts: Where the accesses ran: ``"eager"`` and/or ``"tf.function 'name'"``.
      variables: Every variable of the finding, sorted for ``torn_read`` (the variables
        read across the update); ``(variable,)`` for the other kinds.
      read_sites: The reads: ``(read_site,)`` for ``lost_update``, the reads of the
        view, sorted, for ``torn_read``, ``()`` for ``concurrent_write``.
      calls: The Keras calls the accesses came from (``"train_on_batch"``, ``"fit"``,
        ``"apply_gradients"``), sorted; ``()`` for accesses made by your own code.
      fix: What to change, in one sentence (see :func:`fix_for`).
    """

    kind: str
    variable: str
    threads: tuple[str, ...]
    read_site: str | None
    write_sites: tuple[str, ...]
    evidence: str
    count: int
    contexts: tuple[str, ...]
    variables: tuple[str, ...] = ()
    read_sites: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    fix: str = ""

    def __str__(self) -> str:
        names = ", ".join(repr(v) for v in (self.variables or (self.variable,)))
        title = {
            LOST_UPDATE: "lost update on",
            CONCURRENT_WRITE: "concurrent unlocked writes on",
            TORN_READ: "torn read of",
        }.get(self.kind, self.kind)
        shown = (_CALL_NAMES.get(c, c) for c in self.calls)
        via = f", from Keras {', '.join(shown)}" if self.calls else ""
        lines = [
            (
                f"{title} {names}: threads {', '.join(self.threads)} "
                f"({self.evidence}, matched {self.count}x, {', '.join(self.contexts)}{via})"
            )
        ]
        if self.kind == LOST_UPDATE:
            lines.append(_site_line("read ", self.read_site, "value read here"))
            lines.append(_site_line("write", self.write_sites[0], "written back here"))
            lines.append(
                _site_line("write", self.write_sites[1], "another thread can write in between")
            )
        elif self.kind == TORN_READ:
            for site in self.read_sites:
                lines.append(_site_line("read ", site, "read as one view"))
            for site in self.write_sites:
                lines.append(
                    _site_line("write", site, "another thread's update, can fall between")
                )
        else:
            for site in self.write_sites:
                lines.append(_site_line("write", site, ""))
        fix = self.fix or fix_for(self.kind, self.variables, self.calls)
        lines.append(f"    fix: {fix}")
        return "\n".join(lines)


# How a Keras call is shown (the others by their name).
_CALL_NAMES = {"__call__": "model(...)", "call": "model(...)"}
# Keras calls that run a whole train step, and those that apply an optimizer's update.
_TRAIN_CALLS = frozenset({"train_on_batch", "fit", "train_step", "train_function"})
_OPTIMIZER_CALLS = frozenset({"apply_gradients", "apply", "minimize", "update_step"})


def fix_for(kind: str, variables: tuple[str, ...], calls: tuple[str, ...]) -> str:
    """The fix a finding suggests, from its kind and the Keras calls behind it.

    Args:
      kind: The race kind.
      variables: The variables' names (shown in a torn read's fix).
      calls: The Keras calls the accesses came from (:attr:`Race.calls`).

    Returns:
      One sentence: ``safevars.scope()`` for Keras train steps, ``SafeOptimizer`` for an
      optimizer's ``apply_gradients``, ``safevars.snapshot``/``safevars.locked`` for a
      torn read of your own variables, ``SafeVariable.update``/``safevars.locked`` for a
      lost update.
    """
    train = bool(_TRAIN_CALLS.intersection(calls))
    optimizer = bool(_OPTIMIZER_CALLS.intersection(calls))
    if kind == TORN_READ:
        if train:
            return (
                "build the model and its optimizer inside `safevars.scope()`: each train "
                "step, forward pass included, is then one critical section; other readers "
                "take `safevars.snapshot(model)`"
            )
        if optimizer:
            return (
                "make the update one section with `safevars.SafeOptimizer(optimizer)`, and "
                "read the weights at one instant: `safevars.snapshot(model)` (or inside "
                "`with safevars.locked(model):`)"
            )
        shown = ", ".join(v.split(":")[0] for v in variables[:3]) or "a, b"
        return (
            f"read them together: `safevars.snapshot([{shown}])`, and write them in one "
            f"section: `with safevars.locked({shown}):` or `safevars.transaction`"
        )
    if train:
        return (
            "build the model and its optimizer inside `safevars.scope()` (each train step "
            "becomes one critical section), or make the calls under one lock"
        )
    if optimizer:
        return (
            "wrap the optimizer: `safevars.SafeOptimizer(optimizer)` makes each "
            "`apply_gradients` one critical section"
        )
    if kind == LOST_UPDATE:
        return (
            "make the read and the write one step: SafeVariable.update(fn), or both inside "
            "`with safevars.locked(v):`"
        )
    return (
        "hold the variable's lock for both writes (safevars.locked / a SafeVariable) or "
        "order them (join the writer first)"
    )


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
                "understands (safevars locks, threading and queue primitives, futures, "
                "Thread.start/join), so the interleaving can happen even if it did not in "
                "this run."
            )
        lines.extend(f"note: {n}" for n in notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<safevars.AuditReport races={len(self.races)} active={self.active}>"
