"""PNG plots of the results, with matplotlib's Agg backend (no display needed).

* ``overhead_<family>.png`` (:func:`overhead_figure`): one horizontal bar per ratio,
  grouped by case. Each case's bold heading names it and the one baseline its bars are
  measured against (``(1 = tf.Variable)``); each bar is a variant's median over that
  baseline's median, with its 95% confidence interval as whiskers. A case whose goal is
  taken against another variant (``goal_reference``) has one more bar, labelled
  ``<variant> / <reference>``: the goal's own ratio. Every goal is drawn as a dashed
  line across its bar at the bound, coloured by its verdict (met, missed, inconclusive,
  not measured); the line at 1 is the baseline.
* ``throughput_vs_threads.png`` (:func:`throughput_figure`): operations per second against
  the thread count, one line per variant, one panel per workload *that was run at two or
  more thread counts* (a case measured at one thread count only has no curve to draw), in
  a grid of at most :data:`MAX_COLUMNS` columns. When the variants report lost updates
  (``lost_updates`` and ``updates`` among their extra figures, as the ``contention``
  family does), a panel beside the throughput shows the share of updates each variant
  lost over all rounds, each bar labelled with it (0 for the safe variants): the racy
  baseline's throughput is bought with lost updates. Variants that lost some are dashed in
  the throughput panel.
* ``<family>_vs_<param>.png`` (:func:`against_figure`), for a family that declares
  ``PLOT_AGAINST = "<param>"`` (see :mod:`benchmarks.case`): each variant's ratio to the
  baseline against that numeric case parameter (for instance the number of variables),
  with its confidence interval, the goals' bounds as dashed lines, one panel per workload
  (the cases sharing every other parameter). Adding such a family needs no code here.

Every figure is made at the PNGs' resolution (:data:`DPI`), laid out by matplotlib's
constrained layout, and then grown until every text (tick labels, titles, axis labels,
legends) lies inside it (:func:`fit_to_text`), so long case and variant names are never
cut.

Without matplotlib the plots are skipped with a message; the run does not fail.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "MAX_COLUMNS",
    "VERDICT_COLORS",
    "against_figure",
    "fit_to_text",
    "overhead_figure",
    "throughput_figure",
    "write_plots",
]

MAX_COLUMNS = 3
PANEL_INCHES = (5.0, 3.6)
DPI = 110
#: Width of the bars' area of an overhead plot, and the height of one of its rows.
BARS_INCHES = 5.5
ROW_INCHES = 0.26
#: Goal lines by verdict: dark, and the bars pale (``BAR_ALPHA``), so a goal line stands
#: out from a bar of a similar hue.
VERDICT_COLORS = {
    "met": "#006d2c",
    "missed": "#a50f15",
    "inconclusive": "#7f3b08",
    "not measured": "#252525",
}
BAR_ALPHA = 0.55
#: A log scale when the largest ratio (or bound) is this many times the smallest.
LOG_SPAN = 20.0


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


def fit_to_text(fig: Any, attempts: int = 4) -> None:
    """Grows ``fig`` until the tight bounding box of everything drawn lies inside it.

    Constrained layout shrinks the axes to make room for tick labels, titles and legends,
    but cannot make room that the figure does not have: a label longer than the figure
    is wide was cut. This lays the figure out, measures by how much its drawn artists
    overflow each side, grows it by that much, and lays it out again.
    """
    for _ in range(attempts):
        fig.draw_without_rendering()  # lays it out; no pixels (savefig renders once)
        tight = fig.get_tightbbox(fig.canvas.get_renderer())  # inches
        width, height = fig.get_size_inches()
        grow_x = max(0.0, -tight.x0) + max(0.0, tight.x1 - width)
        grow_y = max(0.0, -tight.y0) + max(0.0, tight.y1 - height)
        if grow_x <= 0.01 and grow_y <= 0.01:
            return
        fig.set_size_inches(width + grow_x + 0.1, height + grow_y + 0.1)


# --------------------------------------------------------------------------- overhead


@dataclasses.dataclass(frozen=True)
class _Row:
    """One row of an overhead plot: a case heading (``ratio`` None) or a bar."""

    label: str
    ratio: float | None = None
    interval: tuple[float, float] | None = None
    color: str | None = None
    hatch: str | None = None
    goal: dict[str, Any] | None = None

    @property
    def heading(self) -> bool:
        return self.color is None


def _palette(plt: Any) -> Callable[[str], str]:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names: dict[str, str] = {}
    return lambda name: names.setdefault(name, colors[len(names) % len(colors)])


def _interval(value: Any) -> tuple[float, float] | None:
    return None if not value else (float(value[0]), float(value[1]))


def overhead_rows(family: dict[str, Any], color: Callable[[str], str]) -> list[_Row]:
    """The rows of ``overhead_<family>.png``: per measured case, its heading (the case
    and its baseline), then one bar per other variant over that baseline, and the goal's
    own ratio when the goal is taken against another variant."""
    rows: list[_Row] = []
    for case in family["cases"]:
        if case["status"] != "ok":
            continue
        bars = [v for v in case["variants"] if not v["baseline"] and v["ratio_to_baseline"]]
        goal = case.get("goal")
        if not bars and goal is None:
            continue
        rows.append(_Row(f"{case['name']}  (1 = {case['baseline']})"))
        on_baseline = goal is not None and goal["reference"] == case["baseline"]
        for v in bars:
            rows.append(
                _Row(
                    v["name"],
                    v["ratio_to_baseline"],
                    _interval(v["ratio_to_baseline_ci_95"]),
                    color(v["name"]),
                    goal=goal if on_baseline and goal["variant"] == v["name"] else None,
                )
            )
        if goal is not None and not on_baseline:
            rows.append(
                _Row(
                    f"{goal['variant']} / {goal['reference']}",
                    goal["ratio"],
                    _interval(goal["ratio_ci_95"]),
                    color(goal["variant"]),
                    hatch="//",
                    goal=goal,
                )
            )
    return rows


def overhead_figure(plt: Any, family: dict[str, Any]) -> Any | None:
    """The figure of ``overhead_<family>.png`` (None when the family has no ratio)."""
    rows = overhead_rows(family, _palette(plt))
    bars = [(i, r) for i, r in enumerate(rows) if not r.heading and r.ratio is not None]
    if not bars:
        return None
    label_inches = 0.075 * max(len(r.label) for r in rows)  # a first guess; fit_to_text
    fig, ax = plt.subplots(
        figsize=(label_inches + BARS_INCHES + 0.6, ROW_INCHES * len(rows) + 2.0),
        layout="constrained",
        dpi=DPI,
    )
    y = {i: len(rows) - 1 - i for i in range(len(rows))}  # first row at the top
    for i, row in bars:
        ratio = float(row.ratio or 0.0)
        ax.barh(
            y[i],
            ratio,
            height=0.7,
            color=row.color,
            alpha=BAR_ALPHA,
            hatch=row.hatch,
            edgecolor="white",
        )
        if row.interval is not None:
            low, high = row.interval
            ax.errorbar(
                ratio,
                y[i],
                xerr=[[max(ratio - low, 0.0)], [max(high - ratio, 0.0)]],
                fmt="none",
                ecolor="black",
                elinewidth=0.8,
                capsize=2,
            )
    verdicts = []
    for i, row in enumerate(rows):
        if row.goal is not None:
            verdicts.append(row.goal["verdict"])
            color = VERDICT_COLORS.get(row.goal["verdict"], "black")
            ax.vlines(row.goal["bound"], y[i] - 0.45, y[i] + 0.45, colors=color, linewidth=2)
        if row.heading and i:
            ax.axhline(y[i] + 0.5, color="0.85", linewidth=0.6)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks([y[i] for i in range(len(rows))], [r.label for r in rows], fontsize=7)
    for label, row in zip(ax.get_yticklabels(), rows):
        if row.heading:
            label.set_fontweight("bold")
    ax.set_ylim(-0.7, len(rows) - 0.3)
    values = [float(r.ratio or 0.0) for _, r in bars] + [r.goal["bound"] for r in rows if r.goal]
    if max(values) / max(min(values), 1e-12) > LOG_SPAN:
        ax.set_xscale("log")
    ax.set_xlabel("median time / the baseline's median (1 = baseline); whiskers: 95% CI")
    ax.set_title(f"{family['name']}: overhead per case")
    line = importlib.import_module("matplotlib.lines").Line2D
    handles = [line([], [], color="black", linewidth=1, label="baseline (1)")]
    handles += [
        line([], [], color=VERDICT_COLORS[v], linewidth=2, label=f"goal bound, {v}")
        for v in VERDICT_COLORS
        if v in verdicts
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=7)
    fit_to_text(fig)
    return fig


# --------------------------------------------------------------------------- threads


def _workload(family: dict[str, Any], case: dict[str, Any], param: str) -> str:
    """The family and every case parameter but ``param``: the cases of one curve."""
    rest = {k: v for k, v in case["params"].items() if k != param}
    details = ", ".join(f"{k}={v}" for k, v in sorted(rest.items()))
    return family["name"] + (f" ({details})" if details else "")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _panel_grid(plt: Any, panels: int, columns: int) -> tuple[Any, list[Any]]:
    """A figure of ``panels`` panels, ``columns`` to a row, and its axes in order."""
    rows = -(-panels // columns)
    fig, axes = plt.subplots(
        rows,
        columns,
        squeeze=False,
        figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows),
        layout="constrained",
        dpi=DPI,
    )
    return fig, [ax for row in axes for ax in row]


def _by_parameter(
    families: Iterable[dict[str, Any]], param: str
) -> dict[str, list[tuple[float, dict[str, Any]]]]:
    """Workload -> [(param value, case)], for workloads run at 2+ values of ``param``."""
    groups: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
    for family in families:
        for case in family["cases"]:
            value = case["params"].get(param)
            if case["status"] == "ok" and _number(value):
                groups[_workload(family, case, param)].append((value, case))
    return {
        key: sorted(points, key=lambda p: p[0])
        for key, points in groups.items()
        if len({value for value, _ in points}) >= 2
    }


def _lost_share(cases: list[tuple[float, dict[str, Any]]]) -> dict[str, list[tuple[float, float]]]:
    """Variant -> [(threads, lost updates / updates over all rounds)], or {} when the
    variants report no lost updates."""
    shares: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for threads, case in cases:
        for v in case["variants"]:
            rounds = [e for e in v.get("extra_rounds", []) if "lost_updates" in e]
            updates = sum(e.get("updates", 0) for e in rounds)
            if rounds and updates:
                lost = sum(e["lost_updates"] for e in rounds)
                shares[v["name"]].append((threads, lost / updates))
    return dict(shares)


def _throughput_panel(ax: Any, key: str, cases: list, lost: dict, color: Callable) -> None:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for threads, case in cases:
        for v in case["variants"]:
            series[v["name"]].append((threads, v["ops_per_s"]))
    for name, points in series.items():
        lossy = any(share > 0 for _, share in lost.get(name, []))
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            linestyle="--" if lossy else "-",
            color=color(name),
            label=f"{name} (loses updates)" if lossy else name,
        )
    ax.set_xscale("log", base=2)
    counts = sorted({threads for threads, _ in cases})
    ax.set_xticks(counts, [f"{t:g}" for t in counts])
    ax.minorticks_off()
    ax.set_xlabel("threads")
    ax.set_ylabel("operations / s (median)")
    ax.set_title(key, fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)


def _lost_panel(ax: Any, key: str, lost: dict, color: Callable) -> None:
    threads = sorted({t for points in lost.values() for t, _ in points})
    width = 0.8 / max(len(lost), 1)
    for index, (name, points) in enumerate(lost.items()):
        share = dict(points)
        xs = [i + (index - (len(lost) - 1) / 2) * width for i in range(len(threads))]
        heights = [100 * share.get(t, 0.0) for t in threads]
        bars = ax.bar(xs, heights, width=width, color=color(name), alpha=BAR_ALPHA, label=name)
        ax.bar_label(bars, labels=[f"{h:.2g}%" if h else "0" for h in heights], fontsize=6)
    ax.set_xticks(range(len(threads)), [f"{t:g}" for t in threads])
    ax.set_ylim(0, max([1.0] + [100 * s for p in lost.values() for _, s in p]) * 1.25)
    ax.set_xlabel("threads")
    ax.set_ylabel("updates lost (% of all rounds' updates)")
    ax.set_title(f"{key}: lost updates", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)


def throughput_figure(plt: Any, families: list[dict[str, Any]]) -> Any | None:
    """The figure of ``throughput_vs_threads.png`` (None when nothing varies with threads).

    One throughput panel per workload run at two or more thread counts, followed by its
    lost-updates panel when its variants report lost updates. ``MAX_COLUMNS`` panels per
    row, or two when there are lost-updates panels (each throughput beside its losses);
    the figure has exactly one axes per panel.
    """
    groups = _by_parameter(families, "threads")
    if not groups:
        return None
    color = _palette(plt)
    panels: list[tuple[str, str, Any]] = []
    for key, cases in sorted(groups.items()):
        lost = _lost_share(cases)
        panels.append(("throughput", key, (cases, lost)))
        if lost:
            panels.append(("lost", key, lost))
    paired = any(kind == "lost" for kind, _, _ in panels)
    columns = 2 if paired else min(MAX_COLUMNS, len(panels))
    fig, cells = _panel_grid(plt, len(panels), columns)
    for ax, (kind, key, data) in zip(cells, panels):
        if kind == "throughput":
            _throughput_panel(ax, key, data[0], data[1], color)
        else:
            _lost_panel(ax, key, data, color)
    for ax in cells[len(panels) :]:
        fig.delaxes(ax)
    fit_to_text(fig)
    return fig


# --------------------------------------------------------------------------- against


def against_figure(plt: Any, family: dict[str, Any], param: str) -> Any | None:
    """The figure of ``<family>_vs_<param>.png``: ratios against a numeric parameter.

    One panel per workload (the family's cases that share every parameter but
    ``param``) run at two or more values of ``param``; in each, one line per variant: its
    median over the baseline's, with the 95% interval as error bars. A goal taken
    against the baseline is a dashed line at its bound, coloured by the worst verdict
    among its cases; a goal against another variant adds that ratio as a dotted line,
    ``<variant> / <reference>``, with its own bound. None when no workload varies.
    """
    groups = _by_parameter([family], param)
    if not groups:
        return None
    color = _palette(plt)
    columns = min(MAX_COLUMNS, len(groups))
    fig, cells = _panel_grid(plt, len(groups), columns)
    for ax, (key, cases) in zip(cells, sorted(groups.items())):
        series: dict[tuple[str, str], list[tuple[float, float, Any]]] = defaultdict(list)
        bounds: dict[tuple[str, str, str, float], list[str]] = defaultdict(list)
        baseline = cases[0][1]["baseline"]
        for value, case in cases:
            for v in case["variants"]:
                if not v["baseline"] and v["ratio_to_baseline"] is not None:
                    series[(v["name"], "")].append(
                        (value, v["ratio_to_baseline"], _interval(v["ratio_to_baseline_ci_95"]))
                    )
            goal = case.get("goal")
            if goal is not None:
                against = "" if goal["reference"] == case["baseline"] else goal["reference"]
                if against and goal["ratio"] is not None:
                    series[(goal["variant"], against)].append(
                        (value, goal["ratio"], _interval(goal["ratio_ci_95"]))
                    )
                bounds[(goal["variant"], against, goal["operator"], goal["bound"])].append(
                    goal["verdict"]
                )
        for (name, against), points in series.items():
            low = [max(r - ci[0], 0.0) if ci else 0.0 for _, r, ci in points]
            high = [max(ci[1] - r, 0.0) if ci else 0.0 for _, r, ci in points]
            ax.errorbar(
                [p[0] for p in points],
                [p[1] for p in points],
                yerr=[low, high],
                marker="o",
                capsize=2,
                linestyle=":" if against else "-",
                color=color(name),
                label=f"{name} / {against}" if against else name,
            )
        for (name, against, operator, bound), verdicts in bounds.items():
            worst = next(
                (v for v in ("missed", "inconclusive", "not measured") if v in verdicts), "met"
            )
            ax.axhline(
                bound,
                color=VERDICT_COLORS[worst],
                linestyle="--",
                linewidth=1.2,
                label=f"goal {name}{' / ' + against if against else ''} {operator} {bound:g} ({worst})",
            )
        ax.axhline(1.0, color="black", linewidth=1)
        values = [value for value, _ in cases]
        if max(values) / max(min(values), 1e-12) >= 10:
            ax.set_xscale("log")
        ax.set_xticks(sorted(set(values)), [f"{v:g}" for v in sorted(set(values))])
        ax.minorticks_off()
        ax.set_xlabel(param)
        ax.set_ylabel(f"median time / {baseline} median")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    for ax in cells[len(groups) :]:
        fig.delaxes(ax)
    fit_to_text(fig)
    return fig


# --------------------------------------------------------------------------- files


def _save(plt: Any, fig: Any | None, path: Path) -> bool:
    if fig is None:
        return False
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def _throughput(plt: Any, families: list[dict[str, Any]], path: Path) -> bool:
    return _save(plt, throughput_figure(plt, families), path)


def write_plots(document: dict[str, Any], out: Path, progress: TextIO) -> list[Path]:
    """Writes the PNGs into ``out`` and returns their paths (none without matplotlib)."""
    plt = _pyplot(progress)
    if plt is None:
        return []
    written = []
    for family in document["families"]:
        path = out / f"overhead_{family['name']}.png"
        if _save(plt, overhead_figure(plt, family), path):
            written.append(path)
        param = family.get("plot_against")
        if param:
            path = out / f"{family['name']}_vs_{param}.png"
            if _save(plt, against_figure(plt, family, param), path):
                written.append(path)
    path = out / "throughput_vs_threads.png"
    if _throughput(plt, document["families"], path):
        written.append(path)
    return written
