"""MkDocs hook: the benchmark results page, generated from the committed run.

``docs/results/`` holds the output of one run of ``python -m benchmarks --out
docs/results``: ``results.json`` (every figure and the run's metadata), ``results.md``
and the PNG plots. A page with the line ``<!-- benchmark-results -->`` gets, in its
place: the run's metadata (device, TensorFlow, commit, date, command), a table of every
goal with its ratio, interval and verdict, one table per family (the columns of
``results.md``, from :func:`benchmarks.report.table_rows`) with that family's plots, the
thread plot and the method. A ``--quick`` run is labelled as a smoke run, not results.

The build fails (``mkdocs build --strict`` included) when ``results.json`` is missing or
unreadable, or when ``docs/results/`` holds a plot that belongs to no family of the run
(a leftover of an earlier run: clear the directory before writing a new run into it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

MARKER = "<!-- benchmark-results -->"
#: The run's directory, relative to docs/.
RESULTS = "results"
_THREADS_PLOT = "throughput_vs_threads.png"
#: The columns of ``results.md`` a family's table shows: case, variant, median, ops/s,
#: x baseline [95% CI], notes (min and max stay in results.json and results.md).
COLUMNS = (0, 1, 2, 5, 6, 7)


def _report(root: Path) -> Any:
    """``benchmarks.report`` (no TensorFlow import), from this repository."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import report

    return report


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def plots_by_family(document: dict[str, Any], plots: list[str]) -> dict[str, list[str]]:
    """Each family's plots (``overhead_<name>.png``, ``<name>_vs_<param>.png``); the
    thread plot under ``""``.

    Raises:
      ValueError: a plot that belongs to no family of ``document``.
    """
    names = [f["name"] for f in document["families"]]
    found: dict[str, list[str]] = {name: [] for name in ["", *names]}
    for plot in sorted(plots):
        owner = next(
            (
                n
                for n in names
                if plot == f"overhead_{n}.png"
                or (plot.startswith(f"{n}_vs_") and plot.endswith(".png"))
            ),
            "" if plot == _THREADS_PLOT else None,
        )
        if owner is None:
            raise ValueError(
                f"docs/{RESULTS}/{plot} belongs to no family of the run in results.json "
                f"({', '.join(names)}): a leftover of another run? Clear docs/{RESULTS}/ "
                f"before writing a run into it (rm -rf docs/{RESULTS} && python -m "
                f"benchmarks --out docs/{RESULTS})."
            )
        found[owner].append(plot)
    return found


def render(document: dict[str, Any], plots: list[str], report: Any, base: str = RESULTS) -> str:
    """The Markdown of the results page for ``document`` (a parsed ``results.json``)."""
    meta, settings = document["metadata"], document["settings"]
    by_family = plots_by_family(document, plots)
    out: list[str] = ['<div class="benchmark-results" markdown>', ""]
    if meta.get("mode") == "quick":
        out += [
            '!!! warning "A `--quick` smoke run, not results"',
            "",
            "    These figures come from `python -m benchmarks --quick`: 7 short rounds, for",
            "    checking that the suite and this page work. Their intervals are wide and their",
            "    verdicts mean nothing. The full run replaces them (see the",
            "    [Benchmarks guide](guide/benchmarks.md#the-results-on-this-site)).",
            "",
        ]
    device = meta["device"]
    repeat = settings.get("repeat", 1)
    rounds = f"{settings['rounds']} rounds" + (f" x {repeat} passes, pooled" if repeat > 1 else "")
    commit = f"`{meta['git_commit'][:12]}`" + (
        " (uncommitted changes)" if meta.get("git_dirty") else ""
    )
    out += [
        "## The run",
        "",
        f"- **Device**: {device['kind'].upper()} {device['name']} (`{device['tf_device']}`)",
        (
            f"- **TensorFlow** {meta['tensorflow_version']}, **Python** {meta['python_version']}, "
            f"**NumPy** {meta['numpy_version']}"
        ),
        f"- **CPUs**: {meta['cpu_count']}; **platform**: {meta['platform']}",
        f"- **safevars** {meta.get('safevars_version', '?')}, commit {commit}",
        f"- **Date** (UTC): {meta['date_utc']}",
        f"- **Mode**: {meta['mode']}, {rounds}; **status**: {document.get('status', '?')}",
        f"- **Command**: `{meta['command']}`",
        "",
        (
            f"Every figure of the run: [`results.json`]({base}/results.json) (schema version "
            f"{document.get('schema_version', '?')}, `python -m benchmarks --schema`)."
        ),
        "",
    ]
    goals = document.get("goals", [])
    if goals:
        out += [
            "## Goals",
            "",
            report.goal_summary(goals) + ".",
            "",
            "| case | variant / reference | goal | ratio [95% CI] | verdict | passes |",
            "|---|---|---|---:|---|---|",
        ]
        for g in goals:
            ratio = (
                "not measured"
                if g["ratio"] is None
                else report.format_ratio(g["ratio"], g["ratio_ci_95"], digits=3, unit="x")
            )
            passes = ", ".join(f"{r:.2f}" for r in g.get("ratio_per_repetition") or [])
            out.append(
                f"| {g['family']}/{_cell(g['case'])} | {_cell(g['variant'])} / "
                f"{_cell(g['reference'])} | {g['operator']} {g['bound']:.2f}x | {ratio} | "
                f"**{g['verdict']}** | {passes} |"
            )
        out.append("")
    for family in document["families"]:
        out += [f"## {family['name']}", ""]
        if family["description"]:
            out += [f"{family['description']}.", ""]
        if family["status"] != "ok":
            out += [f"**Failed**: {_cell(family['error'])}", ""]
        rows = report.table_rows(family)
        if rows:
            out.append("| " + " | ".join(report.HEADER[i] for i in COLUMNS) + " |")
            out.append("|---|---|---:|---:|---:|---|")
            out += ["| " + " | ".join(_cell(row[i]) for i in COLUMNS) + " |" for row in rows]
            out.append("")
        for plot in by_family[family["name"]]:
            out += [f"![{plot}]({base}/{plot})", ""]
    if by_family[""]:
        out += ["## Throughput against threads", ""]
        out += [f"![{plot}]({base}/{plot})" for plot in by_family[""]] + [""]
    out += ["## Method", "", report.method_note(document), "", "</div>", ""]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replaces the marker line with the page generated from ``docs/results/``."""
    if MARKER not in markdown:
        return markdown
    directory = Path(config["docs_dir"]) / RESULTS
    try:
        document = json.loads((directory / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PluginError(
            f"{page.file.src_uri}: cannot read docs/{RESULTS}/results.json ({e}). Write a "
            f"run there: python -m benchmarks --out docs/{RESULTS}"
        ) from None
    plots = [p.name for p in directory.glob("*.png")]
    root = Path(config["config_file_path"]).resolve().parent
    try:
        generated = render(document, plots, _report(root))
    except ValueError as e:
        raise PluginError(f"{page.file.src_uri}: {e}") from None
    return markdown.replace(MARKER, generated)
