"""Timing one case: warm-up, calibration, then A/B-interleaved rounds.

Method (the same for every case):

1. **Warm-up.** Each variant is called once (tracing, allocation), then in doubling
   batches until ``warmup_time`` has passed. The last warm-up batch estimates the time per
   call, from which the number of calls per timed batch is chosen so that one batch takes
   about ``min_batch_time`` (at least one call).
2. **Rounds.** ``settings.rounds`` rounds (times the case's ``rounds_factor``, 1 unless a
   noisy case asks for more). Every round times one batch of every variant, one after the
   other in the same process; the order rotates by one each round (A B C, B C A, C A B,
   ...) so no variant always runs first or right after another. The sample of a round is
   the batch time divided by the number of calls.
3. **Clocks and devices.** Before *every* clock read, ``device_sync`` is called (on a GPU,
   a device sync), so a batch's time includes the work it queued. On a GPU a case's own
   ``sync`` also runs after every call. The garbage collector is paused during a batch.

Uncertainty (:func:`ratio_interval`): every ratio is a ratio of medians, and its 95%
confidence interval comes from a *paired bootstrap* of the rounds. Round ``i`` of two
variants ran back to back, so the pair ``(a_i, b_i)`` shares whatever the machine was
doing then; a resample draws rounds (pairs) with replacement, the same draw for both
variants, and computes ``median(a*) / median(b*)``; the interval is the 2.5th to 97.5th
percentile of 10,000 such ratios (seeded: the same samples give the same interval).
With ``--repeat N`` the rounds of the N repetitions are pooled and the bootstrap has two
stages (a *cluster* bootstrap, Davison and Hinkley, "Bootstrap Methods and their
Application", 1997, section 3.8): a resample draws N repetitions with replacement, then
from each drawn repetition as many of its rounds as it had, with replacement, the same
rounds for both variants. Repetitions differ by more than their rounds suggest (a
pipeline instance that keeps a fast or a slow mode, another process starting): the
``data`` family's five passes of 2026-11-26 read 0.85 to 1.21, while an interval that
resampled rounds only within each pass (this module's method until then) read
[0.99, 1.02] and the two-stage one reads [0.90, 1.14]. Resampling at both stages errs on
the wide side (the spread between repetitions already contains some of their rounds'
noise). With one repetition it is the one-stage bootstrap above. Fewer than
:data:`MIN_ROUNDS_FOR_INTERVAL` rounds give no interval.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.case import Case

__all__ = [
    "CI_LEVEL",
    "MIN_ROUNDS_FOR_INTERVAL",
    "RESAMPLES",
    "TimingSettings",
    "VariantTiming",
    "measure",
    "pool",
    "ratio_interval",
    "repetition_ratios",
]

CI_LEVEL = 0.95
RESAMPLES = 10_000
SEED = 20_240_214
MIN_ROUNDS_FOR_INTERVAL = 3


@dataclasses.dataclass(frozen=True)
class TimingSettings:
    """How long and how often to time.

    Attributes:
      rounds: Timed rounds per case (every variant once per round).
      warmup_time: Seconds of warm-up per variant (after its first call).
      min_batch_time: Target seconds per timed batch.
      max_calls_per_batch: Upper bound on calls per batch.
    """

    rounds: int
    warmup_time: float
    min_batch_time: float
    max_calls_per_batch: int = 1_000_000

    @classmethod
    def quick(cls) -> TimingSettings:
        """``--quick``, a smoke test of every case: 5 rounds of 4 ms batches (7 until
        issue 44), enough for an interval, most of the time being the first calls."""
        return cls(rounds=5, warmup_time=0.01, min_batch_time=0.004)

    @classmethod
    def full(cls) -> TimingSettings:
        """The default run's settings: 20 rounds of 20 ms batches after 0.1 s of warm-up.

        Until issue 44 a full run took 25 rounds of 30 ms after 0.2 s: 0.95 s per
        variant at least, most of the time of the families whose calls are short (60
        variants in ``eager`` and ``graph`` alone). At 0.5 s per variant the intervals
        are about 12% wider (the square root of 25/20).
        """
        return cls(rounds=20, warmup_time=0.1, min_batch_time=0.02)


@dataclasses.dataclass
class VariantTiming:
    """The measurements of one variant of one case.

    Attributes:
      name: Variant name.
      calls_per_batch: Calls timed together in each round (of the first repetition).
      samples: Seconds per call, one per round, in round order (repetitions one after
        the other when pooled).
      extra_rounds: The ``dict`` a variant returned in each round's last call (empty
        dicts when it returns something else).
      blocks: Rounds of each repetition, in order (``[len(samples)]`` for one run).
      calls_per_batch_blocks: ``calls_per_batch`` of each repetition.
      first_call_s: Seconds of the variant's first call (tracing, allocation), summed
        over the repetitions.
      warmup_s: Seconds of its whole warm-up and calibration, first call included,
        summed over the repetitions.
    """

    name: str
    calls_per_batch: int
    samples: list[float] = dataclasses.field(default_factory=list)
    extra_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    calls_per_batch_blocks: list[int] = dataclasses.field(default_factory=list)
    first_call_s: float = 0.0
    warmup_s: float = 0.0

    @property
    def rounds(self) -> list[int]:
        """``blocks``, or one block of every sample when not set."""
        return list(self.blocks) if self.blocks else [len(self.samples)]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def extra(self) -> dict[str, Any]:
        """The extra figures of the last round (the contract of ``benchmarks.case``)."""
        return self.extra_rounds[-1] if self.extra_rounds else {}


class _Timer:
    """Times batches of calls: syncs the device before every clock read."""

    def __init__(
        self,
        clock: Callable[[], float],
        device_sync: Callable[[], Any] | None,
        call_sync: Callable[[], Any] | None,
    ) -> None:
        self._clock = clock
        self._device_sync = device_sync
        self._call_sync = call_sync if device_sync is not None else None

    def _now(self) -> float:
        if self._device_sync is not None:
            self._device_sync()
        return self._clock()

    def batch(self, fn: Callable[[], Any], calls: int) -> tuple[float, Any]:
        """Seconds for ``calls`` calls of ``fn``, and the last call's result."""
        call_sync = self._call_sync
        result = None
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            start = self._now()
            for _ in range(calls):
                result = fn()
                if call_sync is not None:
                    call_sync()
            elapsed = self._now() - start
        finally:
            if gc_was_enabled:
                gc.enable()
        return elapsed, result


