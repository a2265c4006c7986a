"""The progress lines' clock: time elapsed and an estimate of the time left.

Each family declares about how long it runs on a 2-core CPU (``SECONDS = {"full": ...,
"quick": ...}``, see :mod:`benchmarks.case`); a family without it counts as the average
of those that have it (30 s full, 3 s quick when none has). Within a family every case
counts the same share. The estimate of the time left is the expected time of the work
not yet done, times how fast this run has gone so far: the seconds elapsed over the
expected seconds of the work done in this process (cases skipped by ``--resume`` count
as done but took no time). Before any case finished the factor is 1.

Nothing here reads a clock on its own: every method takes ``now`` (seconds of
``time.perf_counter``), so the arithmetic is tested without timing anything.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Estimate", "format_duration"]

#: Seconds a family without ``SECONDS`` counts for, when no selected family has it.
FALLBACK_SECONDS = {"full": 30.0, "quick": 3.0}


def format_duration(seconds: float) -> str:
    """``0:07``, ``4:10``, ``1:02:03``: minutes and seconds (hours when needed)."""
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


class Estimate:
    """Expected and elapsed time of a run over ``families`` (in order), ``repeat`` times.

    Args:
      expected: Each selected family's expected seconds (None: not declared).
      mode: ``"full"`` or ``"quick"`` (used for the fallback only).
      repeat: Passes over the families.
      started: ``time.perf_counter()`` when the run started.
    """

    def __init__(
        self, expected: Sequence[float | None], mode: str, repeat: int, started: float
    ) -> None:
        known = [e for e in expected if e is not None]
        fallback = sum(known) / len(known) if known else FALLBACK_SECONDS.get(mode, 30.0)
        self._expected = [e if e is not None else fallback for e in expected]
        self._total = sum(self._expected) * repeat
        self._started = started
        self._done = 0.0  # expected seconds of the work finished (or skipped)
        self._done_here = 0.0  # expected seconds of the work this process measured
        self._family_share = 0.0  # expected seconds of one case of the current family
        self._family_started_at = 0.0  # self._done when the current family started

    def start_family(self, index: int, cases: int) -> None:
        """Family ``index`` (0-based in the selection) starts, with ``cases`` cases."""
        self._family_started_at = self._done
        self._family_share = self._expected[index] / cases if cases else 0.0

    def case_done(self, measured: bool) -> None:
        """A case of the current family finished (``measured``) or was skipped."""
        self._done += self._family_share
        if measured:
            self._done_here += self._family_share

    def end_family(self, index: int) -> None:
        """Family ``index`` ended (however many of its cases ran): its whole share is done."""
        rest = self._expected[index] - (self._done - self._family_started_at)
        self._done += max(0.0, rest)

    def elapsed(self, now: float) -> float:
        return now - self._started

    def left(self, now: float) -> float:
        """Seconds still to go, at the pace of the run so far."""
        pace = self.elapsed(now) / self._done_here if self._done_here > 0 else 1.0
        return max(0.0, self._total - self._done) * pace

    def line(self, now: float) -> str:
        """``2:09 elapsed, ~4:06 left``."""
        return (
            f"{format_duration(self.elapsed(now))} elapsed, "
            f"~{format_duration(self.left(now))} left"
        )
