"""Memory returns to baseline: variables, their locks and their graphs are freed.

A long-running process creates and drops variables and functions for days. Each
SafeVariable has a lock of its own, which in run-time mode owns a TensorFlow mutex (a
resource TensorFlow keeps until it is destroyed, with a thread once it was taken), a
gate variable and, per variable, a version variable. The test creates 2,500 variables,
writes each in a ``tf.function`` and then eagerly (an eager section in run-time mode
takes the mutex) and drops them with the functions, once with ``tf.Variable`` and once
with ``SafeVariable``, each in a process of its own (no other test's memory counts), and
bounds what safevars keeps beyond what plain TensorFlow keeps.

Measured with 10,000 variables (2 cores, load about 12, 2026-11-29): plain 0.98 KB per
variable, safevars 1.07 KB, no thread kept, no lock alive (before: 88 KB and one thread
per variable, as every lock, its mutex and the mutex's thread stayed). The bound is the
issue's goal, 5 KB per variable beyond plain: generous against allocator noise (0.1 KB
at 10,000 variables), while a kept mutex alone costs 34 KB or more. 2,500 variables
after a warm-up of 1,000 keep that margin at a third of the time (the children took 80
CPU-seconds at 10,000): quiet, three runs measured safevars 0.4-1.7 KB and plain 0.6 KB
per variable; with every mutex kept (a mutation), 82 KB and 2,500 threads more.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import forked
from tests.support.deadlines import scaled

_CHILD = textwrap.dedent(
    """
    import ctypes, gc, json, os, sys
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

    kind, count = sys.argv[1], int(sys.argv[2])
    make = safevars.SafeVariable if kind == "safevars" else tf.Variable
    BATCH = 50

    def batch() -> None:
        variables = [make(0.0) for _ in range(BATCH)]

        @tf.function(autograph=False)
        def write():
            for v in variables:
                v.assign_add(1.0)

        write()
        for v in variables:
            v.assign_add(1.0)  # (in run-time mode: takes the lock's TF mutex)
        if kind == "safevars":
            assert all(v.statistics().eager_mutex for v in variables)

    # Warm up TensorFlow's caches and what the first locks' mutexes leave (about 4 MB
    # with safevars, once, by the first 500 variables; plain: about 0.2 MB).
    for _ in range(1_000 // BATCH):
        batch()
    before, threads_before = resident(), threads()
    for _ in range(count // BATCH):
        batch()
    after = resident()
    print(json.dumps({
        "per_variable_kb": (after - before) / 1024 / count,
        "threads_before": threads_before,
        "threads_after": threads(),
        "live_locks": len(statistics._LOCKS),
    }), flush=True)
    """
)

COUNT = 2_500
BOUND_KB = 5.0  # per variable, beyond plain TensorFlow doing the same


def _start(kind: str, tmp_path: Path) -> subprocess.Popen[str] | forked.Process:
    """The child for ``kind``, forked from the server that imported TensorFlow
    (:mod:`tests.support.forked`: what it imported before is in the warm-up's baseline),
    or a new ``python`` with ``SAFEVARS_TEST_FORK=0``; its output in ``tmp_path``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out, err = tmp_path / f"{kind}.out", tmp_path / f"{kind}.err"
    command = ["-c", _CHILD, kind, str(COUNT)]
    if forked.enabled():
        return forked.start(command, str(out), str(err), env=env)
    with open(out, "w") as o, open(err, "w") as e:
        return subprocess.Popen([sys.executable, *command], stdout=o, stderr=e, env=env)


def _result(
    child: subprocess.Popen[str] | forked.Process, kind: str, tmp_path: Path
) -> dict[str, float]:
    # (A forked child's wait returns None at the deadline; a Popen's raises TimeoutExpired,
    # and the test's finally kills both children.)
    if child.wait(scaled(1500)) is None:
        child.kill()
        child.wait()
        raise AssertionError(f"the {kind} child did not end in {scaled(1500):.0f} s")
    out = (tmp_path / f"{kind}.out").read_text()
    assert child.returncode == 0, (tmp_path / f"{kind}.err").read_text()[-4000:]
    return json.loads(out.strip().splitlines()[-1])


# About 30 s on a quiet 2-core machine.
@pytest.mark.timeout(scaled(1800))
def test_creating_using_and_dropping_thousands_of_variables_returns_memory(tmp_path):
    kinds = ("plain", "safevars")
    children = [_start(kind, tmp_path) for kind in kinds]  # (each measures itself)
    try:
        plain, safe = [_result(child, kind, tmp_path) for child, kind in zip(children, kinds)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    print("plain", plain, "safevars", safe)  # (the figures, with -s)
    assert safe["per_variable_kb"] - plain["per_variable_kb"] < BOUND_KB, (plain, safe)
    # A kept mutex also keeps the thread that hands it over.
    assert safe["threads_after"] <= safe["threads_before"] + 4, safe
    assert safe["live_locks"] <= 2, safe  # (the last one a thread held may linger)
