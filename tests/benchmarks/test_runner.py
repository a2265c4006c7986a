"""Running families and building results (:mod:`benchmarks.runner`): ratios, goals,
verdicts, failures, ``--repeat``."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from benchmarks import devices, discovery, report, runner
from benchmarks.case import Case
from benchmarks.timing import VariantTiming, pool, repetition_ratios
from tests.support.benchmark_fakes import CPU, FakeClock, tiny_settings


def test_case_result_ratios_and_goal():
    case = Case(
        "f",
        "c",
        {"plain": lambda: 0, "safe": lambda: 0, "lock": lambda: 0},
        ops_per_call=2,
        goal=("safe", 1.10),
        goal_reference="lock",
    )
    timings = [
        VariantTiming("plain", 1, [1.0, 2.0, 3.0]),
        VariantTiming("safe", 1, [2.0, 4.0, 6.0]),
        VariantTiming("lock", 1, [2.0, 2.0, 2.0]),
    ]
    result = runner.case_result(case, "f", timings, 0.5)
    plain, safe, _ = result["variants"]
    assert plain["ratio_to_baseline"] == 1.0 and safe["ratio_to_baseline"] == 2.0
    assert plain["ratio_to_baseline_ci_95"] == [1.0, 1.0]
    assert safe["ratio_to_baseline_ci_95"] == [2.0, 2.0]  # safe = 2 x plain every round
    assert safe["per_op_median_s"] == 2.0 and safe["ops_per_s"] == 0.5
    assert (safe["min_s"], safe["max_s"]) == (2.0, 6.0)
    goal = result["goal"]
    assert goal["reference"] == "lock" and goal["ratio"] == 2.0
    # safe/lock resamples range from 2/2 to 6/2: the interval straddles 1.10.
    low, high = goal["ratio_ci_95"]
    assert low <= 1.10 < high
    assert (goal["verdict"], goal["met"]) == ("inconclusive", None)
    assert goal["versus"]["plain"] == 2.0 and goal["versus_ci_95"]["plain"] == [2.0, 2.0]
    assert goal["rounds"] == 3 and result["repetitions"] == 1


def test_a_pooled_goal_records_the_ratio_of_each_repetition():
    case = Case("f", "c", {"plain": int, "safe": int}, goal=("safe", 1.10))
    first = [
        VariantTiming("plain", 1, [1.0, 1.0, 1.0], [{}] * 3, [3], [1]),
        VariantTiming("safe", 1, [2.0, 2.0, 2.2], [{}] * 3, [3], [1]),
    ]
    second = [
        VariantTiming("plain", 1, [2.0, 2.0, 2.0, 2.0], [{}] * 4, [4], [1]),
        VariantTiming("safe", 1, [1.0, 2.0, 2.0, 3.0], [{}] * 4, [4], [1]),
    ]
    pooled = runner.case_result(case, "f", pool([first, second]), 0.1)
    assert pooled["goal"]["ratio_per_repetition"] == [2.0, 1.0]
    single = runner.case_result(case, "f", first, 0.1)
    assert single["goal"]["ratio_per_repetition"] == [2.0]
    notes = [row[-1] for row in report.table_rows({"cases": [pooled]})]
    assert "(passes 2.00, 1.00)" in notes[1]
    assert "passes" not in report.table_rows({"cases": [single]})[1][-1]
    with pytest.raises(ValueError, match="add up"):
        repetition_ratios([1.0, 2.0], [1.0, 2.0], [1])


@pytest.mark.parametrize(
    "operator, bound, ratio, interval, expected",
    [
        ("<=", 1.10, 1.05, (1.01, 1.10), "met"),  # upper end at the bound: met
        ("<=", 1.10, 1.05, (1.01, 1.12), "inconclusive"),
        ("<=", 1.10, 1.30, (1.10, 1.40), "inconclusive"),  # lower end at the bound
        ("<=", 1.10, 1.30, (1.11, 1.40), "missed"),
        (">=", 2.00, 2.50, (2.00, 3.00), "met"),  # mirror image
        (">=", 2.00, 2.50, (1.90, 3.00), "inconclusive"),
        (">=", 2.00, 1.50, (1.20, 1.99), "missed"),
        ("<=", 1.10, 1.00, None, "inconclusive"),  # too few rounds for an interval
        ("<=", 1.10, None, None, "not measured"),
    ],
)
def test_verdict(operator, bound, ratio, interval, expected):
    assert runner.verdict(operator, bound, ratio, interval) == expected


def test_goal_verdicts_from_samples():
    rng = np.random.default_rng(2)
    base = list(np.exp(rng.normal(0, 0.02, 25)))
    timings = [
        VariantTiming("plain", 1, base),
        VariantTiming("fast", 1, [x * 0.5 for x in base]),
        VariantTiming("slow", 1, [x * 1.5 for x in base]),
    ]
    variants = {t.name: int for t in timings}
    outcomes = {}
    for goal in (("fast", 1.10), ("slow", 1.10), ("fast", ">=", 1.0), ("slow", ">=", 1.0)):
        result = runner.case_result(Case("f", "c", variants, goal=goal), "f", timings, 0.1)
        outcomes[goal] = (result["goal"]["verdict"], result["goal"]["met"])
    assert outcomes == {
        ("fast", 1.10): ("met", True),
        ("slow", 1.10): ("missed", False),
        ("fast", ">=", 1.0): ("missed", False),
        ("slow", ">=", 1.0): ("met", True),
    }


def test_failing_families_are_reported_and_the_run_goes_on(fake_package):
    selected = discovery.select(fake_package, "alpha,broken,raising,nameless")
    progress = io.StringIO()
    results = runner.run_families(
        selected,
        devices.make_context(CPU, True),
        tiny_settings(),
        progress=progress,
        clock=FakeClock([]),
    )
    by_name = {r["name"]: r for r in results}
    assert by_name["alpha"]["status"] == "ok"
    assert by_name["alpha"]["cases"][0]["variants"][1]["extra"] == {"lost": 0}
    assert by_name["broken"]["status"] == "failed"
    assert "ModuleNotFoundError" in by_name["broken"]["error"]
    assert by_name["nameless"]["status"] == "failed"
    raising = by_name["raising"]
    assert raising["status"] == "failed"
    assert [c["status"] for c in raising["cases"]] == ["failed", "ok", "failed"]
    assert "ZeroDivisionError: variant exploded" in raising["cases"][0]["error"]
    assert "ValueError: a goal must be" in raising["cases"][2]["error"]
    assert "FAILED" in progress.getvalue()


def test_repeat_rebuilds_the_cases_and_pools_their_rounds(fake_package):
    selected = discovery.select(fake_package, "counted")
    progress = io.StringIO()
    (family,) = runner.run_families(
        selected,
        devices.make_context(CPU, True),
        tiny_settings(),
        progress=progress,
        clock=FakeClock([]),
        repeat=3,
    )
    (case,) = family["cases"]
    assert case["repetitions"] == 3
    for variant in case["variants"]:
        assert variant["rounds"] == 9 and variant["rounds_per_repetition"] == [3, 3, 3]
        assert len(variant["samples_s"]) == len(variant["extra_rounds"]) == 9
    safe = case["variants"][1]
    assert [e["build"] for e in safe["extra_rounds"]] == [1] * 3 + [2] * 3 + [3] * 3
    assert case["goal"]["rounds"] == 9 and case["goal"]["operator"] == ">="
    assert "[repetition 3/3][1/1 counted | " in progress.getvalue()
    with pytest.raises(ValueError):
        runner.run_families(
            selected, devices.make_context(CPU, True), tiny_settings(), progress=progress, repeat=0
        )


def test_until_runs_one_pass_and_the_next_process_pools_its_own(fake_package):
    """``until``: one pass of a run whose passes are processes of their own; the next
    pass resumes the first's rounds and adds its own."""
    selected = discovery.select(fake_package, "counted")
    ctx, progress = devices.make_context(CPU, True), io.StringIO()
    (first,) = runner.run_families(
        selected, ctx, tiny_settings(), progress=progress, clock=FakeClock([]), repeat=2, until=1
    )
    assert [c["repetitions"] for c in first["cases"]] == [1]
    assert "[repetition 2/2]" not in progress.getvalue()
    (second,) = runner.run_families(
        selected,
        ctx,
        tiny_settings(),
        progress=progress,
        clock=FakeClock([]),
        repeat=2,
        until=2,
        previous=[json.loads(json.dumps(first))],
    )
    (case,) = second["cases"]
    assert case["repetitions"] == 2
    for variant in case["variants"]:
        assert variant["rounds_per_repetition"] == [3, 3]
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="until must be an int from 1 to repeat"):
            runner.run_families(
                selected, ctx, tiny_settings(), progress=progress, repeat=2, until=bad
            )