def _calibrate(
    timer: _Timer, fn: Callable[[], Any], settings: TimingSettings, name: str
) -> VariantTiming:
    """Warms ``fn`` up; its timing, with the calls that make a batch of
    ``min_batch_time`` and the seconds the warm-up took (by ``time.perf_counter``)."""
    started = time.perf_counter()
    timer.batch(fn, 1)  # First call: tracing, allocation, lazy initialization.
    first_call = time.perf_counter() - started
    timing = VariantTiming(name, _calls_per_batch(timer, fn, settings))
    timing.first_call_s = first_call
    timing.warmup_s = time.perf_counter() - started
    return timing


def _calls_per_batch(timer: _Timer, fn: Callable[[], Any], settings: TimingSettings) -> int:
    """Calls ``fn`` in doubling batches for ``warmup_time``; the calls that make a batch
    of ``min_batch_time``."""
    calls, spent = 1, 0.0
    while True:
        elapsed, _ = timer.batch(fn, calls)
        spent += elapsed
        if spent >= settings.warmup_time or calls >= settings.max_calls_per_batch:
            break
        calls *= 2
    per_call = elapsed / calls
    if per_call <= 0:
        return settings.max_calls_per_batch
    wanted = math.ceil(settings.min_batch_time / per_call)
    return max(1, min(settings.max_calls_per_batch, wanted))


