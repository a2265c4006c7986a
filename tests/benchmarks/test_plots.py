"""The PNG plots (:mod:`benchmarks.plots`).

The figures are built from synthetic results (no timing) with the names that were cut
before issue 38: the accumulator's long case and variant names, the rng family's two
baselines, the contention family's lost updates. :func:`clipped_texts` is the check that
no text is cut: every drawn text's extent against the figure's.
"""

from __future__ import annotations

import io
import sys
from typing import Any

import matplotlib.text
import pytest

from benchmarks import plots
from tests.support.benchmark_fakes import family_result, png_size, rounds, thread_family

ACCUMULATOR_VARIANTS = (
    "keras gradient_accumulation_steps",
    "GradientAccumulator",
    "GradientAccumulator(add, take)",
    "GradientAccumulator(max_pending=None)",
    "GradientAccumulator(deterministic=False)",
    "keras gradient_accumulation_steps + one tf mutex",
)


@pytest.fixture(scope="module")
def plt():
    pyplot = plots._pyplot(io.StringIO())
    yield pyplot
    pyplot.close("all")


#: The figures several tests look at, each built once per module (building and laying
#: out a figure is most of a plot test's time). Tests only read them.
FIGURES = {
    "overhead_accumulator": lambda plt: plots.overhead_figure(plt, accumulator_family()),
    "overhead_rng": lambda plt: plots.overhead_figure(plt, rng_family()),
    "overhead_contention": lambda plt: plots.overhead_figure(plt, contention_family()),
    "threads": lambda plt: plots.throughput_figure(plt, [contention_family()]),
    "against": lambda plt: plots.against_figure(plt, scope_family(), "variables"),
}


@pytest.fixture(scope="module")
def figure(plt):
    """``figure(name)``: the figure of :data:`FIGURES` called ``name``."""
    made: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in made:
            made[name] = FIGURES[name](plt)
        return made[name]

    yield get
    for fig in made.values():
        plt.close(fig)


def drawn_texts(fig: Any) -> list[Any]:
    """The texts of ``fig`` that a draw shows: visible, not empty, and for tick labels
    only those of ticks inside the axis' view (the others are kept but not drawn)."""
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            slack = 1e-9 * (high - low)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - slack <= tick.get_loc() <= high + slack:
                    hidden.update({id(tick.label1), id(tick.label2)})
    return [
        text
        for text in fig.findobj(matplotlib.text.Text)
        if text.get_visible() and text.get_text().strip() and id(text) not in hidden
    ]


def clipped_texts(fig: Any) -> list[str]:
    """Every drawn text of ``fig`` that extends beyond the figure (empty: nothing cut),
    drawn at the PNGs' resolution (text does not scale exactly with it: at 110 dpi a
    label that fitted at 100 was cut)."""
    fig.set_dpi(plots.DPI)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    clipped = []
    for text in drawn_texts(fig):
        extent = text.get_window_extent(renderer)
        if (
            extent.x0 < box.x0 - 0.5
            or extent.x1 > box.x1 + 0.5
            or extent.y0 < box.y0 - 0.5
            or extent.y1 > box.y1 + 0.5
        ):
            clipped.append(f"{text.get_text()!r} {tuple(round(v) for v in extent.extents)}")
    return clipped


def accumulator_family() -> dict[str, Any]:
    ratios = (1.0, 1.13, 1.25, 1.2, 0.99, 1.06)
    return family_result(
        "accumulator",
        [
            {
                "name": f"micro_steps/mlp2x{width}/b32/k4",
                "variants": {v: rounds(r) for v, r in zip(ACCUMULATOR_VARIANTS, ratios)},
                "goal": ("GradientAccumulator", 1.10),
            }
            for width in (128, 1024)
        ],
    )


def rng_family() -> dict[str, Any]:
    cases = []
    for mode, ratio in (("eager", 0.5), ("graph", 1.3)):
        for name, baseline in (
            ("normal", "tf.random.Generator.normal"),
            ("normal_vs_stateless", "tf.random.stateless_normal"),
        ):
            cases.append(
                {
                    "name": f"{name}/{mode}/1M",
                    "variants": {baseline: rounds(1.0), "ReplicaRNG.normal": rounds(ratio)},
                    "goal": ("ReplicaRNG.normal", 1.05),
                }
            )
    return family_result("rng", cases)


