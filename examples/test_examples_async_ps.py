"""Smoke test: examples/async_ps_training.py runs; safevars loses no update under PS."""

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
    r"^(plain|safevars.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s+(\d+)\s+([\d.]+)$", re.M
)
BATCH = 64


def test_async_ps_training_safevars_loses_nothing():
    steps = 45
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "async_ps_training.py"),
            "--workers",
            "3",
            "--steps",
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=ENV,
    )
    out = done.stdout
    assert startup_noise(done.stderr) == [], done.stderr
    rows = {m[0]: [float(x) for x in m[1:]] for m in ROW.findall(out)}
    assert set(rows) == {"plain", "safevars", "safevars max_staleness=0"}, out
    scheduled, iterations, dropped, lost, examples, loss = rows["safevars"]
    assert (scheduled, iterations, dropped, lost, examples) == (
        steps,
        steps,
        0,
        0,
        steps * BATCH,
    ), out
    scheduled, iterations, dropped, lost, examples, loss = rows["safevars max_staleness=0"]
    assert scheduled == steps and lost == 0 and iterations + dropped == steps, out
    assert iterations >= 1 and examples == steps * BATCH, out
    # The plain run's losses depend on the scheduler: only their bounds are checked.
    scheduled, iterations, dropped, lost, examples, loss = rows["plain"]
    assert scheduled == steps and 0 <= lost < steps and examples <= steps * BATCH, out
    assert f"safevars: w.version {steps}, calls {steps}, applied {steps}, dropped_stale 0" in out
    applied = int(rows["safevars max_staleness=0"][1])
    assert (
        f"safevars max_staleness=0: w.version {applied}, calls {steps}, applied "
        f"{applied}, dropped_stale {steps - applied}"
    ) in out
