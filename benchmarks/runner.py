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

Memory: a case is held no longer than its turn. The runner builds it (a
:class:`~benchmarks.case.LazyCase` is built only then), measures it, runs its teardown,
drops it (its result keeps the variants' names, not the callables, nor the models and
traced functions they closed over), then calls :func:`release_memory`
(``keras.backend.clear_session()`` and a garbage collection). A run's resident memory
is that of its largest case, not the sum of all of them (issue 44: the full run reached
8.6 GB when every case stayed alive until the end).

Nothing is lost when a run stops: after every case, ``checkpoint`` gets the families'
results so far (the CLI writes them, see :mod:`benchmarks.cli`), and a run continued
with ``--resume`` (``previous``) skips the cases it already has (:mod:`benchmarks.resume`).

Progress goes to ``progress`` (stderr), one line per case, written in two parts: the
case's name before it runs, its figures after; each starts with the time elapsed and
an estimate of the time left (:mod:`benchmarks.progress`). What Python's logging and
:mod:`warnings` print while it runs (a TensorFlow retracing warning, say) is held until
the line is complete, then printed on lines of its own (:mod:`benchmarks.logs`).

Each case's ``phases_s`` says where its wall time went: building it, the variants'
first calls (tracing), the rest of the warm-up, the timed rounds, and releasing memory;
its ``memory_mb``, the process's resident memory once the case was released and the
peak so far (so a run shows which case raised the peak).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

try:
    import resource
except ImportError:  # pragma: no cover - not on Windows
    pass

from benchmarks import logs, resume
from benchmarks.case import Case, Context, LazyCase, goal_spec
from benchmarks.discovery import FamilyInfo, load_cases_function
from benchmarks.progress import Estimate
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

__all__ = [
    "CI_METHOD",
    "PHASES",
    "build_document",
    "case_result",
    "memory_mb",
    "release_memory",
    "run_families",
    "verdict",
]

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
    phases: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The ``case`` object of ``results.json`` for one measured (or failed) case.

    ``timings`` are one run's (:func:`benchmarks.timing.measure`) or several runs'
    pooled (:func:`benchmarks.timing.pool`). ``phases``: seconds of each of
    :data:`PHASES` (building the case, the variants' first calls, the rest of their
    warm-up, the timed rounds, releasing memory), recorded as ``phases_s``.
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
        "phases_s": {k: round(v, 4) for k, v in (phases or {}).items()},
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


#: The phases of a case's wall time recorded in ``phases_s`` (see :func:`case_result`).
PHASES = ("build", "first_call", "warmup", "rounds", "release")


@dataclasses.dataclass
class _CaseRuns:
    """One case over the repetitions: what its result needs, each run, and the result.

    ``spec`` is the first :class:`Case` built for it with its callables dropped (the
    variants' names only, no teardown): the models and functions the variants closed
    over are not kept once the case was measured. ``kept`` is a finished case of the
    run being resumed, reported as it was.
    """

    spec: Case | None = None
    runs: list[list[VariantTiming]] = dataclasses.field(default_factory=list)
    duration: float = 0.0
    error: BaseException | None = None
    phases: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(PHASES, 0.0)
    )
    kept: dict[str, Any] | None = None
    recorded: dict[str, Any] | None = None  # the last result computed (the one reported)
    memory: dict[str, float] = dataclasses.field(default_factory=dict)

    def result(self, family: str) -> dict[str, Any]:
        """The case's result (computed once per new run: the bootstrap is not free)."""
        if self.recorded is None:
            if self.kept is not None:
                self.recorded = self.kept
            else:
                assert self.spec is not None
                timings = pool(self.runs) if self.runs and self.error is None else []
                self.recorded = case_result(
                    self.spec, family, timings, self.duration, self.error, self.phases
                )
                self.recorded["memory_mb"] = dict(self.memory)
        return self.recorded

    def add(self, spec: Case, timings: list[VariantTiming], duration: float, error: Any) -> None:
        """Records one repetition; ``spec`` as :func:`_spec` makes it."""
        if self.spec is None or not self.spec.variants:
            self.spec = spec
        self.duration += duration
        if error is not None:
            self.error = self.error or error
        else:
            self.runs.append(timings)
        self.recorded = None


