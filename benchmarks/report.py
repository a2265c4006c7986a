"""Writing the results: the stdout table, ``results.md`` and ``results.json``.

The stdout table fits :data:`TERMINAL_WIDTH` (120) columns: each case is a heading with
its variants indented below it, without the min and max columns, and a line that would
be longer wraps (notes under the notes column, other lines indented). ``results.md``
has every column, one row per variant.

Columns (``results.md``; the stdout table has all but min and max):

* **case / variant**: what was timed; the first variant of a case is the baseline.
* **median, min, max**: time per operation over the rounds (a call of a variant does
  ``ops_per_call`` operations; every round times a batch of calls).
* **ops/s**: operations per second at the median.
* **x baseline [95% CI]**: median over the baseline's median, same run (above 1 is
  slower), and its 95% confidence interval from the paired rounds (see
  :mod:`benchmarks.timing`).
* **notes**: extra figures of the last round (``lost_updates`` ...) and the case's goal
  with its verdict: met (the whole interval satisfies the bound), missed (none of it
  does) or inconclusive (the interval straddles the bound).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "TERMINAL_WIDTH",
    "format_interval",
    "format_ratio",
    "format_seconds",
    "goal_summary",
    "incomplete_note",
    "markdown",
    "method_note",
    "table_rows",
    "text_table",
    "write_atomically",
    "write_json",
    "write_markdown",
]

HEADER = ("case", "variant", "median", "min", "max", "ops/s", "x baseline [95% CI]", "notes")
#: The stdout table's columns: case headings, then their variants indented.
TEXT_HEADER = ("case / variant", "median", "ops/s", "x baseline [95% CI]", "notes")
#: No line of the stdout table is longer (``results.md`` has no limit).
TERMINAL_WIDTH = 120
#: Notes narrower than this go on lines of their own below their row.
MIN_NOTES_WIDTH = 30


def format_seconds(seconds: float | None) -> str:
    """``1.23 µs``, ``45.6 ms``... with three significant digits."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    return "n/a"  # pragma: no cover


def format_interval(interval: Any) -> str:
    """``[1.02, 1.09]``, or ``""`` without an interval."""
    if not interval:
        return ""
    low, high = interval
    return f"[{low:.2f}, {high:.2f}]"


def format_ratio(ratio: float | None, interval: Any, digits: int = 2, unit: str = "") -> str:
    """``1.05 [1.02, 1.09]`` (``1.05x [1.02, 1.09]`` with ``unit="x"``); ``n/a`` without
    a ratio, no brackets without an interval."""
    if ratio is None:
        return "n/a"
    return f"{ratio:.{digits}f}{unit} {format_interval(interval)}".rstrip()


def _bound(goal: dict[str, Any]) -> str:
    return f"{goal['operator']} {goal['bound']:.2f}x {goal['reference']}"


def _verdict(goal: dict[str, Any]) -> str:
    text = goal["verdict"]
    if text == "inconclusive" and goal["ratio"] is not None and goal["ratio_ci_95"] is None:
        text += " (too few rounds for an interval)"
    return text.upper() if text == "missed" else text


def format_rate(rate: float) -> str:
    """``12.3K``, ``4.56M``... operations per second."""
    for suffix, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.3g}{suffix}"
    return f"{rate:.3g}"


def _goal_note(goal: dict[str, Any], variant: str) -> str:
    if goal is None or goal["variant"] != variant:
        return ""
    if goal["ratio"] is None:
        return f"goal {_bound(goal)}: not measured"
    measured = format_ratio(goal["ratio"], goal["ratio_ci_95"], digits=3, unit="x")
    return f"goal {_bound(goal)}: {measured}, {_verdict(goal)}{_passes(goal)}"


def _passes(goal: dict[str, Any]) -> str:
    """`` (passes 1.21, 0.95)``: the ratio within each repetition of a pooled run; empty
    for a single run."""
    ratios = goal.get("ratio_per_repetition") or []
    if len(ratios) < 2:
        return ""
    return " (passes " + ", ".join("n/a" if r is None else f"{r:.2f}" for r in ratios) + ")"


def _extra_note(extra: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in extra.items())


