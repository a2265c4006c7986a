"""Smoke test: examples/replica_rng.py runs in a subprocess and every check holds."""

from __future__ import annotations

import re

from _smoke import run_example

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
    out = run_example("replica_rng.py", "--seed", "4321", timeout=TIMEOUT)
    results = dict(re.findall(r"^(.+?): (True|False)$", out, re.M))
    assert {check: results.get(check) for check in CHECKS} == dict.fromkeys(CHECKS, "True"), out
    noise = re.findall(r"^replica (\d) noise: \[(.+)\]$", out, re.M)
    assert [r for r, _ in noise] == ["0", "1"] and noise[0][1] != noise[1][1], out
    assert "attached seed generators: 1" in out
    assert re.search(r"^fingerprint: [0-9a-f]{16}$", out, re.M), out
