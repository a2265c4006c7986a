"""Smoke test: examples/hogwild_sgd.py runs; SafeOptimizer loses and interleaves nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _quiet import VERBOSE_ENV, startup_noise

HERE = os.path.dirname(os.path.abspath(__file__))
# The default: no TF_CPP_MIN_LOG_LEVEL, not verbose (TensorFlow's start-up log is hidden).
ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", VERBOSE_ENV)
}
ROW = re.compile(
    r"^(\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", re.M
)


def test_hogwild_sgd_safe_optimizer_loses_nothing():
    threads, steps = 4, 40
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "hogwild_sgd.py"),
            "--threads",
            str(threads),
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=ENV,
    )
    out = done.stdout
    assert startup_noise(done.stderr) == [], done.stderr
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
