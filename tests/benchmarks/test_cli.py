"""The command line (:mod:`benchmarks.cli`): exit statuses and the files written, with fake
families and devices.
"""

from __future__ import annotations

import io
import json

import pytest

from benchmarks import cli, devices, runner, schema
from tests.support.benchmark_fakes import CPU, GOAL_FAMILIES, FakeGPU, fake_details


def test_cli_unknown_cases_is_a_usage_error(fake_package, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cases", "nope"], families=fake_package)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case family 'nope'" in err and "alpha" in err


def test_cli_a_pass_beyond_the_repetitions_is_a_usage_error(fake_package, tmp_path, capsys):
    """``--_until`` (the pass an isolated family's process measures) is checked before
    anything runs or is written."""
    out = tmp_path / "out"
    for argv in (["--repeat", "2", "--_until", "3"], ["--_until", "0"]):
        with pytest.raises(SystemExit) as info:
            cli.main([*argv, "--out", str(out)], families=fake_package)
        assert info.value.code == 2
        assert "--_until" in capsys.readouterr().err and not out.exists()


def test_cli_gpu_requested_without_gpu_exits_2(fake_package, tmp_path):
    err = io.StringIO()
    code = cli.main(
        ["--device", "gpu", "--out", str(tmp_path / "out")],
        stdout=io.StringIO(),
        stderr=err,
        gpus=[],
        families=fake_package,
    )
    assert code == 2
    assert "--device cpu" in err.getvalue()
    assert not (tmp_path / "out").exists()


def test_cli_with_failures_writes_everything_and_exits_1(fake_package, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(
        [
            "--quick",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--no-plots",
            "--cases",
            "alpha,broken,raising",
        ],
        families=fake_package,
        select_device=lambda *a, **k: CPU,
    )
    assert code == 1
    captured = capsys.readouterr()
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["status"] == "failed"
    assert [f["name"] for f in document["families"]] == ["raising", "alpha", "broken"]
    assert document["goals"][0]["variant"] == "safe"
    markdown = (out / "results.md").read_text()
    assert "FAILED" in markdown and "ModuleNotFoundError" in markdown
    assert "alpha" in captured.out and "x baseline" in captured.out
    assert "FAILED families: raising, broken" in captured.err


def test_cli_repeat_reports_pooled_intervals_and_verdicts(fake_package, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(
        [
            "--quick",
            "--rounds",
            "3",
            "--repeat",
            "2",
            "--out",
            str(out),
            "--no-plots",
            "--cases",
            "alpha,counted",
        ],
        families=fake_package,
        select_device=lambda *a, **k: CPU,
    )
    assert code == 0
    captured = capsys.readouterr()
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["settings"]["repeat"] == 2
    assert document["settings"]["confidence_interval"]["level"] == 0.95
    for family in document["families"]:
        for case in family["cases"]:
            assert case["repetitions"] == 2
            for variant in case["variants"]:
                assert variant["rounds_per_repetition"] == [3, 3]
                assert len(variant["ratio_to_baseline_ci_95"]) == 2
    verdicts = {g["case"]: g["verdict"] for g in document["goals"]}
    assert set(verdicts) == {"add", "pair"}
    assert all(v in runner.VERDICTS for v in verdicts.values())
    assert all(len(g["ratio_per_repetition"]) == 2 for g in document["goals"])
    markdown = (out / "results.md").read_text()
    for text in (markdown, captured.out):
        text = " ".join(text.split())  # the stdout table wraps long lines
        assert "2 repetitions x 3 rounds, pooled" in text
        assert text.count("(passes ") >= len(document["goals"])
        assert "x baseline [95% CI]" in text
        assert "paired bootstrap" in text and "inconclusive otherwise" in text
        for goal in document["goals"]:
            assert goal["verdict"] in text.lower()
    assert "goals: " in markdown and "2 passes" in captured.err
    with pytest.raises(SystemExit) as info:
        cli.main(["--repeat", "0"], families=fake_package)
    assert info.value.code == 2


def test_cli_gpu_path_with_fake_gpu(fake_package, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(
        ["--quick", "--rounds", "1", "--out", str(out), "--no-plots", "--cases", "alpha"],
        families=fake_package,
        gpus=[FakeGPU()],
        select_device=lambda requested, gpus: devices.select_device(
            requested, gpus=gpus, details=fake_details
        ),
    )
    assert code == 0
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["metadata"]["device"]["kind"] == "gpu"
    assert document["metadata"]["device"]["name"] == "NVIDIA A100-SXM4-40GB"
    assert 16_000_000 in document["settings"]["sizes"]
    assert "GPU NVIDIA A100" in capsys.readouterr().out


def run_check(families, tmp_path, *options: str) -> tuple[int, str, dict]:
    """``python -m benchmarks --quick ... options`` on fake families: (status, stderr,
    results.json)."""
    out = tmp_path / "out"
    err = io.StringIO()
    code = cli.main(
        ["--quick", "--min-time", "0.002", "--warmup", "0", "--out", str(out), "--no-plots"]
        + list(options),
        stdout=io.StringIO(),
        stderr=err,
        families=families,
        select_device=lambda *a, **k: CPU,
    )
    return code, err.getvalue(), json.loads((out / "results.json").read_text())


@pytest.fixture
def goal_families(family_package):
    return family_package("goalbench_pkg", GOAL_FAMILIES)


def test_check_exits_1_on_a_missed_goal_and_only_with_check(goal_families, tmp_path):
    code, err, document = run_check(goal_families, tmp_path, "--rounds", "5")
    verdicts = {g["family"]: g["verdict"] for g in document["goals"]}
    assert verdicts == {"meets": "met", "misses": "missed"}
    assert code == 0 and "check:" not in err  # goals change nothing without --check
    code, err, _ = run_check(goal_families, tmp_path, "--rounds", "5", "--check")
    assert code == 1
    assert "check: goal misses/pair MISSED: safe over plain >= 1000.00x" in err
    assert "check: --check FAILED: 1 of 2 goal(s)" in err
    assert "meets/pair" not in err


def test_inconclusive_goals_pass_check_and_fail_strict(goal_families, tmp_path):
    # Two rounds give no interval: the verdict is inconclusive.
    code, err, document = run_check(goal_families, tmp_path, "--rounds", "2", "--check")
    assert {g["verdict"] for g in document["goals"]} == {"inconclusive"}
    assert code == 0
    assert "check: 2 goal(s) inconclusive or not measured, not counted (--strict" in err
    code, err, _ = run_check(goal_families, tmp_path, "--rounds", "2", "--strict")
    assert code == 1
    assert "check: goal meets/pair INCONCLUSIVE" in err and "--strict FAILED: 2 of 2" in err


def goal(verdict: str) -> dict:
    return {
        "family": "f",
        "case": verdict,
        "variant": "safe",
        "reference": "plain",
        "operator": "<=",
        "bound": 1.1,
        "ratio": None if verdict == "not measured" else 1.0,
        "ratio_ci_95": None,
        "verdict": verdict,
    }


@pytest.mark.parametrize(
    "verdicts, strict, fails, last",
    [
        ([], True, False, "check: --strict passed: the selected families have no goals"),
        (["met"], False, False, "check: --check passed: goals: 1 met"),
        (
            ["met", "inconclusive"],
            False,
            False,
            "check: --check passed: goals: 1 met, 1 inconclusive",
        ),
        (["met", "not measured"], True, True, "check: --strict FAILED: 1 of 2 goal(s)"),
        (["missed", "inconclusive"], False, True, "check: --check FAILED: 1 of 2 goal(s)"),
    ],
)
def test_check_goals(verdicts, strict, fails, last):
    failed, lines = cli.check_goals([goal(v) for v in verdicts], strict=strict)
    assert failed is fails
    assert lines[-1] == last
    assert sum(line.startswith("check: goal ") for line in lines) == (
        sum(v != "met" for v in verdicts) if strict else verdicts.count("missed")
    )


def test_help_says_what_check_counts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--check exit 1 when a goal is missed" in text
    assert "inconclusive and unmeasured goals are reported on stderr but pass" in text
    assert "--strict --check, and an inconclusive or unmeasured goal fails it too" in text
    assert "The stdout table fits 120 columns" in text
