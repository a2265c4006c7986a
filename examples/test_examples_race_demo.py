"""Smoke test: examples/race_demo.py runs and safevars loses no update."""

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


def test_race_demo_safevars_lose_nothing():
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "race_demo.py"),
            "--threads",
            "4",
            "--iterations",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=ENV,
    )
    out = done.stdout
    assert startup_noise(done.stderr) == [], done.stderr
    rows = dict(re.findall(r"^(\S.*?)\s+final\s+\d+\s+lost\s+(-?\d+)", out, re.M))
    assert set(rows) == {"plain tf.Variable", "SafeVariable.update", "safevars.locked"}, out
    assert rows["SafeVariable.update"] == "0" and rows["safevars.locked"] == "0", out
    assert int(rows["plain tf.Variable"]) >= 0  # plain may lose updates: scheduler-dependent
    assert "version 1200" in out