def contention_family() -> dict[str, Any]:
    def variant(ratio: float, lost: int, threads: int) -> tuple[list[float], list[dict]]:
        extra = [{"lost_updates": lost if i % 2 else 0, "updates": 25 * threads} for i in range(7)]
        return rounds(ratio), extra

    return family_result(
        "contention",
        [
            {
                "name": f"read-modify-write/{threads} threads",
                "variants": {
                    "tf.Variable (racy)": variant(1.0, 5 * (threads - 1), threads),
                    "SafeVariable.update": variant(1.1, 0, threads),
                    "safevars.locked": variant(1.8, 0, threads),
                },
                "params": {"threads": threads, "iterations": 25},
            }
            for threads in (1, 2, 4, 8)
        ],
    )


def scope_family() -> dict[str, Any]:
    """A family declaring ``plot_against``: ratios against the number of variables."""
    return family_result(
        "scope",
        [
            {
                "name": f"train/{way}/{n} variables",
                "variants": {"plain": rounds(1.0), "in safevars.scope()": rounds(1 + n / 1000)},
                "goal": ("in safevars.scope()", 1.25),
                "params": {"variables": n, "way": way},
            }
            for way in ("fit", "custom loop")
            for n in (20, 200, 400)
        ],
        plot_against="variables",
    )


def test_throughput_plot_draws_only_what_varies_with_threads(plt, tmp_path):
    # The run that gave a 7260x462 image: one contention workload over 1, 2, 4, 8
    # threads and ten single-thread cases.
    family = thread_family({"contention": (1, 2, 4, 8), **{f"audit{i}": (1,) for i in range(10)}})
    fig = plots.throughput_figure(plt, [family])
    assert len(fig.axes) == 1
    path = tmp_path / "throughput_vs_threads.png"
    assert plots._save(plt, fig, path)  # what write_plots does with it
    width, height = png_size(path)
    assert 300 <= width <= 800 and 250 <= height <= 600
    # Seven workloads that vary: a grid three panels wide, one axes per panel.
    family = thread_family({f"w{i}": (1, 2, 4) for i in range(7)})
    fig = plots.throughput_figure(plt, [family])
    assert len(fig.axes) == 7
    assert fig.get_size_inches() == pytest.approx((15.0, 3 * 3.6))
    assert plots._save(plt, fig, path)
    width, height = png_size(path)
    assert width <= 3 * 5 * plots.DPI and height <= 3 * 3.6 * plots.DPI
    assert width >= 2 * 5 * plots.DPI and height >= 2 * 3.6 * plots.DPI
    # Nothing varies with threads: no plot.
    assert plots.throughput_figure(plt, [thread_family({"a": (1,), "b": (2,)})]) is None


