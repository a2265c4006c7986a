"""Timing a case and the statistics of its rounds (:mod:`benchmarks.timing`).

Fake clocks and synthetic samples with known properties: nothing is timed.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import runner
from benchmarks.case import Case
from benchmarks.timing import TimingSettings, VariantTiming, measure, pool, ratio_interval
from tests.support.benchmark_fakes import FakeClock, tiny_settings


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
