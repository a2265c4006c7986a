"""Smoke test: examples/replica_rng.py runs in a subprocess and every check holds."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _quiet import startup_noise
from _smoke import ENV, HERE

TIMEOUT = 300

CHECKS = [
    "replicas differ",
    "same seed, new RNG, same draws",
    "restored run continues exactly",
    "dropout masks differ across replicas",
    "tf.data augmentation reproducible",
    "numpy generators differ across replicas",
]


def test_replica_rng_example_checks_hold():
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "replica_rng.py"), "--seed", "4321"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert startup_noise(proc.stderr) == [], proc.stderr
    out = proc.stdout
    results = dict(re.findall(r"^(.+?): (True|False)$", out, re.M))
    assert {check: results.get(check) for check in CHECKS} == dict.fromkeys(CHECKS, "True"), out
    noise = re.findall(r"^replica (\d) noise: \[(.+)\]$", out, re.M)
    assert [r for r, _ in noise] == ["0", "1"] and noise[0][1] != noise[1][1], out
    assert "attached seed generators: 1" in out
    assert re.search(r"^fingerprint: [0-9a-f]{16}$", out, re.M), out