def test_missing_matplotlib_skips_plots_without_crashing(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" fails.
    progress = io.StringIO()
    document = {"families": [{"name": "x", "cases": []}]}
    assert plots.write_plots(document, tmp_path, progress) == []
    assert "matplotlib is not available" in progress.getvalue()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", FIGURES)
def test_no_text_is_cut(figure, name):
    fig = figure(name)
    assert clipped_texts(fig) == []
    assert drawn_texts(fig)  # the check looked at something


def test_every_label_is_whole(figure):
    """Case and variant names are drawn as they are: no ellipsis, no cut."""
    labels = [t.get_text() for t in figure("overhead_accumulator").axes[0].get_yticklabels()]
    for width in (128, 1024):
        assert (
            f"micro_steps/mlp2x{width}/b32/k4  (1 = keras gradient_accumulation_steps)" in labels
        )
    assert "keras gradient_accumulation_steps + one tf mutex" in labels


def test_each_heading_names_one_baseline(figure):
    """The rng family has two baselines: each case's heading names its own, and the axis
    title names none."""
    ax = figure("overhead_rng").axes[0]
    headings = [t.get_text() for t in ax.get_yticklabels() if t.get_fontweight() == "bold"]
    xlabel = ax.get_xlabel()
    assert headings == [
        "normal/eager/1M  (1 = tf.random.Generator.normal)",
        "normal_vs_stateless/eager/1M  (1 = tf.random.stateless_normal)",
        "normal/graph/1M  (1 = tf.random.Generator.normal)",
        "normal_vs_stateless/graph/1M  (1 = tf.random.stateless_normal)",
    ]
    assert "tf.random" not in xlabel


def goal_lines(ax: Any) -> list[tuple[float, float, str]]:
    """(x, y, colour) of every vertical segment drawn with ``vlines``."""
    import matplotlib.collections
    import matplotlib.colors

    found = []
    for collection in ax.collections:
        if not isinstance(collection, matplotlib.collections.LineCollection):
            continue
        colors = collection.get_colors()
        for index, segment in enumerate(collection.get_segments()):
            (x0, y0), (x1, y1) = segment
            if x0 == x1 and y0 != y1:
                color = matplotlib.colors.to_hex(colors[index % len(colors)])
                found.append((float(x0), (y0 + y1) / 2, color))
    return found


def test_goal_lines_are_drawn_at_the_bound_in_the_verdict_colour(plt):
    family = family_result(
        "graph",
        [
            {
                "name": "met",
                "variants": {"plain": rounds(1.0), "safe": rounds(1.0)},
                "goal": ("safe", 1.10),
            },
            {
                "name": "missed",
                "variants": {"plain": rounds(1.0), "safe": rounds(1.5)},
                "goal": ("safe", 1.30),
            },
            {
                "name": "peer",
                "variants": {"plain": rounds(1.0), "safe": rounds(2.0), "peer": rounds(2.5)},
                "goal": ("safe", 1.0),
                "goal_reference": "peer",
            },
        ],
    )
    verdicts = [case["goal"]["verdict"] for case in family["cases"]]
    assert verdicts == ["met", "missed", "met"]
    fig = plots.overhead_figure(plt, family)
    ax = fig.axes[0]
    rows = {
        round(tick): label.get_text() for tick, label in zip(ax.get_yticks(), ax.get_yticklabels())
    }
    lines = goal_lines(ax)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    plt.close(fig)
    color = {v: c.lower() for v, c in plots.VERDICT_COLORS.items()}
    assert sorted((x, rows[round(y)], c) for x, y, c in lines) == [
        (1.0, "safe / peer", color["met"]),  # the goal's own ratio, on a row of its own
        (1.1, "safe", color["met"]),
        (1.3, "safe", color["missed"]),
    ]
    assert "goal bound, met" in legend and "goal bound, missed" in legend


def test_lost_updates_are_shown_beside_the_throughput(figure):
    throughput, lost = figure("threads").axes
    assert throughput.get_ylabel().startswith("operations / s")
    assert "lost" in lost.get_title()
    heights = {
        container.get_label(): [bar.get_height() for bar in container]
        for container in lost.containers
    }
    labels = [t.get_text() for t in lost.texts]
    racy_style = {line.get_label(): line.get_linestyle() for line in throughput.get_lines()}
    # Per thread count (1, 2, 4, 8): the racy baseline loses updates from 2 threads on.
    assert heights["tf.Variable (racy)"][0] == 0
    assert all(h > 0 for h in heights["tf.Variable (racy)"][1:])
    assert heights["SafeVariable.update"] == heights["safevars.locked"] == [0, 0, 0, 0]
    assert labels.count("0") >= 8  # every safe bar says 0
    assert racy_style["tf.Variable (racy) (loses updates)"] == "--"
    assert racy_style["SafeVariable.update"] == "-"


def test_a_family_declaring_plot_against_gets_a_ratio_plot(figure, tmp_path):
    fig = figure("against")
    assert len(fig.axes) == 2  # one panel per way of training
    for ax in fig.axes:
        assert ax.get_xlabel() == "variables"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["20", "200", "400"]
        assert any(line.get_ydata()[0] == 1.25 for line in ax.get_lines())  # the goal
    family = scope_family()
    written = plots.write_plots({"families": [family]}, tmp_path, io.StringIO())
    assert [p.name for p in written] == ["overhead_scope.png", "scope_vs_variables.png"]
    del family["plot_against"]
    written = plots.write_plots({"families": [family]}, tmp_path, io.StringIO())
    assert [p.name for p in written] == ["overhead_scope.png"]
