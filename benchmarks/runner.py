"""Running the selected families: build each family's cases, time them, collect results.

A family that fails to import, whose ``cases(ctx)`` raises, or one of whose cases raises
is recorded as failed (with the error and traceback) and the run goes on; the caller
decides the exit code from the document's ``status`` at the end.

``--repeat N`` runs the selected families N times, one whole pass after another (each
pass builds every case afresh: new variables, new traces), and pools each case's rounds
over the passes (:func:`benchmarks.timing.pool`): medians are taken over all rounds, and
the confidence intervals resample the passes, then rounds within each drawn pass. A case
that fails in any pass is reported as failed.

Every ratio comes with its 95% confidence interval (:func:`benchmarks.timing.ratio_interval`),
and a goal's verdict with it (:func:`verdict`).

Progress goes to ``progress`` (stderr), one line per case, written in two parts: the
case's name before it runs, its figures after. What Python's logging and
:mod:`warnings` print while it runs (a TensorFlow retracing warning, say) is held until
the line is complete, then printed on lines of its own (:mod:`benchmarks.logs`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from benchmarks import logs
from benchmarks.case import Case, Context, goal_spec
from benchmarks.discovery import FamilyInfo, load_cases_function
from benchmarks.report import format_interval, format_seconds
from benchmarks.schema import SCHEMA_VERSION
from benchmarks.timing import (
    CI_LEVEL,
    MIN_ROUNDS_FOR_INTERVAL,
    RESAMPLES,
    SEED,
    TimingSettings,
    VariantTiming,
    measure,
    pool,
    ratio_interval,
    repetition_ratios,
)

__all__ = ["CI_METHOD", "build_document", "case_result", "run_families", "verdict"]

CI_METHOD = (
    "paired bootstrap of the ratio of medians: rounds resampled with replacement "
    "(the same rounds for both variants; when repetitions are pooled, two stages: "
    "repetitions drawn with replacement, then rounds within each), "
    f"{RESAMPLES} resamples, percentile interval"
)

VERDICTS = ("met", "missed", "inconclusive", "not measured")


def _failure(error: BaseException) -> tuple[str, str]:
    return f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error))


def verdict(
    operator: str, bound: float, ratio: float | None, interval: tuple[float, float] | None
) -> str:
    """A goal's verdict from the ratio's confidence interval.

    For ``ratio <= bound``: "met" when the interval's upper end is at or below the bound,
    "missed" when its lower end is above it; for ``ratio >= bound`` the mirror image (met
    when the lower end is at or above, missed when the upper end is below). Otherwise,
    or without an interval (too few rounds), "inconclusive"; without a ratio, "not
    measured".
    """
    if ratio is None:
        return "not measured"
    if interval is None:
        return "inconclusive"
    low, high = interval
    if operator == "<=":
        if high <= bound:
            return "met"
        if low > bound:
            return "missed"
    elif operator == ">=":
        if low >= bound:
            return "met"
        if high < bound:
            return "missed"
    else:
        raise ValueError(f"operator must be '<=' or '>=', got {operator!r}.")
    return "inconclusive"


def _interval(a: VariantTiming, b: VariantTiming) -> tuple[float, float] | None:
    try:
        return ratio_interval(a.samples, b.samples, a.rounds)
    except ValueError:  # not paired (a variant missing from some repetition)
        return None


def _per_repetition(a: VariantTiming, b: VariantTiming) -> list[float | None]:
    try:
        return repetition_ratios(a.samples, b.samples, a.rounds)
    except ValueError:  # not paired (a variant missing from some repetition)
        return []


def _pair(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else [interval[0], interval[1]]


def _goal(case: Case, timings: Sequence[VariantTiming], family: str) -> dict[str, Any] | None:
    if case.goal is None:
        return None
    variant, operator, bound = goal_spec(case.goal)
    by_name = {t.name: t for t in timings}
    reference = case.goal_reference or (timings[0].name if timings else "")
    medians = {t.name: t.median for t in timings if t.samples}
    ratio = interval = None
    per_repetition: list[float | None] = []
    if variant in medians and medians.get(reference):
        ratio = medians[variant] / medians[reference]
        interval = _interval(by_name[variant], by_name[reference])
        per_repetition = _per_repetition(by_name[variant], by_name[reference])
    versus: dict[str, float] = {}
    versus_ci: dict[str, list[float] | None] = {}
    if variant in medians:
        for name, median in medians.items():
            if name != variant and median:
                versus[name] = medians[variant] / median
                versus_ci[name] = _pair(_interval(by_name[variant], by_name[name]))
    outcome = verdict(operator, bound, ratio, interval)
    return {
        "family": family,
        "case": case.name,
        "variant": variant,
        "reference": reference,
        "operator": operator,
        "bound": bound,
        "max_ratio": bound if operator == "<=" else None,
        "ratio": ratio,
        "ratio_ci_95": _pair(interval),
        "ratio_per_repetition": per_repetition,
        "verdict": outcome,
        "met": {"met": True, "missed": False}.get(outcome),
        "rounds": len(by_name[variant].samples) if variant in by_name else 0,
        "versus": versus,
        "versus_ci_95": versus_ci,
    }


def case_result(
    case: Case,
    family: str,
    timings: Sequence[VariantTiming],
    duration: float,
    error: BaseException | None = None,
) -> dict[str, Any]:
    """The ``case`` object of ``results.json`` for one measured (or failed) case.

    ``timings`` are one run's (:func:`benchmarks.timing.measure`) or several runs'
    pooled (:func:`benchmarks.timing.pool`).
    """
    ops = max(1, int(case.ops_per_call))
    base = timings[0] if timings else None
    variants = []
    for index, t in enumerate(timings):
        median, low, high = t.median, min(t.samples), max(t.samples)
        interval = None if index == 0 or base is None else _interval(t, base)
        if index == 0:
            interval = (1.0, 1.0)
        variants.append(
            {
                "name": t.name,
                "baseline": index == 0,
                "calls_per_batch": t.calls_per_batch,
                "calls_per_batch_repetitions": list(t.calls_per_batch_blocks)
                or [t.calls_per_batch],
                "rounds": len(t.samples),
                "rounds_per_repetition": t.rounds,
                "samples_s": list(t.samples),
                "median_s": median,
                "min_s": low,
                "max_s": high,
                "per_op_median_s": median / ops,
                "per_op_min_s": low / ops,
                "per_op_max_s": high / ops,
                "ops_per_s": ops / median if median > 0 else 0.0,
                "ratio_to_baseline": median / base.median if base and base.median else None,
                "ratio_to_baseline_ci_95": _pair(interval) if base and base.median else None,
                "extra": _jsonable(t.extra),
                "extra_rounds": [_jsonable(e) for e in t.extra_rounds],
            }
        )
    summary, trace = _failure(error) if error is not None else (None, None)
    return {
        "name": case.name,
        "status": "failed" if error is not None else "ok",
        "error": summary,
        "traceback": trace,
        "params": _jsonable(case.params),
        "ops_per_call": ops,
        "baseline": next(iter(case.variants), None),
        "repetitions": len(timings[0].rounds) if timings else 0,
        "duration_s": duration,
        "variants": variants,
        "goal": _goal(case, timings, family) if error is None else None,
    }


def _jsonable(value: Any) -> Any:
    """``value`` as JSON: NumPy/TensorFlow scalars become numbers, NaN/inf become null."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    for convert in ("numpy", "tolist"):
        method = getattr(value, convert, None)
        if callable(method):
            try:
                return _jsonable(method())
            except Exception:  # noqa: BLE001 - fall back to repr
                break
    return repr(value)