def table_rows(family: dict[str, Any]) -> list[tuple[str, ...]]:
    """One row per (case, variant) of a family; a failed case is one row with its error."""
    rows: list[tuple[str, ...]] = []
    for case in family["cases"]:
        if case["status"] != "ok":
            rows.append((case["name"], "FAILED", "", "", "", "", "", case["error"] or ""))
            continue
        for v in case["variants"]:
            notes = "; ".join(
                n for n in (_extra_note(v["extra"]), _goal_note(case["goal"], v["name"])) if n
            )
            rows.append(
                (
                    case["name"],
                    v["name"],
                    format_seconds(v["per_op_median_s"]),
                    format_seconds(v["per_op_min_s"]),
                    format_seconds(v["per_op_max_s"]),
                    format_rate(v["ops_per_s"]),
                    "baseline"
                    if v["baseline"]
                    else format_ratio(v["ratio_to_baseline"], v["ratio_to_baseline_ci_95"]),
                    notes,
                )
            )
    return rows


def _family_title(family: dict[str, Any]) -> str:
    title = family["name"]
    if family["description"]:
        title += f": {family['description']}"
    if family["status"] != "ok":
        title += f"  [FAILED: {family['error']}]"
    return title


def _metadata_lines(document: dict[str, Any]) -> list[str]:
    m = document["metadata"]
    device = m["device"]
    commit = m["git_commit"][:12] + (" (dirty)" if m["git_dirty"] else "")
    settings = document["settings"]
    repeat = settings.get("repeat", 1)
    rounds = f"{settings['rounds']} rounds"
    if repeat > 1:
        rounds = f"{repeat} repetitions x {settings['rounds']} rounds, pooled"
    note = incomplete_note(document)
    resumed = document.get("resumed") or []
    return ([note] if note else []) + [
        f"device: {device['kind'].upper()} {device['name']} ({device['tf_device']})",
        (
            f"TensorFlow {m['tensorflow_version']}, Python {m['python_version']}, "
            f"{m['cpu_count']} CPUs, {m['platform']}"
        ),
        f"commit {commit}, {m['date_utc']}, {m['mode']} run ({rounds})",
        f"command: {m['command']}",
        *(f"resumed {r['date_utc']}: {r['command']}" for r in resumed),
    ]


def incomplete_note(document: dict[str, Any]) -> str:
    """``""`` for a complete run; else what it lacks and how to finish it."""
    if document.get("complete", True):
        return ""
    selected = document["settings"]["families_selected"]
    started = [f["name"] for f in document["families"]]
    how = (
        f"interrupted by {document['interrupted_by']}"
        if document.get("interrupted_by")
        else "still running, or stopped without a chance to say so"
    )
    cases = sum(len(f["cases"]) for f in document["families"])
    return (
        f"INCOMPLETE run ({how}): {cases} case(s) of {len(started)} of {len(selected)} "
        "families; finish it with python -m benchmarks --resume DIR"
    )


