"""Smoke test: examples/gradient_accumulation.py runs and its runs agree bitwise."""

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


def test_gradient_accumulation_example():
    workers, steps = 3, 12
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "gradient_accumulation.py"),
            "--workers",
            str(workers),
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
