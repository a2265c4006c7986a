"""The PNG plots (:mod:`benchmarks.plots`)."""

from __future__ import annotations

import io
import sys

import pytest
from benchmark_fakes import png_size, thread_family

from benchmarks import plots


def test_throughput_plot_draws_only_what_varies_with_threads(tmp_path):
    plt = plots._pyplot(io.StringIO())
    # The run that gave a 7260x462 image: one contention workload over 1, 2, 4, 8
    # threads and ten single-thread cases.
    family = thread_family({"contention": (1, 2, 4, 8), **{f"audit{i}": (1,) for i in range(10)}})
    fig = plots.throughput_figure(plt, [family])
    assert len(fig.axes) == 1
    plt.close(fig)
    path = tmp_path / "throughput_vs_threads.png"
    assert plots._throughput(plt, [family], path)
    width, height = png_size(path)
    assert 300 <= width <= 800 and 250 <= height <= 600
    # Seven workloads that vary: a grid three panels wide, one axes per panel.
    family = thread_family({f"w{i}": (1, 2, 4) for i in range(7)})
    fig = plots.throughput_figure(plt, [family])
    assert len(fig.axes) == 7
    assert fig.get_size_inches() == pytest.approx((15.0, 3 * 3.6))
    plt.close(fig)
    assert plots._throughput(plt, [family], path)
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