def measure(
    case: Case,
    settings: TimingSettings,
    clock: Callable[[], float] = time.perf_counter,
    device_sync: Callable[[], Any] | None = None,
) -> list[VariantTiming]:
    """Times every variant of ``case`` (see the module docstring for the method).

    Args:
      case: The case; its first variant is the baseline.
      settings: Rounds and durations.
      clock: Seconds, monotonic (injectable for tests).
      device_sync: Called before every clock read: a device sync on a GPU, ``None`` on
        a CPU. When given, ``case.sync`` also runs after every call.

    Returns:
      One :class:`VariantTiming` per variant, in the case's order.

    Raises:
      Exception: whatever a variant raises.
    """
    if not case.variants:
        raise ValueError(f"case {case.name!r} of family {case.family!r} has no variants.")
    factor = case.rounds_factor
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(
            f"case {case.name!r} of family {case.family!r}: rounds_factor must be an int "
            f">= 1 (the multiple of the suite's rounds this case takes), got {factor!r}."
        )
    timer = _Timer(clock, device_sync, case.sync)
    names = list(case.variants)
    timings = {name: _calibrate(timer, case.variants[name], settings, name) for name in names}
    for round_index in range(settings.rounds * factor):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timing = timings[name]
            elapsed, result = timer.batch(case.variants[name], timing.calls_per_batch)
            timing.samples.append(elapsed / timing.calls_per_batch)
            timing.extra_rounds.append(dict(result) if isinstance(result, dict) else {})
    for timing in timings.values():
        timing.blocks = [len(timing.samples)]
        timing.calls_per_batch_blocks = [timing.calls_per_batch]
    return [timings[name] for name in names]


def pool(repetitions: Sequence[Sequence[VariantTiming]]) -> list[VariantTiming]:
    """The timings of several repetitions of one case, as one (``--repeat``).

    Samples and extra figures are concatenated in repetition order; ``blocks`` records
    how many rounds each repetition contributed, so that :func:`ratio_interval`
    resamples within repetitions. Variants are matched by name, in the first
    repetition's order; a variant missing from a repetition contributes nothing there.

    Raises:
      ValueError: no repetitions.
    """
    if not repetitions:
        raise ValueError("pool() needs at least one repetition.")
    names = [t.name for t in repetitions[0]]
    pooled = []
    for name in names:
        parts = [t for rep in repetitions for t in rep if t.name == name]
        pooled.append(
            VariantTiming(
                name=name,
                calls_per_batch=parts[0].calls_per_batch,
                samples=[x for t in parts for x in t.samples],
                extra_rounds=[e for t in parts for e in t.extra_rounds],
                blocks=[n for t in parts for n in t.rounds],
                calls_per_batch_blocks=[
                    c for t in parts for c in (t.calls_per_batch_blocks or [t.calls_per_batch])
                ],
                first_call_s=sum(t.first_call_s for t in parts),
                warmup_s=sum(t.warmup_s for t in parts),
            )
        )
    return pooled


def ratio_interval(
    numerator: Sequence[float],
    denominator: Sequence[float],
    blocks: Sequence[int] | None = None,
    level: float = CI_LEVEL,
    resamples: int = RESAMPLES,
    seed: int = SEED,
) -> tuple[float, float] | None:
    """Confidence interval of ``median(numerator) / median(denominator)``.

    Paired percentile bootstrap (see the module docstring): ``numerator[i]`` and
    ``denominator[i]`` are the same round of two variants, and every resample takes the
    same rounds from both. With one block of rounds (one repetition) a resample draws
    as many rounds as there are, with replacement. With several it has two stages: it
    draws as many blocks as there are, with replacement, then from each drawn block as
    many rounds as it holds, with replacement, and pools them.

    Args:
      numerator: Seconds per call of the variant, one per round.
      denominator: Seconds per call of the reference, the same rounds.
      blocks: Rounds per repetition, summing to the number of rounds (None: one block;
        empty blocks are ignored).
      level: Coverage of the interval (0.95: the 2.5th and 97.5th percentiles).
      resamples: Bootstrap resamples.
      seed: Seed of the resampling (fixed: a report is reproducible from its samples).

    Returns:
      ``(low, high)``, or None with fewer than :data:`MIN_ROUNDS_FOR_INTERVAL` rounds or a
      non-positive reference median in some resample.

    Raises:
      ValueError: the sequences differ in length, or ``blocks`` does not add up.
    """
    a, b, spans = _paired_blocks(numerator, denominator, blocks)
    if len(a) < MIN_ROUNDS_FOR_INTERVAL:
        return None
    rng = np.random.default_rng(seed)
    kept = [(start, n) for start, n in spans if n]
    if len(kept) == 1:
        start, n = kept[0]
        index = rng.integers(start, start + n, size=(resamples, n))
        top, bottom = _row_medians(a[index]), _row_medians(b[index])
    else:
        top, bottom = _two_stage_medians(a, b, kept, resamples, rng)
    if np.any(bottom <= 0):
        return None
    ratios = top / bottom
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(ratios, [tail, 100.0 - tail])
    return float(low), float(high)


