"""Timing one case: warm-up, calibration, then A/B-interleaved rounds.

Method (the same for every case):

1. **Warm-up.** Each variant is called once (tracing, allocation), then in doubling
   batches until ``warmup_time`` has passed. The last warm-up batch estimates the time per
   call, from which the number of calls per timed batch is chosen so that one batch takes
   about ``min_batch_time`` (at least one call).
2. **Rounds.** Every round times one batch of every variant, one after the other in the
   same process; the order rotates by one each round (A B C, B C A, C A B, ...) so no
   variant always runs first or right after another. The sample of a round is the batch
   time divided by the number of calls.
3. **Clocks and devices.** Before *every* clock read, ``device_sync`` is called (on a GPU,
   a device sync), so a batch's time includes the work it queued. On a GPU a case's own
   ``sync`` also runs after every call. The garbage collector is paused during a batch.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.case import Case

__all__ = ["TimingSettings", "VariantTiming", "measure"]


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
        return cls(rounds=7, warmup_time=0.01, min_batch_time=0.004)

    @classmethod
    def full(cls) -> TimingSettings:
        return cls(rounds=25, warmup_time=0.2, min_batch_time=0.03)


@dataclasses.dataclass
class VariantTiming:
    """The measurements of one variant of one case.

    Attributes:
      name: Variant name.
      calls_per_batch: Calls timed together in each round.
      samples: Seconds per call, one per round, in round order.
      extra_rounds: The ``dict`` a variant returned in each round's last call (empty
        dicts when it returns something else).
    """

    name: str
    calls_per_batch: int
    samples: list[float] = dataclasses.field(default_factory=list)
    extra_rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)

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


def _calibrate(timer: _Timer, fn: Callable[[], Any], settings: TimingSettings) -> int:
    """Warms ``fn`` up and returns how many calls make a batch of ``min_batch_time``."""
    timer.batch(fn, 1)  # First call: tracing, allocation, lazy initialization.
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
    timer = _Timer(clock, device_sync, case.sync)
    names = list(case.variants)
    timings = {
        name: VariantTiming(name, _calibrate(timer, case.variants[name], settings))
        for name in names
    }
    for round_index in range(settings.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            timing = timings[name]
            elapsed, result = timer.batch(case.variants[name], timing.calls_per_batch)
            timing.samples.append(elapsed / timing.calls_per_batch)
            timing.extra_rounds.append(dict(result) if isinstance(result, dict) else {})
    return [timings[name] for name in names]
