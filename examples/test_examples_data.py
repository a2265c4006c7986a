"""Smoke test: examples/sharded_input.py runs; plain sharding repeats or loses, safevars not."""

from __future__ import annotations

import re

from _smoke import run_example

TIMEOUT = 300

CHECKS = [
    "epoch 1 is every element exactly once",
    "restarted run continues exactly",
    "shards are disjoint",
    "epoch 1 is reshuffled",
]


def test_sharded_input_example_restarts_exactly():
    out = run_example("sharded_input.py", timeout=TIMEOUT)
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