def _spec(case: Case) -> Case:
    """``case`` without its callables: what :func:`case_result` reads."""
    return dataclasses.replace(
        case, variants=dict.fromkeys(case.variants, _dropped), sync=None, teardown=None
    )


def _dropped() -> None:  # pragma: no cover - never called
    raise RuntimeError("a measured case's variant was called again")


def release_memory() -> None:
    """Frees what a measured case left: Keras' global state (``clear_session``, which
    also clears TensorFlow's eager kernel cache), every unreachable object, and the C
    heap's free pages (``malloc_trim``, with glibc: freed tensors otherwise stay in the
    process's resident memory).

    Keras is only touched when something imported it.
    """
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.backend.clear_session(free_memory=False)
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    """Returns the C heap's free memory to the system (glibc's ``malloc_trim``; nothing
    elsewhere)."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else False
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def memory_mb() -> dict[str, float]:
    """The process's resident memory now and at its peak so far, in MB (Linux; empty
    elsewhere): recorded with each case (``memory_mb``), so a run shows which case
    raised its peak."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (OSError, ValueError, IndexError, NameError):
        return {}
    return {
        "rss": round(resident_pages * os.sysconf("SC_PAGE_SIZE") / 1e6, 1),
        "peak": round(peak_kb * 1024 / 1e6, 1),
    }


def _run_case(
    item: Case | LazyCase,
    settings: TimingSettings,
    clock: Callable[[], float],
    device_sync: Callable[[], Any] | None,
    phases: dict[str, float],
) -> tuple[Case | None, list[VariantTiming], float, BaseException | None]:
    """Builds (a :class:`LazyCase`), measures and tears down one case.

    Returns the case (None if it could not be built), its timings, the seconds it took
    and its error. ``phases`` gets the seconds of each phase added.
    """
    started = time.perf_counter()
    timings: list[VariantTiming] = []
    error: BaseException | None = None
    case: Case | None = None
    try:
        case = item.build() if isinstance(item, LazyCase) else item
        built = time.perf_counter()
        phases["build"] += built - started
        if not isinstance(case, Case) or not case.variants:
            raise TypeError(
                f"a LazyCase must build a Case with at least one variant; got {case!r}"
            )
        if case.goal is not None:
            goal_spec(case.goal)  # a malformed goal fails its case, not the run
        timings = measure(case, settings, clock=clock, device_sync=device_sync)
        warmup = sum(t.warmup_s for t in timings)
        phases["first_call"] += sum(t.first_call_s for t in timings)
        phases["warmup"] += warmup - sum(t.first_call_s for t in timings)
        phases["rounds"] += time.perf_counter() - built - warmup
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        error = e
    finally:
        if case is not None and case.teardown is not None:
            try:
                case.teardown()
            except Exception as e:  # noqa: BLE001
                error = error or e
    if error is not None:
        timings = []
    return case, timings, time.perf_counter() - started, error


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


