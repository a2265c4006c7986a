"""Smoke test: examples/hogwild_sgd.py runs; SafeOptimizer loses and interleaves nothing."""

from __future__ import annotations

import re

from _smoke import run_example

ROW = re.compile(
    r"^(\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", re.M
)


def test_hogwild_sgd_safe_optimizer_loses_nothing():
    threads, steps = 4, 40
    out = run_example("hogwild_sgd.py", "--threads", str(threads), "--steps", str(steps))
    rows = {m[0]: [float(x) for x in m[1:]] for m in ROW.findall(out)}
    assert set(rows) == {
        "plain SGD(momentum)",
        "SafeOptimizer(SGD)",
        "SafeOptimizer(SGD, scale)",
    }, out
    calls = threads * steps
    for name in ("SafeOptimizer(SGD)", "SafeOptimizer(SGD, scale)"):
        n, iterations, counted, lost, overlapping, loss, accuracy = rows[name]
        assert (n, iterations, counted, lost, overlapping) == (calls, calls, calls, 0, 0), out
        assert accuracy > 0.8, out  # it still learns the task
    plain = rows["plain SGD(momentum)"]
    assert plain[0] == calls and plain[3] >= 0 and plain[4] >= 0  # scheduler-dependent
    assert f"SafeOptimizer(SGD): w.version {calls}, calls {calls}, applied {calls}" in out
