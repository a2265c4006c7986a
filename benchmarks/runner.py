"""Running the selected families: build each family's cases, time them, collect results.

A family that fails to import, whose ``cases(ctx)`` raises, or one of whose cases raises
is recorded as failed (with the error and traceback) and the run goes on; the caller
decides the exit code from the document's ``status`` at the end.
"""

from __future__ import annotations

import gc
import math
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from benchmarks.case import Case, Context
from benchmarks.discovery import FamilyInfo, load_cases_function
from benchmarks.report import format_seconds
from benchmarks.schema import SCHEMA_VERSION
from benchmarks.timing import TimingSettings, VariantTiming, measure

__all__ = ["build_document", "case_result", "run_families"]


def _failure(error: BaseException) -> tuple[str, str]:
    return f"{type(error).__name__}: {error}", "".join(traceback.format_exception(error))


def _goal(case: Case, variants: list[dict[str, Any]], family: str) -> dict[str, Any] | None:
    if case.goal is None:
        return None
    variant, max_ratio = case.goal
    reference = case.goal_reference or (variants[0]["name"] if variants else "")
    medians = {v["name"]: v["median_s"] for v in variants}
    ratio = None
    if variant in medians and medians.get(reference):
        ratio = medians[variant] / medians[reference]
    versus = {
        name: medians[variant] / median
        for name, median in medians.items()
        if name != variant and median and variant in medians
    }
    return {
        "family": family,
        "case": case.name,
        "variant": variant,
        "reference": reference,
        "max_ratio": float(max_ratio),
        "ratio": ratio,
        "met": None if ratio is None else ratio <= max_ratio,
        "versus": versus,
    }


def case_result(
    case: Case,
    family: str,
    timings: Sequence[VariantTiming],
    duration: float,
    error: BaseException | None = None,
) -> dict[str, Any]:
    """The ``case`` object of ``results.json`` for one measured (or failed) case."""
    ops = max(1, int(case.ops_per_call))
    baseline = timings[0].median if timings else None
    variants = []
    for index, t in enumerate(timings):
        median, low, high = t.median, min(t.samples), max(t.samples)
        variants.append({
            "name": t.name,
            "baseline": index == 0,
            "calls_per_batch": t.calls_per_batch,
            "samples_s": list(t.samples),
            "median_s": median,
            "min_s": low,
            "max_s": high,
            "per_op_median_s": median / ops,
            "per_op_min_s": low / ops,
            "per_op_max_s": high / ops,
            "ops_per_s": ops / median if median > 0 else 0.0,
            "ratio_to_baseline": median / baseline if baseline else None,
            "extra": _jsonable(t.extra),
            "extra_rounds": [_jsonable(e) for e in t.extra_rounds],
        })
    summary, trace = _failure(error) if error is not None else (None, None)
    return {
        "name": case.name,
        "status": "failed" if error is not None else "ok",
        "error": summary,
        "traceback": trace,
        "params": _jsonable(case.params),
        "ops_per_call": ops,
        "baseline": next(iter(case.variants), None),
        "duration_s": duration,
        "variants": variants,
        "goal": _goal(case, variants, family) if error is None else None,
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
            parts.append(f"{v['name']} x{v['ratio_to_baseline']:.2f}")
    return ", ".join(parts)


def _run_case(
    case: Case,
    family: str,
    settings: TimingSettings,
    clock: Callable[[], float],
    device_sync: Callable[[], Any] | None,
) -> dict[str, Any]:
    started = time.perf_counter()
    timings: list[VariantTiming] = []
    error: BaseException | None = None
    try:
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
    return case_result(case, family, timings, time.perf_counter() - started, error)


def run_families(
    families: Sequence[FamilyInfo],
    ctx: Context,
    settings: TimingSettings,
    progress: TextIO,
    clock: Callable[[], float] = time.perf_counter,
    device_sync: Callable[[], Any] | None = None,
    load: Callable[[FamilyInfo], Callable[[Context], list[Case]]] = load_cases_function,
) -> list[dict[str, Any]]:
    """Runs every family in order and returns their ``family`` objects.

    Args:
      families: The selected families.
      ctx: Handed to every family's ``cases``.
      settings: Rounds and durations.
      progress: Where progress lines go (stderr).
      clock: Seconds, monotonic.
      device_sync: Called before every clock read (GPU), or ``None``.
      load: Imports a family and returns its ``cases`` function (injectable).
    """
    results = []
    for number, info in enumerate(families, 1):
        started = time.perf_counter()
        record: dict[str, Any] = {
            "name": info.name,
            "description": info.description,
            "module": info.module,
            "default": info.default,
            "status": "ok",
            "error": None,
            "traceback": None,
            "duration_s": 0.0,
            "cases": [],
        }
        prefix = f"[{number}/{len(families)} {info.name}]"
        print(f"{prefix} {info.description}".rstrip(), file=progress, flush=True)
        try:
            cases = list(load(info)(ctx))
            bad = [c for c in cases if not isinstance(c, Case) or not c.variants]
            if bad:
                raise TypeError(
                    f"cases(ctx) must return Case objects with at least one variant; got "
                    f"{bad[0]!r}"
                )
        except Exception as e:  # noqa: BLE001 - the family is reported as failed
            record["status"] = "failed"
            record["error"], record["traceback"] = _failure(e)
            print(f"{prefix} FAILED: {record['error']}", file=progress, flush=True)
            cases = []
        for index, case in enumerate(cases, 1):
            print(f"{prefix} ({index}/{len(cases)}) {case.name} ...", end="", file=progress,
                  flush=True)
            result = _run_case(case, info.name, settings, clock, device_sync)
            record["cases"].append(result)
            print(f" {result['duration_s']:.1f} s: {_one_line(result)}", file=progress,
                  flush=True)
            if result["status"] != "ok":
                record["status"] = "failed"
                if record["error"] is None:
                    record["error"] = f"case {case.name!r}: {result['error']}"
        del cases
        gc.collect()
        record["duration_s"] = time.perf_counter() - started
        results.append(record)
    return results


def build_document(
    metadata: dict[str, Any],
    settings: TimingSettings,
    ctx: Context,
    families: list[dict[str, Any]],
) -> dict[str, Any]:
    """The whole ``results.json`` document (see :mod:`benchmarks.schema`)."""
    goals = [c["goal"] for f in families for c in f["cases"] if c["goal"] is not None]
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "failed" if any(f["status"] != "ok" for f in families) else "ok",
        "metadata": metadata,
        "settings": {
            "rounds": settings.rounds,
            "warmup_time_s": settings.warmup_time,
            "min_batch_time_s": settings.min_batch_time,
            "sizes": list(ctx.sizes),
            "threads": list(ctx.threads),
            "families_selected": [f["name"] for f in families],
        },
        "families": families,
        "goals": goals,
    }
