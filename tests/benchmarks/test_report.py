"""The stdout table and ``results.md`` (:mod:`benchmarks.report`)."""

from __future__ import annotations

from benchmark_fakes import CPU, tiny_settings

from benchmarks import devices, metadata, report, runner, schema
from benchmarks.case import Case
from benchmarks.timing import VariantTiming


def test_report_shows_each_ratio_with_its_interval_and_the_verdict():
    case = Case("f", "c", {"plain": int, "safe": int}, goal=("safe", 1.10))
    timings = [
        VariantTiming("plain", 1, [1.0, 1.0, 1.0, 1.0]),
        VariantTiming("safe", 1, [1.30, 1.32, 1.31, 1.29]),
    ]
    result = runner.case_result(case, "f", timings, 0.1)
    family = {
        "name": "f",
        "description": "",
        "module": "m",
        "default": True,
        "status": "ok",
        "error": None,
        "traceback": None,
        "duration_s": 0.1,
        "cases": [result],
    }
    meta = metadata.collect(CPU, quick=True)
    document = runner.build_document(
        meta, tiny_settings(), devices.make_context(CPU, True), [family]
    )
    assert schema.validate(document) == []
    low, high = result["variants"][1]["ratio_to_baseline_ci_95"]
    shown = f"{result['variants'][1]['ratio_to_baseline']:.2f} [{low:.2f}, {high:.2f}]"
    for text in (report.text_table(document), report.markdown(document)):
        assert shown in text
        assert "MISSED" in text and "goals: 1 missed" in text


def test_format_seconds():
    assert report.format_seconds(1.5e-5) == "15 µs"
    assert report.format_seconds(0.00234) == "2.34 ms"
    assert report.format_seconds(None) == "n/a"