def _one_line(result: dict[str, Any]) -> str:
    if result["status"] != "ok":
        return f"FAILED: {result['error']}"
    parts = []
    for v in result["variants"]:
        if v["baseline"]:
            parts.append(f"{v['name']} {format_seconds(v['per_op_median_s'])}/op")
        else:
            parts.append(
                f"{v['name']} x{v['ratio_to_baseline']:.2f} "
                f"{format_interval(v['ratio_to_baseline_ci_95'])}".rstrip()
            )
    return ", ".join(parts)


@dataclasses.dataclass
class _CaseRuns:
    """One case over the repetitions: its first Case (for its metadata) and each run."""

    case: Case
    runs: list[list[VariantTiming]] = dataclasses.field(default_factory=list)
    duration: float = 0.0
    error: BaseException | None = None

    def result(self, family: str) -> dict[str, Any]:
        if self.error is not None or not self.runs:
            return case_result(self.case, family, [], self.duration, self.error)
        return case_result(self.case, family, pool(self.runs), self.duration)


def _run_case(
    case: Case,
    settings: TimingSettings,
    clock: Callable[[], float],
    device_sync: Callable[[], Any] | None,
) -> tuple[list[VariantTiming], float, BaseException | None]:
    started = time.perf_counter()
    timings: list[VariantTiming] = []
    error: BaseException | None = None
    try:
        if case.goal is not None:
            goal_spec(case.goal)  # a malformed goal fails its case, not the run
        timings = measure(case, settings, clock=clock, device_sync=device_sync)
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        error = e
    finally:
        if case.teardown is not None:
            try:
                case.teardown()
            except Exception as e:  # noqa: BLE001
                error = error or e
    if error is not None:
        timings = []
    return timings, time.perf_counter() - started, error


