"""Catch variable races in your test suite with ``safevars.audit(raise_on_race=True)``.

Copy this pattern: run the code under test from several threads inside
``with audit(raise_on_race=True):``. If any thread's read-then-write of a variable can
interleave with another thread's write, the block raises ``RaceDetectedError`` (an
``AssertionError``, so pytest reports a failed check) with the variable's name and the
file:line of the read and of the writes. It does not need the race to actually lose an
update during the test: a single increment per thread is enough to catch it.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import tensorflow as tf
from _smoke import run_example

import safevars
from safevars.audit import audit
from safevars.errors import RaceDetectedError

JOIN_TIMEOUT = 120.0


def run_in_threads(work, threads: int = 4) -> None:
    """Runs ``work()`` in ``threads`` threads released together; re-raises failures."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait(JOIN_TIMEOUT)
            work()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    workers = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for t in workers:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT  # one deadline for all
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in workers), "workers did not finish (deadlock?)"
    if errors:
        raise errors[0]


# The code under test -------------------------------------------------------------


def add_one_racy(v: tf.Variable) -> None:
    v.assign(v.read_value() + 1.0)  # read, then write: not atomic


def add_one_locked(v: safevars.SafeVariable) -> None:
    with safevars.locked(v):
        v.assign(v.read_value() + 1.0)


# The tests -------------------------------------------------------------------------


def test_racy_increment_is_caught():
    v = tf.Variable(0.0, name="hits")
    with pytest.raises(RaceDetectedError, match="lost update on 'hits:0'") as caught:
        with audit(raise_on_race=True):
            run_in_threads(lambda: add_one_racy(v))  # one increment per thread
    assert "test_audit_example.py" in str(caught.value)  # points at add_one_racy


def test_locked_increment_passes():
    v = safevars.SafeVariable(0.0, name="hits")
    with audit(raise_on_race=True) as report:
        run_in_threads(lambda: [add_one_locked(v) for _ in range(10)])
    assert report.races == []
    assert float(v.numpy()) == 40.0


def test_audit_demo_runs_and_reports_the_race():
    out = run_example("audit_demo.py", "--threads", "3", "--iterations", "5")
    plain, fixed = out.split("--- SafeVariable.update")
    assert "1 race(s) found" in plain and "lost update on 'counter:0'" in plain, out
    assert re.search(r"read\s+\S*audit_demo\.py:\d+\s+`value = counter\.read_value\(\)", plain)
    assert re.search(r"write\s+\S*audit_demo\.py:\d+\s+`counter\.assign\(value \+ 1\.0\)", plain)
    assert "0 race(s) found" in fixed and "final value 15 of 15" in fixed, out
