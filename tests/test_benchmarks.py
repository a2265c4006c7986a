"""Tests of the benchmark suite: the runner's logic, and one tiny ``--quick`` run.

No test asserts a timing. The GPU path (device choice, metadata, 1M+ sizes, device sync
before every clock read) is tested on the CPU with fake GPUs and fake clocks. The
statistics (confidence intervals, verdicts, --repeat pooling) are tested on synthetic
samples with known properties, without timing anything.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import (  # noqa: E402
    bench_accumulator,
    bench_data,
    bench_eager,
    bench_graph,
    cli,
    devices,
    discovery,
    metadata,
    plots,
    report,
    runner,
    schema,
)
from benchmarks.case import Case, goal_spec, size_label  # noqa: E402
from benchmarks.timing import (  # noqa: E402
    TimingSettings,
    VariantTiming,
    measure,
    pool,
    ratio_interval,
    repetition_ratios,
)

SUITE_TIMEOUT = 100  # seconds; the whole --quick suite must take < 45 s on 2 cores.
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


# --------------------------------------------------------------------------- fakes


class FakeClock:
    """A clock that advances ``step`` seconds per read and logs every read."""

    def __init__(self, log: list[str], step: float = 0.001) -> None:
        self.log = log
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.log.append("clock")
        self.now += self.step
        return self.now


class FakeGPU:
    """Stands for a ``tf.config.PhysicalDevice`` of type GPU."""

    name = "/physical_device:GPU:0"
    device_type = "GPU"


def fake_details(gpu: Any) -> dict[str, Any]:
    return {"device_name": "NVIDIA A100-SXM4-40GB", "compute_capability": (8, 0)}


GPU = devices.DeviceChoice(
    "gpu",
    "/GPU:0",
    "NVIDIA A100-SXM4-40GB",
    {"visible_gpus": 1, "compute_capability": "8.0"},
)
CPU = devices.DeviceChoice("cpu", "/CPU:0", "test CPU", {"visible_gpus": 0})

FAKE_FAMILIES = {
    "bench_alpha.py": """
        from benchmarks.case import Case
        FAMILY = "alpha"
        DESCRIPTION = "two variants"
        def cases(ctx):
            return [Case("alpha", "add", {"plain": lambda: 1, "safe": lambda: {"lost": 0}},
                         goal=("safe", 1.10))]
    """,
    "bench_broken.py": """
        FAMILY = "broken"
        DESCRIPTION = "fails to import"
        import a_module_that_does_not_exist_anywhere
    """,
    "bench_raising.py": """
        from benchmarks.case import Case
        FAMILY = "raising"
        ORDER = 1
        def boom():
            raise ZeroDivisionError("variant exploded")
        def cases(ctx):
            return [Case("raising", "bad", {"plain": lambda: 1, "bad": boom}),
                    Case("raising", "good", {"plain": lambda: 1, "other": lambda: 2}),
                    Case("raising", "bad goal", {"plain": lambda: 1}, goal=("plain", "<", 1))]
    """,
    "bench_counted.py": """
        import itertools
        from benchmarks.case import Case
        FAMILY = "counted"
        DEFAULT = False
        BUILDS = itertools.count(1)
        def cases(ctx):
            build = next(BUILDS)
            return [Case("counted", "pair", {"plain": lambda: 1,
                                             "safe": lambda: {"build": build}},
                         goal=("safe", ">=", 0.5))]
    """,
    "bench_optional.py": """
        from benchmarks.case import Case
        FAMILY = "optional"
        DEFAULT = False
        def cases(ctx):
            return [Case("optional", "only", {"plain": lambda: 1})]
    """,
    "bench_nameless.py": """
        def cases(ctx):
            return []
    """,
}


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[discovery.FamilyInfo]:
    """A package of fake families: one good, one that fails to import, one raising..."""
    package = tmp_path / "fakebench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in FAKE_FAMILIES.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return discovery.discover(package, "fakebench_pkg")


def tiny_settings() -> TimingSettings:
    return TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.003)


# --------------------------------------------------------------------------- discovery


def test_discovery_reads_families_without_importing_them(fake_package):
    by_name = {f.name: f for f in fake_package}
    assert [f.name for f in fake_package] == [  # ORDER first, then by file name.
        "raising",
        "alpha",
        "broken",
        "counted",
        "nameless",
        "optional",
    ]
    assert by_name["broken"].problem is None  # Found statically; fails only on import.
    assert by_name["optional"].default is False
    assert "defines no FAMILY" in by_name["nameless"].problem
    assert "fakebench_pkg.bench_broken" not in sys.modules


def test_select_default_excludes_optional_families(fake_package):
    default = [f.name for f in discovery.select(fake_package, None)]
    assert "optional" not in default and "alpha" in default
    assert [f.name for f in discovery.select(fake_package, "optional")] == ["optional"]
    assert len(discovery.select(fake_package, "all")) == len(fake_package)


def test_select_unknown_family_lists_the_known_ones(fake_package):
    with pytest.raises(discovery.UnknownFamilyError) as info:
        discovery.select(fake_package, "alpha,nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in ("alpha", "broken", "raising", "optional (optional)"):
        assert name in message


def test_cli_unknown_cases_is_a_usage_error(fake_package, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cases", "nope"], families=fake_package)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case family 'nope'" in err and "alpha" in err


def test_real_families_are_discovered():
    names = {f.name for f in discovery.discover()}
    assert {"eager", "graph", "contention", "snapshot"} <= names
    assert all(f.problem is None for f in discovery.discover()), discovery.discover()


# --------------------------------------------------------------------------- devices


def test_default_device_is_the_gpu_when_one_is_visible():
    choice = devices.select_device(None, gpus=[FakeGPU()], details=fake_details)
    assert (choice.kind, choice.device) == ("gpu", "/GPU:0")
    assert choice.name == "NVIDIA A100-SXM4-40GB"
    assert choice.details == {"visible_gpus": 1, "compute_capability": "8.0"}


def test_cpu_is_chosen_without_gpu_or_on_request():
    assert devices.select_device(None, gpus=[]).kind == "cpu"
    chosen = devices.select_device("cpu", gpus=[FakeGPU()], details=fake_details)
    assert (chosen.kind, chosen.device) == ("cpu", "/CPU:0")


def test_gpu_requested_without_gpu_names_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(devices.DeviceUnavailableError) as info:
        devices.select_device("gpu", gpus=[])
    message = str(info.value)
    assert "--device cpu" in message and "tensorflow[and-cuda]" in message


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


def test_gpu_context_includes_gpu_only_large_sizes():
    gpu_ctx = devices.make_context(GPU, quick=True)
    cpu_ctx = devices.make_context(CPU, quick=True)
    assert gpu_ctx.device == "/GPU:0" and gpu_ctx.device_kind == "gpu"
    assert max(gpu_ctx.sizes) >= 16_000_000 and 1_000_000 in gpu_ctx.sizes
    assert max(cpu_ctx.sizes) == 1_000_000
    assert ("assign_add", 16_000_000) in bench_eager.plan(gpu_ctx)
    assert ("update", 16_000_000) in bench_eager.plan(gpu_ctx)
    assert all(size <= 1_000_000 for _, size in bench_eager.plan(cpu_ctx))
    assert 16_000_000 in bench_graph.sizes(gpu_ctx)
    assert size_label(16_000_000) == "16M"


def test_device_sync_only_on_gpu():
    import tensorflow as tf

    assert devices.device_sync_for(CPU) is None
    assert devices.device_sync_for(GPU) is tf.test.experimental.sync_devices


def test_gpu_metadata_is_recorded_and_valid():
    meta = metadata.collect(GPU, quick=True, command="python -m benchmarks --quick")
    assert meta["device"] == {
        "kind": "gpu",
        "name": "NVIDIA A100-SXM4-40GB",
        "tf_device": "/GPU:0",
        "details": {"visible_gpus": 1, "compute_capability": "8.0"},
    }
    assert meta["mode"] == "quick"
    assert meta["git_commit"] == "unknown" or len(meta["git_commit"]) == 40
    ctx = devices.make_context(GPU, quick=True)
    document = runner.build_document(meta, tiny_settings(), ctx, [])
    assert schema.validate(document) == []


def test_git_state_outside_a_repository_is_unknown(tmp_path):
    assert metadata.git_state(tmp_path) == ("unknown", None)


# --------------------------------------------------------------------------- timing


def test_device_is_synced_before_every_clock_read_on_gpu():
    log: list[str] = []
    case = Case(
        "f",
        "c",
        {"a": lambda: log.append("call a"), "b": lambda: log.append("call b")},
        sync=lambda: log.append("case sync"),
    )
    timings = measure(
        case, tiny_settings(), clock=FakeClock(log), device_sync=lambda: log.append("device sync")
    )
    reads = [i for i, event in enumerate(log) if event == "clock"]
    assert reads
    assert all(i > 0 and log[i - 1] == "device sync" for i in reads)
    calls = [i for i, event in enumerate(log) if event.startswith("call")]
    assert all(log[i + 1] == "case sync" for i in calls)
    assert [len(t.samples) for t in timings] == [3, 3]


def test_no_sync_on_cpu():
    log: list[str] = []
    case = Case("f", "c", {"a": lambda: log.append("call")}, sync=lambda: log.append("sync"))
    measure(case, tiny_settings(), clock=FakeClock(log), device_sync=None)
    assert "sync" not in log


def test_rounds_interleave_variants_and_rotate_the_order():
    order: list[str] = []
    variants = {name: (lambda n=name: order.append(n)) for name in "ABC"}
    settings = TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.0)
    timings = measure(Case("f", "c", variants), settings, clock=FakeClock([]))
    assert [t.calls_per_batch for t in timings] == [1, 1, 1]
    timed = order[-9:]  # After two warm-up calls per variant: three rounds of three.
    assert timed == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]


def test_a_case_can_take_a_multiple_of_the_rounds():
    calls: list[str] = []
    case = Case("f", "c", {"a": lambda: calls.append("a"), "b": lambda: None}, rounds_factor=4)
    settings = TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.0)
    timings = measure(case, settings, clock=FakeClock([]))
    assert [len(t.samples) for t in timings] == [12, 12]  # 3 rounds x 4
    assert calls.count("a") == 2 + 12  # two warm-up calls, then one per round


@pytest.mark.parametrize("factor", [0, -1, 2.0, True, None])
def test_a_bad_rounds_factor_fails_the_case_before_any_call(factor):
    calls: list[str] = []
    case = Case("f", "c", {"a": lambda: calls.append("a")}, rounds_factor=factor)
    with pytest.raises(ValueError, match=r"rounds_factor must be an int >= 1"):
        measure(case, tiny_settings(), clock=FakeClock([]))
    assert calls == []


def test_extra_figures_are_recorded_per_round():
    counter = iter(range(100))
    case = Case("f", "c", {"base": lambda: None, "x": lambda: {"lost": next(counter)}})
    timings = measure(case, tiny_settings(), clock=FakeClock([]))
    extra_x = timings[1].extra_rounds
    assert len(extra_x) == 3 and timings[1].extra == extra_x[-1]
    assert timings[0].extra == {}


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


# --------------------------------------------------------------------------- statistics


def test_interval_of_an_exact_multiple_is_that_multiple():
    rng = np.random.default_rng(0)
    reference = np.exp(rng.normal(0, 0.5, 25))  # very noisy rounds...
    interval = ratio_interval(1.3 * reference, reference)  # ...but always 1.3 times
    assert interval == pytest.approx((1.3, 1.3), rel=1e-12)


def coverage_and_widths(
    load: float, noise: float, datasets: int = 150, rounds: int = 25, true_ratio: float = 1.2
) -> tuple[float, float, float]:
    """Synthetic paired rounds: a per-round slow-down shared by both variants (the
    machine's load, log-normal with sigma ``load``) times independent noise (sigma
    ``noise``); the variant's true median is ``true_ratio`` times the reference's.
    Returns the fraction of intervals containing the true ratio, and the median width
    of the intervals with the rounds paired and with the pairing broken."""
    rng = np.random.default_rng(1)
    covered, paired, unpaired = 0, [], []
    for _ in range(datasets):
        shared = np.exp(rng.normal(0, load, rounds))
        reference = shared * np.exp(rng.normal(0, noise, rounds))
        variant = true_ratio * shared * np.exp(rng.normal(0, noise, rounds))
        low, high = ratio_interval(variant, reference, resamples=2000)
        covered += low <= true_ratio <= high
        paired.append(high - low)
        low, high = ratio_interval(variant, rng.permutation(reference), resamples=2000)
        unpaired.append(high - low)
    return covered / datasets, float(np.median(paired)), float(np.median(unpaired))


def test_interval_covers_the_true_ratio_about_95_percent():
    coverage, _, _ = coverage_and_widths(load=0.0, noise=0.1)
    assert 0.90 <= coverage <= 0.995


def test_pairing_cancels_the_load_shared_by_a_round():
    """With a large load shared by both variants of a round, the paired intervals still
    cover the true ratio (conservatively) and are far narrower than with the pairing
    broken (which is what an unpaired comparison of two separate runs would give)."""
    coverage, paired, unpaired = coverage_and_widths(load=0.4, noise=0.03)
    assert coverage >= 0.90
    assert paired < 0.5 * unpaired


def test_interval_is_reproducible_and_needs_three_paired_rounds():
    a, b = [1.0, 1.2, 1.1, 1.3], [1.0, 1.0, 1.1, 0.9]
    assert ratio_interval(a, b) == ratio_interval(a, b)
    assert ratio_interval(a[:2], b[:2]) is None
    with pytest.raises(ValueError, match="paired"):
        ratio_interval(a, b[:3])
    with pytest.raises(ValueError, match="add up"):
        ratio_interval(a, b, blocks=[2, 1])


def test_one_repetition_is_the_one_stage_bootstrap_and_empty_blocks_are_ignored():
    rng = np.random.default_rng(3)
    a, b = np.exp(rng.normal(0, 0.2, 20)), np.exp(rng.normal(0, 0.2, 20))
    assert ratio_interval(a, b, blocks=[20]) == ratio_interval(a, b)
    assert ratio_interval(a, b, blocks=[0, 20, 0]) == ratio_interval(a, b)


def test_repetitions_are_drawn_whole_before_their_rounds():
    """Two repetitions whose ratios are constant and differ (2.0, then 1.0): a resample
    that draws the first one twice reads 2.0, the second twice 1.0 (a quarter of the
    resamples each), so the interval spans both. Resampling rounds only within each
    repetition keeps one of each in every resample and gives a single value."""
    a = [2.0] * 5 + [1.0] * 5
    b = [1.0] * 10
    assert ratio_interval(a, b, blocks=[5, 5]) == (1.0, 2.0)
    # Unequal repetitions: each drawn one contributes as many rounds as it holds.
    assert ratio_interval([2.0] * 3 + [1.0] * 7, b, blocks=[3, 7]) == (1.0, 2.0)


def pooled_coverage_and_width(
    between: float, noise: float = 0.1, datasets: int = 150, passes: int = 5, rounds: int = 25
) -> tuple[float, float, float]:
    """Synthetic ``--repeat`` runs: in each of ``passes`` repetitions the variant runs in a
    mode of its own (a factor log-normal with sigma ``between``, median 1), and every
    round has independent noise (sigma ``noise``); the true ratio is 1.2. Returns the
    fraction of pooled intervals containing it, and the median widths of the pooled
    intervals and of the same rounds taken as one repetition."""
    rng = np.random.default_rng(2)
    covered, pooled, single = 0, [], []
    for _ in range(datasets):
        modes = np.repeat(np.exp(rng.normal(0, between, passes)), rounds)
        reference = np.exp(rng.normal(0, noise, passes * rounds))
        variant = 1.2 * modes * np.exp(rng.normal(0, noise, passes * rounds))
        low, high = ratio_interval(variant, reference, [rounds] * passes, resamples=2000)
        covered += low <= 1.2 <= high
        pooled.append(high - low)
        low, high = ratio_interval(variant, reference, resamples=2000)
        single.append(high - low)
    return covered / datasets, float(np.median(pooled)), float(np.median(single))


def test_pooled_interval_covers_the_ratio_when_repetitions_differ():
    """Five repetitions whose modes spread as much as the rounds' noise (sigma 0.1 each):
    the two-stage interval covered the true ratio in 85% of the synthetic runs (five
    repetitions are few clusters, so below 95%); resampling rounds only within each
    repetition covered it in 49% (its intervals ignore the spread between repetitions)."""
    coverage, _, _ = pooled_coverage_and_width(between=0.1)
    assert coverage >= 0.75


def test_pooled_interval_of_agreeing_repetitions_is_not_much_wider():
    """Repetitions without modes of their own: the two-stage interval covers the ratio
    (conservatively) and is at most 1.5 times as wide as the one-stage interval of the
    same rounds (1.29 measured)."""
    coverage, pooled, single = pooled_coverage_and_width(between=0.0)
    assert coverage >= 0.95
    assert pooled <= 1.5 * single


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


def test_pool_concatenates_repetitions_and_records_blocks():
    first = [
        VariantTiming("base", 3, [1.0, 2.0], [{}, {}], [2], [3]),
        VariantTiming("x", 5, [2.0, 4.0], [{"n": 1}, {"n": 2}], [2], [5]),
    ]
    second = [
        VariantTiming("base", 4, [3.0, 3.0, 3.0], [{}] * 3, [3], [4]),
        VariantTiming("x", 6, [6.0, 6.0, 6.0], [{"n": 3}] * 3, [3], [6]),
    ]
    base, x = pool([first, second])
    assert x.samples == [2.0, 4.0, 6.0, 6.0, 6.0] and x.rounds == [2, 3]
    assert x.calls_per_batch_blocks == [5, 6] and x.extra == {"n": 3}
    assert base.median == 3.0 and x.median == 6.0
    result = runner.case_result(Case("f", "c", {"base": int, "x": int}), "f", [base, x], 1.0)
    assert result["repetitions"] == 2
    assert result["variants"][1]["rounds_per_repetition"] == [2, 3]
    assert result["variants"][1]["ratio_to_baseline_ci_95"] == [2.0, 2.0]


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


def test_goal_forms():
    assert goal_spec(("v", 1.1)) == ("v", "<=", 1.1)
    assert goal_spec(("v", ">=", 2)) == ("v", ">=", 2.0)
    for bad in (("v",), ("v", "<", 1.0), ("v", 0.0), ("v", True), (1, 1.0)):
        with pytest.raises(ValueError):
            goal_spec(bad)


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


# --------------------------------------------------------------------------- runner


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
    assert "[repetition 3/3][1/1 counted]" in progress.getvalue()
    with pytest.raises(ValueError):
        runner.run_families(
            selected, devices.make_context(CPU, True), tiny_settings(), progress=progress, repeat=0
        )


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


# --------------------------------------------------------------------------- schema, plots


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


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def thread_family(workloads: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A family result with one case per (workload, thread count)."""
    cases = []
    for workload, counts in workloads.items():
        for threads in counts:
            cases.append(
                {
                    "name": f"{workload}/{threads}",
                    "status": "ok",
                    "params": {"op": workload, "threads": threads},
                    "variants": [
                        {"name": n, "ops_per_s": 1000.0 * threads / (i + 1)}
                        for i, n in enumerate(("plain", "safe"))
                    ],
                }
            )
    return {"name": "fam", "cases": cases}


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