def _new_record(info: FamilyInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "description": info.description,
        "module": info.module,
        "default": info.default,
        "plot_against": info.plot_against,
        "status": "ok",
        "error": None,
        "traceback": None,
        "duration_s": 0.0,
        "cases": [],
    }


def run_families(
    families: Sequence[FamilyInfo],
    ctx: Context,
    settings: TimingSettings,
    progress: TextIO,
    clock: Callable[[], float] = time.perf_counter,
    device_sync: Callable[[], Any] | None = None,
    load: Callable[[FamilyInfo], Callable[[Context], list[Case]]] = load_cases_function,
    repeat: int = 1,
) -> list[dict[str, Any]]:
    """Runs every family in order, ``repeat`` times, and returns their ``family`` objects.

    Args:
      families: The selected families.
      ctx: Handed to every family's ``cases``.
      settings: Rounds and durations (per repetition).
      progress: Where progress lines go (stderr).
      clock: Seconds, monotonic.
      device_sync: Called before every clock read (GPU), or ``None``.
      load: Imports a family and returns its ``cases`` function (injectable).
      repeat: Passes over all the families; each case's rounds are pooled over them
        (see the module docstring).

    Raises:
      ValueError: ``repeat`` < 1.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}.")
    records = {info.name: _new_record(info) for info in families}
    runs: dict[str, dict[str, _CaseRuns]] = {info.name: {} for info in families}
    for repetition in range(1, repeat + 1):
        for number, info in enumerate(families, 1):
            record, by_case = records[info.name], runs[info.name]
            started = time.perf_counter()
            prefix = f"[{number}/{len(families)} {info.name}]"
            if repeat > 1:
                prefix = f"[repetition {repetition}/{repeat}]{prefix}"
            print(f"{prefix} {info.description}".rstrip(), file=progress, flush=True)
            try:
                cases = list(load(info)(ctx))
                bad = [c for c in cases if not isinstance(c, Case) or not c.variants]
                if bad:
                    raise TypeError(
                        f"cases(ctx) must return Case objects with at least one variant; "
                        f"got {bad[0]!r}"
                    )
            except Exception as e:  # noqa: BLE001 - the family is reported as failed
                record["status"] = "failed"
                if record["error"] is None:
                    record["error"], record["traceback"] = _failure(e)
                print(f"{prefix} FAILED: {_failure(e)[0]}", file=progress, flush=True)
                cases = []
            for index, case in enumerate(cases, 1):
                print(
                    f"{prefix} ({index}/{len(cases)}) {case.name} ...",
                    end="",
                    file=progress,
                    flush=True,
                )
                with logs.held() as held:  # nothing lands inside the progress line
                    timings, duration, error = _run_case(case, settings, clock, device_sync)
                entry = by_case.setdefault(case.name, _CaseRuns(case))
                entry.duration += duration
                if error is not None:
                    entry.error = entry.error or error
                else:
                    entry.runs.append(timings)
                line = case_result(case, info.name, timings, duration, error)
                print(f" {duration:.1f} s: {_one_line(line)}", file=progress, flush=True)
                held.replay()
            del cases
            gc.collect()
            record["duration_s"] += time.perf_counter() - started
    results = []
    for info in families:
        record = records[info.name]
        record["cases"] = [entry.result(info.name) for entry in runs[info.name].values()]
        for case in record["cases"]:
            if case["status"] != "ok":
                record["status"] = "failed"
                if record["error"] is None:
                    record["error"] = f"case {case['name']!r}: {case['error']}"
        results.append(record)
    return results


def build_document(
    metadata: dict[str, Any],
    settings: TimingSettings,
    ctx: Context,
    families: list[dict[str, Any]],
    repeat: int = 1,
) -> dict[str, Any]:
    """The whole ``results.json`` document (see :mod:`benchmarks.schema`)."""
    goals = [c["goal"] for f in families for c in f["cases"] if c["goal"] is not None]
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "failed" if any(f["status"] != "ok" for f in families) else "ok",
        "metadata": metadata,
        "settings": {
            "rounds": settings.rounds,
            "repeat": repeat,
            "warmup_time_s": settings.warmup_time,
            "min_batch_time_s": settings.min_batch_time,
            "sizes": list(ctx.sizes),
            "threads": list(ctx.threads),
            "families_selected": [f["name"] for f in families],
            "confidence_interval": {
                "level": CI_LEVEL,
                "method": CI_METHOD,
                "resamples": RESAMPLES,
                "seed": SEED,
                "min_rounds": MIN_ROUNDS_FOR_INTERVAL,
            },
        },
        "families": families,
        "goals": goals,
    }
