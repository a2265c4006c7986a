"""The stdout table and ``results.md`` (:mod:`benchmarks.report`)."""

from __future__ import annotations

from benchmarks import devices, metadata, report, runner, schema
from benchmarks.case import Case
from benchmarks.timing import VariantTiming
from tests.support.benchmark_fakes import CPU, family_result, rounds, tiny_settings


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


def long_document() -> dict:
    """A run with the longest names of the suite, and longer: what once made the stdout
    table 270 columns wide and more."""
    variants = {
        "keras gradient_accumulation_steps": rounds(1.0),
        "GradientAccumulator": (rounds(1.3), [{"lost_updates": 0, "updates": 200}] * 7),
        "keras gradient_accumulation_steps + one tf mutex": rounds(1.06),
        "a variant whose name alone is longer than one hundred and twenty columns of a "
        "terminal, which nobody should write": rounds(0.9),
    }
    family = family_result(
        "accumulator",
        [
            {
                "name": f"micro_steps/mlp2x{width}/b32/k4",
                "variants": variants,
                "goal": ("GradientAccumulator", 1.10),
            }
            for width in (128, 1024)
        ],
    )
    family["description"] = "gradient accumulation micro-steps: " + "x" * 150
    meta = metadata.collect(CPU, quick=True, command="python -m benchmarks " + "--cases a " * 30)
    return runner.build_document(meta, tiny_settings(), devices.make_context(CPU, True), [family])


def test_stdout_table_fits_the_terminal_width_and_keeps_every_figure():
    document = long_document()
    text = report.text_table(document)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= report.TERMINAL_WIDTH == 120
    flat = " ".join(text.split())
    (family,) = document["families"]
    for row in report.table_rows(family):
        case, variant, median, _, _, rate, ratio, notes = row
        for cell in (case, median, rate, ratio):
            assert cell in flat
        assert " ".join(variant.split()) in flat
        assert " ".join(notes.split()) in flat  # goal notes and extra figures, whole
    for goal in document["goals"]:
        assert goal["verdict"].upper() in flat
    assert " ".join(document["metadata"]["command"].split()) in flat
    # Each case heads its variants, which are indented below it.
    heading = lines.index("  micro_steps/mlp2x128/b32/k4")
    assert lines[heading + 1].startswith("    keras gradient_accumulation_steps ")
    # results.md keeps one row per variant, with every column.
    markdown = report.markdown(document)
    assert "| case | variant | median | min | max | ops/s |" in markdown
    assert max(len(line) for line in markdown.splitlines()) > 120