LAZY_FAMILY = {
    "bench_lazy.py": """
        import weakref
        from benchmarks.case import Case, LazyCase
        FAMILY = "lazy"
        SECONDS = {"quick": 2, "full": 20}
        EVENTS = []
        ALIVE = []  # weak references to what each case built

        class Model:  # stands for a Keras model and its traced functions
            def __call__(self):
                return 1

        def build(name):
            EVENTS.append(f"build {name}")
            model = Model()
            ALIVE.append(weakref.ref(model))
            return Case("lazy", name, {"plain": lambda: 1, "safe": model},
                        teardown=lambda: EVENTS.append(f"teardown {name}"))

        def cases(ctx):
            return [LazyCase("lazy", f"c{i}", lambda i=i: build(f"c{i}")) for i in range(3)]
    """,
}


def test_a_lazy_case_is_built_at_its_turn_and_released_after_it(family_package):
    (info,) = family_package("lazybench_pkg", LAZY_FAMILY)
    import lazybench_pkg.bench_lazy as module

    seen: list[list[str]] = []

    def checkpoint(families):
        (family,) = families
        seen.append([case["name"] for case in family["cases"]])
        # What a case built is gone by the time its result is written.
        assert module.ALIVE and not any(ref() is not None for ref in module.ALIVE)

    def release():
        import gc

        gc.collect()

    (family,) = runner.run_families(
        [info],
        devices.make_context(CPU, True),
        tiny_settings(),
        progress=io.StringIO(),
        clock=FakeClock([]),
        checkpoint=checkpoint,
        release=release,
    )
    assert module.EVENTS == [
        "build c0",
        "teardown c0",
        "build c1",
        "teardown c1",
        "build c2",
        "teardown c2",
    ]
    assert seen == [["c0"], ["c0", "c1"], ["c0", "c1", "c2"], ["c0", "c1", "c2"]]
    for case in family["cases"]:
        assert set(case["phases_s"]) == set(runner.PHASES)
        assert case["variants"][0]["name"] == "plain" and case["baseline"] == "plain"


