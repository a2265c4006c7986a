"""The progress lines' time elapsed and estimate of the time left (:mod:`benchmarks.progress`)."""

from __future__ import annotations

import pytest

from benchmarks.progress import Estimate, format_duration


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0:00"), (7.4, "0:07"), (59.6, "1:00"), (250, "4:10"), (3723, "1:02:03"), (-3, "0:00")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_the_estimate_scales_what_is_left_by_the_pace_so_far():
    # Two families expected to take 10 s and 30 s; the run goes twice as slowly.
    estimate = Estimate([10.0, 30.0], "full", repeat=1, started=100.0)
    assert estimate.left(100.0) == 40.0  # nothing done yet: as expected
    estimate.start_family(0, cases=2)
    estimate.case_done(measured=True)  # 5 s of expected work, in 10 s
    assert estimate.left(110.0) == pytest.approx((40.0 - 5.0) * 2.0)
    estimate.case_done(measured=True)
    estimate.end_family(0)
    estimate.start_family(1, cases=3)
    assert estimate.left(120.0) == pytest.approx(30.0 * 2.0)
    assert estimate.line(120.0) == "0:20 elapsed, ~1:00 left"
    estimate.case_done(measured=True)
    estimate.case_done(measured=True)
    estimate.case_done(measured=True)
    estimate.end_family(1)
    assert estimate.left(180.0) == 0.0


def test_skipped_cases_count_as_done_but_not_in_the_pace():
    estimate = Estimate([10.0, 10.0], "full", repeat=1, started=0.0)
    estimate.start_family(0, cases=2)
    estimate.case_done(measured=False)  # kept from the run being resumed: no time
    estimate.case_done(measured=False)
    estimate.end_family(0)
    assert estimate.left(1.0) == 10.0  # no measured work yet: the expected time
    estimate.start_family(1, cases=2)
    estimate.case_done(measured=True)  # 5 s expected, took 2.5 s
    assert estimate.left(3.5) == pytest.approx(5.0 * (3.5 / 5.0))


def test_a_family_without_seconds_counts_as_the_average_and_repeats_multiply():
    estimate = Estimate([10.0, None, 30.0], "full", repeat=2, started=0.0)
    assert estimate.left(0.0) == (10.0 + 20.0 + 30.0) * 2
    assert Estimate([None], "quick", repeat=1, started=0.0).left(0.0) == 3.0
    # A family that failed before its cases counts as done when it ends.
    estimate.start_family(0, cases=0)
    estimate.end_family(0)
    assert estimate.left(0.0) == 110.0
