"""Smoke test: examples/async_ps_training.py runs; safevars loses no update under PS."""

from __future__ import annotations

import re

from _smoke import run_example

ROW = re.compile(
    r"^(plain|safevars.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)\s+(\d+)\s+([\d.]+)$", re.M
)
BATCH = 64


def test_async_ps_training_safevars_loses_nothing():
    steps = 45
    out = run_example("async_ps_training.py", "--workers", "3", "--steps", str(steps), timeout=300)
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