def test_a_failing_build_fails_its_case_only(family_package):
    (info,) = family_package(
        "lazyfailbench_pkg",
        {
            "bench_lazyfail.py": """
                from benchmarks.case import Case, LazyCase
                FAMILY = "lazyfail"
                def broken():
                    raise MemoryError("no room for the model")
                def cases(ctx):
                    return [LazyCase("lazyfail", "bad", broken),
                            LazyCase("lazyfail", "good",
                                     lambda: Case("lazyfail", "good", {"plain": int}))]
            """
        },
    )
    (family,) = runner.run_families(
        [info], devices.make_context(CPU, True), tiny_settings(), io.StringIO(), FakeClock([])
    )
    bad, good = family["cases"]
    assert (bad["name"], bad["status"], good["status"]) == ("bad", "failed", "ok")
    assert "MemoryError: no room for the model" in bad["error"]
    assert family["status"] == "failed"


def test_resume_keeps_finished_cases_and_adds_missing_repetitions(fake_package):
    selected = discovery.select(fake_package, "alpha,counted")
    ctx = devices.make_context(CPU, True)
    first = runner.run_families(selected, ctx, tiny_settings(), io.StringIO(), FakeClock([]))
    # As if interrupted in the second of three passes: alpha done twice, counted once.
    alpha, counted = (json.loads(json.dumps(f)) for f in first)
    twice = runner.run_families(
        selected[:1], ctx, tiny_settings(), io.StringIO(), FakeClock([]), repeat=2
    )
    alpha = json.loads(json.dumps(twice[0]))
    progress = io.StringIO()
    resumed = runner.run_families(
        selected,
        ctx,
        tiny_settings(),
        progress,
        FakeClock([]),
        repeat=3,
        previous=[alpha, counted],
    )
    for family in resumed:
        (case,) = family["cases"]
        assert case["repetitions"] == 3
        assert all(v["rounds_per_repetition"] == [3, 3, 3] for v in case["variants"])
    (pair,) = resumed[1]["cases"]
    builds = [e["build"] for e in pair["variants"][1]["extra_rounds"]]
    # The first run's rounds, then those of passes 2 and 3 (cases(ctx) of build 2 made
    # the resumed pass 1, whose case was skipped).
    assert builds == [1] * 3 + [3] * 3 + [4] * 3
    assert "1 of 1 case(s) kept from the run resumed" in progress.getvalue()