def test_data_pipelines_live_from_their_first_call_to_the_case_teardown():
    # A live pipeline runs threads of its own: none may run while another case is timed.
    (batched, elements) = bench_data.cases(devices.make_context(CPU, quick=True))
    for case, instances in ((batched, 1), (elements, bench_data.INSTANCES)):
        pipelines = list(case.variants.values())
        assert all(not p._reads for p in pipelines)  # nothing built with the case
        assert all(math.isfinite(p()) for p in pipelines)  # a sum of features
        assert all(len(p._reads) == instances for p in pipelines)
        case.teardown()
        assert all(not p._reads for p in pipelines)


def test_data_pipeline_instances_are_read_in_blocks_after_a_warm_up():
    calls: list[int] = []
    built: list[int] = []

    def build():
        index = len(built)
        built.append(index)

        def read() -> int:
            calls.append(index)
            return index

        return read

    pipeline = bench_data._Pipeline(build, instances=3, calls_per_instance=2)
    read = [pipeline() for _ in range(7)]
    assert built == [0, 1, 2]
    assert calls[: 2 * bench_data.WARMUP_CALLS] == [1] * bench_data.WARMUP_CALLS + [2] * (
        bench_data.WARMUP_CALLS
    )  # instances after the first warmed at the first call
    assert read == [0, 0, 1, 1, 2, 2, 0]


