"""One tiny ``--quick`` run of the whole suite in a subprocess, shared by the tests below.

It checks what the run wrote, never how long anything took.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import (
    bench_accumulator,
    bench_graph,
    discovery,
    plots,
    report,
    runner,
    schema,
)
from tests.support import forked
from tests.support.benchmark_fakes import png_size
from tests.support.deadlines import scaled

# A bound on a hang, not on the run's duration (which --help and the docs state: the
# benchmark suite's own business): scaled by SAFEVARS_TEST_TIMEOUT_SCALE, and under the
# per-test limit of pytest-timeout (600 s scaled), in which the first test pays for it.
SUITE_TIMEOUT = scaled(400)
TINY = [
    "--quick",
    "--rounds",
    "2",
    "--min-time",
    "0.002",
    "--warmup",
    "0.002",
    "--sizes",
    "1,1000",
    "--threads",
    "1,2",
]
SAFE_CONTENTION_VARIANTS = ("SafeVariable.update", "safevars.locked", "threading.Lock")


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench") / "results"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    completed = forked.run(
        ["-m", "benchmarks", *TINY, "--out", str(out)],
        cwd=str(REPO),
        env=env,
        timeout=SUITE_TIMEOUT,
    )
    return completed, out


def test_quick_suite_runs_every_family_and_writes_valid_results(quick_run):
    completed, out = quick_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["complete"] is True and document["interrupted_by"] is None
    expected = [f.name for f in discovery.select(discovery.discover(), None)]
    assert [f["name"] for f in document["families"]] == expected
    for family in document["families"]:
        assert family["status"] == "ok", family["error"]
        assert family["cases"], family["name"]
        for case in family["cases"]:
            assert case["status"] == "ok" and case["variants"][0]["baseline"]
            assert set(case["phases_s"]) == set(runner.PHASES)
            for variant in case["variants"]:
                assert len(variant["samples_s"]) == 2  # --rounds 2
                assert variant["min_s"] <= variant["median_s"] <= variant["max_s"]
    meta = document["metadata"]
    assert meta["mode"] == "quick" and meta["device"]["kind"] == "cpu"
    assert document["settings"]["sizes"] == [1, 1000]
    assert document["settings"]["threads"] == [1, 2]
    goals = {(g["case"], g["reference"]) for g in document["goals"] if g["family"] == "eager"}
    assert goals == {("assign_add/scalar", "tf.Variable"), ("update/scalar", "threading.Lock")}
    # Issue 14's graph goals: scalar writes against plain, the rest against the peer.
    graph = {
        (g["case"], g["reference"], g["bound"])
        for g in document["goals"]
        if g["family"] == "graph"
    }
    scalar_writes = {
        (f"{op}/scalar", "tf.Variable", 1.3) for op in ("assign", "assign_add", "update")
    }
    others = {
        (f"{op}/{size}", "tf.CriticalSection", 1.0)
        for op in bench_graph.OPS
        for size in ("scalar", "1K")
    }
    assert graph == scalar_writes | {
        o for o in others if o[0] not in {w[0] for w in scalar_writes}
    }
    # The accumulator's one-mutex reference runs on the small model only, beside the goal.
    (accumulator,) = [f for f in document["families"] if f["name"] == "accumulator"]
    references = {
        case["name"]: bench_accumulator.MUTEX_REFERENCE in [v["name"] for v in case["variants"]]
        for case in accumulator["cases"]
    }
    assert references == {
        model.case_name: model.mutex_reference for model in bench_accumulator.QUICK_MODELS
    }
    assert sum(references.values()) == 1


def test_quick_suite_safe_variants_never_lose_updates(quick_run):
    _, out = quick_run
    document = json.loads((out / "results.json").read_text())
    (contention,) = [f for f in document["families"] if f["name"] == "contention"]
    assert [c["params"]["threads"] for c in contention["cases"]] == [1, 2]
    for case in contention["cases"]:
        for variant in case["variants"]:
            assert len(variant["extra_rounds"]) == 2
            for extra in variant["extra_rounds"]:
                assert 0 <= extra["lost_updates"] <= extra["updates"]
                if variant["name"] in SAFE_CONTENTION_VARIANTS:
                    assert extra["lost_updates"] == 0, (case["name"], variant["name"])


def test_quick_suite_writes_markdown_plots_and_reports_progress(quick_run):
    completed, out = quick_run
    document = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()
    for family in document["families"]:
        assert f"## {family['name']}" in markdown
        assert (out / f"overhead_{family['name']}.png").stat().st_size > 1000 or all(
            len(c["variants"]) == 1 for c in family["cases"]
        )
    width, height = png_size(out / "throughput_vs_threads.png")
    # Each workload run at 2+ thread counts: its throughput beside its lost updates
    # (contention's and the threads family's): at most a row each, plus what
    # plots.fit_to_text adds for long titles (under an inch).
    rows = len(plots._by_parameter(document["families"], "threads"))
    assert 2 <= rows <= 4, rows
    assert width <= 3 * 5 * plots.DPI and height <= (rows * 3.6 + 1) * plots.DPI
    assert "| case | variant | median |" in markdown
    assert "x baseline [95% CI]" in completed.stdout and "assign_add/scalar" in completed.stdout
    assert "[1/" in completed.stderr and "eager" in completed.stderr
    assert " elapsed, ~" in completed.stderr and " left]" in completed.stderr


def test_quick_suite_output_fits_the_terminal_and_nothing_breaks_a_progress_line(quick_run):
    completed, _ = quick_run
    assert max(len(line) for line in completed.stdout.splitlines()) <= report.TERMINAL_WIDTH
    cases = [line for line in completed.stderr.splitlines() if " ... " in line]
    assert len(cases) > 20
    for line in cases:  # "[n/N family] (i/M) case ... 0.1 s: figures", nothing inside
        assert line.startswith("[") and " s: " in line, line
    assert "triggered tf.function retracing" not in completed.stderr
