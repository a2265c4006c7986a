"""Smoke test: examples/gradient_accumulation.py runs and its runs agree bitwise."""

from __future__ import annotations

import re

from _smoke import run_example


def test_gradient_accumulation_example():
    workers, steps = 3, 12
    out = run_example("gradient_accumulation.py", "--workers", str(workers), "--steps", str(steps))
    assert "final weights bitwise identical across runs: True" in out, out
    losses = [tuple(map(float, m)) for m in re.findall(r"loss ([\d.]+) -> ([\d.]+)", out)]
    assert len(losses) == 2 and all(after < before for before, after in losses), out
    n = workers * steps
    expected = (
        f"AccumulatorStatistics(pending=0, added={n}, dropped_stale=0, rejected=0, "
        f"scaled=0, taken={n}, takes={steps}, discarded=0)"
    )
    assert out.count(expected) == 2, out
    gap = float(re.search(r"full-batch gradient, max \|diff\| = (\S+)", out)[1])
    assert gap < 1e-5, out