def test_format_seconds():
    assert report.format_seconds(1.5e-5) == "15 µs"
    assert report.format_seconds(0.00234) == "2.34 ms"
    assert report.format_seconds(None) == "n/a"


# --------------------------------------------------------------------------- the suite


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench") / "results"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", *TINY, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUITE_TIMEOUT,
    )
    return completed, out


def test_quick_suite_runs_every_family_and_writes_valid_results(quick_run):
    completed, out = quick_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    expected = [f.name for f in discovery.select(discovery.discover(), None)]
    assert [f["name"] for f in document["families"]] == expected
    for family in document["families"]:
        assert family["status"] == "ok", family["error"]
        assert family["cases"], family["name"]
        for case in family["cases"]:
            assert case["status"] == "ok" and case["variants"][0]["baseline"]
            factor = bench_data.ROUNDS_FACTOR if family["name"] == "data" else 1
            for variant in case["variants"]:
                assert len(variant["samples_s"]) == 2 * factor  # --rounds 2
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
        model.case_name: model.mutex_reference for model in bench_accumulator.MODELS
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
    assert width <= 3 * 5 * plots.DPI and height <= 2 * 3.6 * plots.DPI  # a few panels
    assert "| case | variant | median |" in markdown
    assert "x baseline [95% CI]" in completed.stdout and "assign_add/scalar" in completed.stdout
    assert "[1/" in completed.stderr and "eager" in completed.stderr
