"""The JSON schema of ``results.json`` (:mod:`benchmarks.schema`)."""

from __future__ import annotations

import io
import json

from benchmarks import cli, devices, metadata, runner, schema
from benchmarks.case import Case
from benchmarks.timing import VariantTiming
from tests.support.benchmark_fakes import CPU, tiny_settings


def test_schema_rejects_broken_documents():
    meta = metadata.collect(CPU, quick=False)
    good = runner.build_document(meta, tiny_settings(), devices.make_context(CPU, False), [])
    assert schema.validate(good) == []
    bad = json.loads(json.dumps(good))
    del bad["metadata"]["git_commit"]
    bad["settings"]["rounds"] = "3"
    bad["status"] = "maybe"
    bad["settings"]["confidence_interval"]["level"] = "95%"
    problems = schema.validate(bad)
    assert any("git_commit" in p for p in problems)
    assert any("settings.rounds" in p for p in problems)
    assert any("status" in p for p in problems)
    assert any("confidence_interval.level" in p for p in problems)


def test_schema_checks_intervals_and_verdicts():
    case = Case("f", "c", {"plain": int, "safe": int}, goal=("safe", 1.10))
    timings = [VariantTiming("plain", 1, [1.0, 1.1, 0.9]), VariantTiming("safe", 1, [1.0] * 3)]
    family = {
        "name": "f",
        "description": "",
        "module": "m",
        "default": True,
        "status": "ok",
        "error": None,
        "traceback": None,
        "duration_s": 0.1,
        "cases": [runner.case_result(case, "f", timings, 0.1)],
    }
    document = runner.build_document(
        metadata.collect(CPU, quick=True),
        tiny_settings(),
        devices.make_context(CPU, True),
        [family],
    )
    assert schema.validate(document) == []
    bad = json.loads(json.dumps(document))
    bad["goals"][0]["verdict"] = "almost"
    bad["goals"][0]["ratio_ci_95"] = [1.0, 1.1, 1.2]
    bad["goals"][0]["versus_ci_95"]["plain"] = "wide"
    bad["families"][0]["cases"][0]["variants"][1]["ratio_to_baseline_ci_95"] = [1.0]
    problems = schema.validate(bad)
    for where in (
        "goals[0].verdict",
        "goals[0].ratio_ci_95",
        "versus_ci_95.plain",
        "variants[1].ratio_to_baseline_ci_95",
    ):
        assert any(where in p for p in problems), (where, problems)
    printed = io.StringIO()
    assert cli.main(["--schema"], stdout=printed) == 0
    assert "ratio_ci_95" in printed.getvalue() and "inconclusive" in printed.getvalue()
