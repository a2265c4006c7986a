"""PNG plots of the results, with matplotlib's Agg backend (no display needed).

* ``overhead_<family>.png``: per case, each variant's median ratio to the baseline
  (horizontal bars; the line at 1 is the baseline), one file per family.
* ``throughput_vs_threads.png``: for cases parametrized by ``threads``, operations per
  second against the thread count, one line per variant, one panel per workload.

Without matplotlib the plots are skipped with a message; the run does not fail.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

__all__ = ["write_plots"]


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
    labels, ratios, colors = [], [], []
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
    if not ratios:
        return False
    height = max(2.5, 0.28 * len(ratios) + 1.2)
    fig, ax = plt.subplots(figsize=(9, height))
    positions = range(len(ratios))[::-1]
    ax.barh(list(positions), ratios, color=colors)
    ax.set_yticks(list(positions), labels, fontsize=7)
    ax.axvline(1.0, color="black", linewidth=1)
    if max(ratios) / max(min(ratios), 1e-12) > 20:
        ax.set_xscale("log")
    baselines = sorted({c["baseline"] for c in family["cases"] if c["baseline"]})
    ax.set_xlabel(f"median time / baseline median ({', '.join(baselines)} = 1)")
    ax.set_title(f"{family['name']}: overhead ratio per case")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _throughput(plt: Any, families: list[dict[str, Any]], path: Path) -> bool:
    groups: dict[str, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    for family in families:
        for case in family["cases"]:
            threads = case["params"].get("threads")
            if case["status"] != "ok" or not isinstance(threads, int):
                continue
            rest = {k: v for k, v in case["params"].items() if k != "threads"}
            details = ", ".join(f"{k}={v}" for k, v in sorted(rest.items()))
            key = family["name"] + (f" ({details})" if details else "")
            for v in case["variants"]:
                groups[key][v["name"]].append((threads, v["ops_per_s"]))
    if not groups:
        return False
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.2), squeeze=False)
    for ax, (key, variants) in zip(axes[0], sorted(groups.items())):
        for name, points in variants.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("threads")
        ax.set_ylabel("operations / s (median)")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
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
