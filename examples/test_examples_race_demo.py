"""Smoke test: examples/race_demo.py runs and safevars loses no update."""

from __future__ import annotations

import re

from _smoke import run_example


def test_race_demo_safevars_lose_nothing():
    # A new python, as a user starts it: the one smoke test that shows the start-up log
    # stays hidden (the others are forked from a process that imported TensorFlow).
    out = run_example("race_demo.py", "--threads", "4", "--iterations", "300", fresh=True)
    rows = dict(re.findall(r"^(\S.*?)\s+final\s+\d+\s+lost\s+(-?\d+)", out, re.M))
    assert set(rows) == {"plain tf.Variable", "SafeVariable.update", "safevars.locked"}, out
    assert rows["SafeVariable.update"] == "0" and rows["safevars.locked"] == "0", out
    assert int(rows["plain tf.Variable"]) >= 0  # plain may lose updates: scheduler-dependent
    assert "version 1200" in out