class _Family:
    """One family over the repetitions: its record and its cases, in their order."""

    def __init__(self, info: FamilyInfo, previous: dict[str, Any] | None) -> None:
        self.info = info
        self.record = _new_record(info)
        self.order: list[str] = []
        self.cases: dict[str, _CaseRuns] = {}
        self.started = False
        self.previous: dict[str, dict[str, Any]] = {}
        if previous is not None:
            self.started = True
            self.record["duration_s"] = previous["duration_s"]
            for case in previous["cases"]:
                self.previous[case["name"]] = case
                self.order.append(case["name"])

    def entry(self, name: str, repeat: int) -> _CaseRuns:
        """The case's runs, started from the resumed run's figures if it has them."""
        if name not in self.cases:
            entry = _CaseRuns()
            old = self.previous.get(name)
            if old is not None:
                entry.duration = old["duration_s"]
                runs = resume.case_runs(old)
                if old["status"] != "ok" or len(runs) >= repeat:
                    entry.kept = old  # finished: reported as it was
                else:
                    entry.runs = runs
                    entry.phases.update(old.get("phases_s") or {})
                    entry.kept = old  # until a new repetition replaces it
            self.cases[name] = entry
            if name not in self.order:
                self.order.append(name)
        return self.cases[name]

    def done_before(self, name: str, repetition: int) -> bool:
        """Whether the resumed run already has repetition ``repetition`` of the case."""
        old = self.previous.get(name)
        if old is None:
            return False
        return old["status"] != "ok" or old["repetitions"] >= repetition

    def result(self) -> dict[str, Any]:
        """The family's record with every case recorded so far, in case order."""
        record = dict(self.record)
        cases = []
        for name in self.order:
            entry = self.cases.get(name)
            if entry is not None and (entry.kept is not None or entry.spec is not None):
                cases.append(entry.result(self.info.name))
            elif name in self.previous:
                cases.append(self.previous[name])
        record["cases"] = cases
        for case in cases:
            if case["status"] != "ok":
                record["status"] = "failed"
                if record["error"] is None:
                    record["error"] = f"case {case['name']!r}: {case['error']}"
        return record