def _row_medians(values: np.ndarray) -> np.ndarray:
    """``np.median(values, axis=1)`` of finite values, the same numbers 4-5 times faster.

    ``np.median`` also partitions for a NaN check; samples are finite (seconds per
    call), so one partition at the middle (two for an even count, averaged as
    ``np.median`` does) gives its result.
    """
    k = values.shape[1] // 2
    if values.shape[1] % 2:
        return np.partition(values, k, axis=1)[:, k]
    middle = np.partition(values, [k - 1, k], axis=1)
    return (middle[:, k - 1] + middle[:, k]) / 2


def _paired_blocks(
    numerator: Sequence[float], denominator: Sequence[float], blocks: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """The paired rounds as arrays and each block's ``(start, size)`` (None: one block).

    Raises:
      ValueError: the sequences differ in length, or ``blocks`` does not add up.
    """
    a = np.asarray(numerator, dtype=np.float64)
    b = np.asarray(denominator, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(
            f"numerator and denominator must be paired rounds of equal length, got "
            f"{a.shape} and {b.shape}."
        )
    sizes = [len(a)] if blocks is None else [int(n) for n in blocks]
    if sum(sizes) != len(a) or any(n < 0 for n in sizes):
        raise ValueError(f"blocks {list(sizes)} do not add up to {len(a)} rounds.")
    starts = np.cumsum([0, *sizes[:-1]])
    return a, b, [(int(start), n) for start, n in zip(starts, sizes)]


def _two_stage_medians(
    a: np.ndarray,
    b: np.ndarray,
    blocks: Sequence[tuple[int, int]],
    resamples: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Medians of ``a`` and ``b`` over ``resamples`` two-stage resamples of ``blocks``
    (``(start, size)`` pairs, none empty): blocks drawn with replacement, then rounds
    within each drawn block with replacement, the same indices for ``a`` and ``b``."""
    starts = np.array([start for start, _ in blocks])
    counts = np.array([n for _, n in blocks])
    drawn = rng.integers(0, len(blocks), size=(resamples, len(blocks)))
    widest = int(counts.max())
    offsets = np.floor(rng.random((resamples, len(blocks), widest)) * counts[drawn][..., None])
    index = (starts[drawn][..., None] + offsets.astype(np.int64)).reshape(resamples, -1)
    if np.all(counts == widest):
        return _row_medians(a[index]), _row_medians(b[index])
    # Blocks of unequal sizes: the positions past a drawn block's size are not drawn.
    drawn_round = (np.arange(widest) < counts[drawn][..., None]).reshape(resamples, -1)
    return (
        np.nanmedian(np.where(drawn_round, a[index], np.nan), axis=1),
        np.nanmedian(np.where(drawn_round, b[index], np.nan), axis=1),
    )


def repetition_ratios(
    numerator: Sequence[float], denominator: Sequence[float], blocks: Sequence[int]
) -> list[float | None]:
    """``median(numerator) / median(denominator)`` within each block of rounds (each
    repetition of a pooled run), in order; None for an empty block or a non-positive
    reference median.

    Raises:
      ValueError: the sequences differ in length, or ``blocks`` does not add up.
    """
    a, b, spans = _paired_blocks(numerator, denominator, blocks)
    out: list[float | None] = []
    for start, n in spans:
        bottom = float(np.median(b[start : start + n])) if n else 0.0
        out.append(float(np.median(a[start : start + n])) / bottom if bottom > 0 else None)
    return out
