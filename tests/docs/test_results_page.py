"""The benchmark results page (docs/hooks/benchmark_results.py) renders a run's results.json."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys

import pytest

from benchmarks import report
from tests.docs.code_blocks import ROOT

RESULTS = ROOT / "docs" / "results"


def _hook():
    spec = importlib.util.spec_from_file_location(
        "benchmark_results_hook", ROOT / "docs" / "hooks" / "benchmark_results.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hook():
    pytest.importorskip("mkdocs")  # the hook raises mkdocs' PluginError
    return _hook()


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads((RESULTS / "results.json").read_text(encoding="utf-8"))


def test_the_committed_run_renders_every_family_goal_and_plot(hook, committed) -> None:
    plots = sorted(p.name for p in RESULTS.glob("*.png"))
    page = hook.render(committed, plots, report)
    for family in committed["families"]:
        assert f"## {family['name']}\n" in page
        for case in family["cases"]:
            assert f"| {case['name']} |" in page
    for goal in committed["goals"]:
        assert f"| {goal['family']}/{goal['case']} |" in page
        assert f"**{goal['verdict']}**" in page
    for plot in plots:
        assert f"](results/{plot})" in page
    meta = committed["metadata"]
    for figure in (meta["tensorflow_version"], meta["git_commit"][:12], meta["date_utc"]):
        assert figure in page
    assert ("smoke run, not results" in page) == (meta["mode"] == "quick")


def test_a_full_run_is_not_labelled_a_smoke_run(hook, committed) -> None:
    full = copy.deepcopy(committed)
    full["metadata"]["mode"] = "full"
    assert "smoke run" not in hook.render(full, [], report)


def test_ratios_intervals_and_a_failed_family_show(hook, committed) -> None:
    document = copy.deepcopy(committed)
    family = document["families"][0]
    variant = family["cases"][0]["variants"][1]
    variant.update(ratio_to_baseline=1.234, ratio_to_baseline_ci_95=[1.2, 1.3])
    family.update(status="failed", error="boom | broke")
    page = hook.render(document, [], report)
    assert "1.23 [1.20, 1.30]" in page
    assert "**Failed**: boom \\| broke" in page


def test_a_plot_of_another_run_fails_the_page(hook, committed) -> None:
    with pytest.raises(ValueError, match="belongs to no family"):
        hook.render(committed, ["overhead_nosuchfamily.png"], report)
    names = [f["name"] for f in committed["families"]]
    owners = hook.plots_by_family(
        committed,
        [f"overhead_{names[0]}.png", f"{names[0]}_vs_size.png", "throughput_vs_threads.png"],
    )
    # (in either order: the page orders a family's plots by its own plot kinds)
    assert sorted(owners[names[0]]) == sorted(
        [f"{names[0]}_vs_size.png", f"overhead_{names[0]}.png"]
    )
    assert owners[""] == ["throughput_vs_threads.png"]


def test_the_committed_run_is_complete() -> None:
    """docs/results/ holds one run: results.json, and a plot of its own for each family
    the run plotted (the page fails on a plot of another run)."""
    assert (RESULTS / "results.json").is_file()
    assert sorted(p.suffix for p in RESULTS.iterdir()) in (
        sorted([".json", ".md", *[".png"] * len(list(RESULTS.glob("*.png")))]),
    )
