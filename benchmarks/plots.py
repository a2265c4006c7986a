"""PNG plots of the results, with matplotlib's Agg backend (no display needed).

* ``overhead_<family>.png``: per case, each variant's median ratio to the baseline
  (horizontal bars with the 95% confidence interval as error bars; the line at 1 is the
  baseline), one file per family.
* ``throughput_vs_threads.png``: operations per second against the thread count, one
  line per variant, one panel per workload *that was run at two or more thread counts*
  (a case measured at one thread count only, such as ``"threads": 1``, has no curve to
  draw), in a grid of at most :data:`MAX_COLUMNS` columns.

Without matplotlib the plots are skipped with a message; the run does not fail.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MAX_COLUMNS", "throughput_figure", "write_plots"]

MAX_COLUMNS = 3
PANEL_INCHES = (5.0, 3.6)
DPI = 110


def _pyplot(progress: TextIO) -> Any | None:
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg", force=True)
        return importlib.import_module("matplotlib.pyplot")
    except ImportError as e:
        print(
            f"matplotlib is not available ({e}): skipping the PNG plots. Install it with "
            "pip install matplotlib (or pip install 'safevars[bench]').",
            file=progress,
            flush=True,
        )
        return None


def _overhead(plt: Any, family: dict[str, Any], path: Path) -> bool:
    labels, ratios, colors, low, high = [], [], [], [], []
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names: dict[str, str] = {}
    for case in family["cases"]:
        if case["status"] != "ok":
            continue
        for v in case["variants"]:
            if v["baseline"] or v["ratio_to_baseline"] is None:
                continue
            color = names.setdefault(v["name"], palette[len(names) % len(palette)])
            labels.append(f"{case['name']} · {v['name']}")
            ratios.append(v["ratio_to_baseline"])
            colors.append(color)
            interval = v.get("ratio_to_baseline_ci_95") or [ratios[-1], ratios[-1]]
            low.append(max(ratios[-1] - interval[0], 0.0))
            high.append(max(interval[1] - ratios[-1], 0.0))
    if not ratios:
        return False
    height = max(2.5, 0.28 * len(ratios) + 1.2)
    fig, ax = plt.subplots(figsize=(9, height))
    positions = range(len(ratios))[::-1]
    ax.barh(
        list(positions),
        ratios,
        color=colors,
        xerr=[low, high],
        error_kw={"elinewidth": 0.8, "capsize": 2, "ecolor": "black"},
    )
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    if max(ratios) / max(min(ratios), 1e-12) > 20:
        ax.set_xscale("log")
    baselines = sorted({c["baseline"] for c in family["cases"] if c["baseline"]})
    ax.set_xlabel(f"median time / baseline median ({', '.join(baselines)} = 1), 95% CI")
    ax.set_title(f"{family['name']}: overhead ratio per case")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _thread_groups(families: list[dict[str, Any]]) -> dict[str, dict[str, list]]:
    """Workload -> variant -> [(threads, ops/s)], for workloads run at 2+ thread counts."""
    groups: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for family in families:
        for case in family["cases"]:
            threads = case["params"].get("threads")
            if case["status"] != "ok" or isinstance(threads, bool) or not isinstance(threads, int):
                continue
            rest = {k: v for k, v in case["params"].items() if k != "threads"}
            details = ", ".join(f"{k}={v}" for k, v in sorted(rest.items()))
            key = family["name"] + (f" ({details})" if details else "")
            for v in case["variants"]:
                groups[key][v["name"]].append((threads, v["ops_per_s"]))
    return {
        key: variants
        for key, variants in groups.items()
        if len({t for points in variants.values() for t, _ in points}) >= 2
    }


def throughput_figure(plt: Any, families: list[dict[str, Any]]) -> Any | None:
    """The figure of ``throughput_vs_threads.png`` (None when nothing varies with threads).

    One panel per workload run at two or more thread counts, ``MAX_COLUMNS`` panels per
    row; the figure has exactly one axes per panel.
    """
    groups = _thread_groups(families)
    if not groups:
        return None
    columns = min(MAX_COLUMNS, len(groups))
    rows = -(-len(groups) // columns)
    fig, axes = plt.subplots(
        rows,
        columns,
        squeeze=False,
        figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows),
    )
    cells = [ax for row in axes for ax in row]
    for ax, (key, variants) in zip(cells, sorted(groups.items())):
        for name, points in variants.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads")
        ax.set_ylabel("operations / s (median)")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    for ax in cells[len(groups) :]:
        fig.delaxes(ax)
    fig.tight_layout()
    return fig


def _throughput(plt: Any, families: list[dict[str, Any]], path: Path) -> bool:
    fig = throughput_figure(plt, families)
    if fig is None:
        return False
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def write_plots(document: dict[str, Any], out: Path, progress: TextIO) -> list[Path]:
    """Writes the PNGs into ``out`` and returns their paths (none without matplotlib)."""
    plt = _pyplot(progress)
    if plt is None:
        return []
    written = []
    for family in document["families"]:
        path = out / f"overhead_{family['name']}.png"
        if _overhead(plt, family, path):
            written.append(path)
    path = out / "throughput_vs_threads.png"
    if _throughput(plt, document["families"], path):
        written.append(path)
    return written