def _wrap(text: str, indent: str = "    ", width: int = TERMINAL_WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` columns, the continuations indented."""
    return textwrap.wrap(text, width, subsequent_indent=indent, break_on_hyphens=False) or [""]


def _family_lines(family: dict[str, Any]) -> list[str]:
    """One family's stdout table: each case a heading, its variants indented below."""
    rows = table_rows(family)
    cells = [(f"    {r[1]}", r[2], r[5], r[6]) for r in rows if r[1] != "FAILED"]
    widths = [max(len(c[i]) for c in [TEXT_HEADER[:4], *cells]) for i in range(4)]
    notes_at = sum(widths) + 2 * len(widths)
    notes_width = TERMINAL_WIDTH - notes_at

    def line(columns: tuple[str, ...], notes: str) -> list[str]:
        head = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
        if not notes:
            return _wrap(head.rstrip())
        if notes_width < MIN_NOTES_WIDTH:
            return _wrap(head.rstrip()) + _wrap("      " + notes, " " * 6)
        parts = textwrap.wrap(notes, notes_width, break_on_hyphens=False)
        return [head + "  " + parts[0]] + [" " * notes_at + p for p in parts[1:]]

    lines = line(TEXT_HEADER[:4], TEXT_HEADER[4])
    case = None
    for row in rows:
        if row[1] == "FAILED":
            lines += _wrap(f"  {row[0]}: FAILED: {row[-1]}", " " * 6)
            continue
        if row[0] != case:
            case = row[0]
            lines += _wrap(f"  {case}", " " * 4)
        lines += line((f"    {row[1]}", row[2], row[5], row[6]), row[7])
    return lines


def text_table(document: dict[str, Any]) -> str:
    """The plain-text results table printed on stdout, at most :data:`TERMINAL_WIDTH`
    columns wide (see the module docstring)."""
    lines = [part for line in _metadata_lines(document) for part in _wrap(line)]
    for family in document["families"]:
        lines += ["", *_wrap(_family_title(family)), *_family_lines(family)]
    lines.append("")
    for goal in _goal_lines(document["goals"]):
        lines += _wrap(goal)
    summary = goal_summary(document["goals"])
    if summary:
        lines.append(summary)
    lines += ["", *_wrap(method_note(document), "")]
    return "\n".join(lines).rstrip() + "\n"


def _goal_lines(goals: Iterable[dict[str, Any]]) -> list[str]:
    lines = []
    for g in goals:
        measured = (
            "not measured"
            if g["ratio"] is None
            else (
                f"{format_ratio(g['ratio'], g['ratio_ci_95'], digits=3, unit='x')}: "
                f"{_verdict(g)}{_passes(g)}"
            )
        )
        others = ", ".join(
            f"{format_ratio(r, g['versus_ci_95'].get(name), unit='x')} {name}"
            for name, r in g["versus"].items()
            if name != g["reference"]
        )
        lines.append(
            f"goal {g['family']}/{g['case']}: {g['variant']} over {g['reference']} "
            f"{g['operator']} {g['bound']:.2f}x: {measured}"
            + (f"; {g['variant']} = {others}" if others else "")
        )
    return lines


def goal_summary(goals: Iterable[dict[str, Any]]) -> str:
    """``goals: 2 met, 1 missed, 1 inconclusive`` (empty without goals)."""
    goals = list(goals)
    if not goals:
        return ""
    counts = {
        v: sum(1 for g in goals if g["verdict"] == v)
        for v in ("met", "missed", "inconclusive", "not measured")
    }
    return "goals: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n)


def method_note(document: dict[str, Any]) -> str:
    """How the ratios, their intervals and the verdicts were computed."""
    settings = document["settings"]
    ci = settings["confidence_interval"]
    repeat = settings.get("repeat", 1)
    pooled = (
        f" The {repeat} repetitions of the run were pooled: medians over all their rounds, "
        "intervals resampling the repetitions, then rounds within each."
        if repeat > 1
        else ""
    )
    return (
        "Times are per operation; x baseline is the median over the baseline's median in "
        "the same run (A/B interleaved, order rotated every round). Brackets: "
        f"{ci['level']:.0%} confidence interval of that ratio ({ci['method']}; none with "
        f'fewer than {ci["min_rounds"]} rounds).{pooled} A goal "<= x" is met when the '
        "interval's upper end is at or below x, missed when its lower end is above x, "
        'and inconclusive otherwise; a goal ">= x" is the mirror image.'
    )


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(document: dict[str, Any], plots: Iterable[str] = ()) -> str:
    """``results.md``: metadata, goals, one table per family, failures, plots."""
    out = ["# safevars benchmark results", ""]
    out += [f"- {line}" for line in _metadata_lines(document)]
    goals = _goal_lines(document["goals"])
    if goals:
        out += ["", "## Goals", "", goal_summary(document["goals"]), ""]
        out += [f"- {line}" for line in goals]
    for family in document["families"]:
        out += ["", f"## {_md_cell(_family_title(family))}", ""]
        out.append("| " + " | ".join(HEADER) + " |")
        out.append("|" + "|".join(["---"] * 2 + ["---:"] * 5 + ["---"]) + "|")
        for row in table_rows(family):
            out.append("| " + " | ".join(_md_cell(c) for c in row) + " |")
        if family["status"] != "ok" and family["traceback"]:
            out += ["", "```", family["traceback"].rstrip(), "```"]
    plots = list(plots)
    if plots:
        out += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    out += ["", method_note(document)]
    return "\n".join(out) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` in one step: a reader, or a run killed while
    writing, sees the old file or the new one, never a part.

    The text goes to a temporary file in the same directory, then is renamed over
    ``path`` (:func:`os.replace`, atomic on POSIX and Windows). Not synced to disk: a
    killed process loses nothing the kernel has, and a run writes after every case.
    """
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def write_json(document: dict[str, Any], path: Path, compact: bool = False) -> None:
    """Writes ``results.json`` (strict JSON: no NaN), atomically.

    ``compact``: without indentation (what a run writes after every case: Python's C
    encoder does not indent, so this is several times faster, and half the size; the
    last write of a run is indented).
    """
    if compact:
        text = json.dumps(document, allow_nan=False, separators=(",", ":"))
    else:
        text = json.dumps(document, indent=2, allow_nan=False)
    write_atomically(path, text + "\n")


def write_markdown(document: dict[str, Any], path: Path, plots: Iterable[str] = ()) -> None:
    """Writes ``results.md``, atomically."""
    write_atomically(path, markdown(document, plots))