def run_families(
    families: Sequence[FamilyInfo],
    ctx: Context,
    settings: TimingSettings,
    progress: TextIO,
    clock: Callable[[], float] = time.perf_counter,
    device_sync: Callable[[], Any] | None = None,
    load: Callable[[FamilyInfo], Callable[[Context], list[Case | LazyCase]]] = load_cases_function,
    repeat: int = 1,
    previous: Sequence[dict[str, Any]] = (),
    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
    release: Callable[[], None] = release_memory,
    numbering: Mapping[str, tuple[int, int]] | None = None,
    until: int | None = None,
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
      previous: The ``family`` objects of the run being resumed (``--resume``): their
        cases are not run again (see :mod:`benchmarks.resume`).
      checkpoint: Called after every case and every family with the ``family`` objects
        so far (the families started, each with the cases finished), to write them.
      release: Called after every case (and family) to free what it left
        (:func:`release_memory`).
      numbering: Each family's ``(number, of)`` in the progress lines, when they are a
        part of a larger run (default: their place in ``families``).
      until: Stop after this repetition (default: ``repeat``): one pass of a run whose
        passes are measured in processes of their own (the isolated families), each
        resuming what the one before wrote.

    Raises:
      ValueError: ``repeat`` < 1, or ``until`` not between 1 and ``repeat``.
      KeyboardInterrupt: the run was interrupted; the last ``checkpoint`` has every
        case that finished (the interrupted case's teardown has run).
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}.")
    last = repeat if until is None else until
    if isinstance(last, bool) or not isinstance(last, int) or not 1 <= last <= repeat:
        raise ValueError(f"until must be an int from 1 to repeat ({repeat}), got {until!r}.")
    before = {f["name"]: f for f in previous}
    state = {info.name: _Family(info, before.get(info.name)) for info in families}
    mode = "quick" if ctx.quick else "full"
    estimate = Estimate(
        [info.expected_seconds(mode) for info in families], mode, last, time.perf_counter()
    )

    def save() -> None:
        if checkpoint is not None:
            checkpoint([f.result() for f in state.values() if f.started])

    for repetition in range(1, last + 1):
        for number, info in enumerate(families, 1):
            family = state[info.name]
            family.started = True
            record = family.record
            started, earlier = time.perf_counter(), record["duration_s"]
            shown, of = (numbering or {}).get(info.name, (number, len(families)))
            prefix = f"[{shown}/{of} {info.name}]"
            if repeat > 1:
                prefix = f"[repetition {repetition}/{repeat}]{prefix}"
            print(
                f"{prefix} {info.description}".rstrip()
                + f" ({estimate.line(time.perf_counter())})",
                file=progress,
                flush=True,
            )
            try:
                build_cases = load(info)  # imports the family (and what it imports)
                # Every object alive now lives for the run (modules, TensorFlow's and
                # Keras' own): out of the collector's way, so that each release costs
                # what the cases left, not a walk over 300,000 objects (0.36 s).
                release()
                gc.freeze()
                cases: list[Case | LazyCase | None] = list(build_cases(ctx))
                bad: list[Any] = [c for c in cases if not isinstance(c, (Case, LazyCase))]
                bad += [c for c in cases if isinstance(c, Case) and not c.variants]
                if bad:
                    raise TypeError(
                        f"cases(ctx) must return Case objects with at least one variant, "
                        f"or LazyCase objects; got {bad[0]!r}"
                    )
            except Exception as e:  # noqa: BLE001 - the family is reported as failed
                record["status"] = "failed"
                if record["error"] is None:
                    record["error"], record["traceback"] = _failure(e)
                print(f"{prefix} FAILED: {_failure(e)[0]}", file=progress, flush=True)
                cases = []
            estimate.start_family(number - 1, len(cases))
            kept = sum(
                1 for c in cases if c is not None and family.done_before(c.name, repetition)
            )
            if kept:
                print(
                    f"{prefix} {kept} of {len(cases)} case(s) kept from the run resumed",
                    file=progress,
                    flush=True,
                )
            for index in range(len(cases)):
                item = cases[index]
                assert item is not None
                cases[index] = None  # the run holds the case no longer than its turn
                name = item.name
                entry = family.entry(name, repeat)
                if family.done_before(name, repetition):
                    estimate.case_done(measured=False)
                    del item
                    continue
                line = (
                    f"{prefix[:-1]} | {estimate.line(time.perf_counter())}] "
                    f"({index + 1}/{len(cases)}) {name} ..."
                )
                print(line, end="", file=progress, flush=True)
                with logs.held() as held:  # nothing lands inside the progress line
                    try:
                        case, timings, duration, error = _run_case(
                            item, settings, clock, device_sync, entry.phases
                        )
                    finally:
                        del item
                released = time.perf_counter()
                spec = _spec(case) if case is not None else Case(info.name, name, {})
                del case
                release()
                entry.phases["release"] += time.perf_counter() - released
                entry.memory = memory_mb()
                entry.kept = None
                entry.add(spec, timings, duration + time.perf_counter() - released, error)
                result = entry.result(info.name)
                print(f" {duration:.1f} s: {_one_line(result)}", file=progress, flush=True)
                held.replay()
                estimate.case_done(measured=True)
                record["duration_s"] = earlier + time.perf_counter() - started
                save()
            del cases
            release()
            record["duration_s"] = earlier + time.perf_counter() - started
            estimate.end_family(number - 1)
            save()
    return [state[info.name].result() for info in families]


def build_document(
    metadata: dict[str, Any],
    settings: TimingSettings,
    ctx: Context,
    families: list[dict[str, Any]],
    repeat: int = 1,
    selected: Sequence[str] | None = None,
    complete: bool = True,
    interrupted_by: str | None = None,
    resumed: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """The whole ``results.json`` document (see :mod:`benchmarks.schema`).

    Args:
      metadata: :func:`benchmarks.metadata.collect`'s (of the run's start).
      settings: The timing settings.
      ctx: The context the families got.
      families: The ``family`` objects so far.
      repeat: ``--repeat``.
      selected: The families selected, in order (default: those of ``families``).
      complete: Whether every selected family ran to its end.
      interrupted_by: ``"SIGINT"`` or ``"SIGTERM"`` when the run was stopped by one.
      resumed: One ``{"date_utc", "command"}`` per ``--resume`` that continued the run.
    """
    goals = [c["goal"] for f in families for c in f["cases"] if c["goal"] is not None]
    names = [f["name"] for f in families] if selected is None else list(selected)
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "failed" if any(f["status"] != "ok" for f in families) else "ok",
        "complete": complete,
        "interrupted_by": None if complete else interrupted_by,
        "resumed": [dict(r) for r in resumed],
        "metadata": metadata,
        "settings": {
            "rounds": settings.rounds,
            "repeat": repeat,
            "warmup_time_s": settings.warmup_time,
            "min_batch_time_s": settings.min_batch_time,
            "sizes": list(ctx.sizes),
            "threads": list(ctx.threads),
            "families_selected": names,
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
