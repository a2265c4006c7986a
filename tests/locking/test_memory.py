"""Memory returns to baseline: variables, their locks and their graphs are freed.

A long-running process creates and drops variables and functions for days. Each
SafeVariable has a lock of its own, which in run-time mode owns a TensorFlow mutex (a
resource TensorFlow keeps until it is destroyed, with a thread once it was taken), a
gate variable and, per variable, a version variable. The test creates 10,000
SafeVariables, writes each in a ``tf.function`` and drops them (with the functions), in
a process of its own so that no other test's memory counts, and bounds what stays.

Measured with this workload (2 cores, 2026-11-29): plain ``tf.Variable`` about 1 KB per
variable, safevars about 1 KB (about 110 KB before the mutexes were freed). The bound
below is generous: it fails on any per-lock resource that is kept (a kept mutex costs 34
KB or more) without failing on allocator noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, os, sys, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    import safevars
    from safevars.locking import statistics

    libc = ctypes.CDLL("libc.so.6")

    def resident() -> int:
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    BATCH = 50

    def batch() -> None:
        variables = [safevars.SafeVariable(0.0) for _ in range(BATCH)]

        @tf.function(autograph=False)
        def write():
            for v in variables:
                v.assign_add(1.0)

        write()
        assert all(v.statistics().eager_mutex for v in variables)

    for _ in range(500 // BATCH):  # warm up TensorFlow's own caches
        batch()
    before, threads_before = resident(), threads()
    count = int(sys.argv[1])
    for _ in range(count // BATCH):
        batch()
    after = resident()
    print(json.dumps({
        "per_variable_kb": (after - before) / 1024 / count,
        "threads_before": threads_before,
        "threads_after": threads(),
        "live_locks": len(statistics._LOCKS),
        "cpu_seconds": time.process_time(),
    }), flush=True)
    """
)

COUNT = 10_000
BOUND_KB = 15.0  # per variable; plain TensorFlow keeps about 1 KB here


def test_creating_using_and_dropping_ten_thousand_variables_returns_memory():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(COUNT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["per_variable_kb"] < BOUND_KB, result
    # A kept mutex also keeps the thread that hands it over.
    assert result["threads_after"] <= result["threads_before"] + 4, result
    assert result["live_locks"] <= 2, result  # (the last one a thread held may linger)
