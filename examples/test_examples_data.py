"""Smoke test: examples/sharded_input.py runs; plain sharding repeats or loses, safevars not."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from _quiet import startup_noise
from _smoke import ENV, HERE

TIMEOUT = 120

CHECKS = [
    "epoch 1 is every element exactly once",
    "restarted run continues exactly",
    "shards are disjoint",
    "epoch 1 is reshuffled",
]


def test_sharded_input_example_restarts_exactly():
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "sharded_input.py")],
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
    counts = {
        name: (int(lost), int(duplicated))
        for name, lost, duplicated in re.findall(
            r"^(.+?): lost (\d+), duplicated (\d+)$", out, re.M
        )
    }
    # 4 elements of epoch 1 per worker were read before the crash: read again.
    assert counts.pop("plain shard().shuffle(), restarted at the epoch start") == (0, 8), out
    # skip() passes over other elements than those read: as many lost as repeated.
    lost, duplicated = counts.pop(
        "plain shard().shuffle(), another seed after the restart, skip()"
    )
    assert lost == duplicated > 0, out
    assert counts == {"safevars ShardedInput, restarted from the checkpoint": (0, 0)}, out
    assert "restored positions (epoch, offset): [(1, 4), (1, 4)]" in out
