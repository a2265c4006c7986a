"""How the smoke tests run an example: as a user would, quiet, with a bounded wait.

The environment is the user's default (no ``TF_CPP_MIN_LOG_LEVEL``, not verbose, no
``TF_CONFIG``). The example is forked from the tests' server that imported TensorFlow
once (``tests/support/forked.py``), which saves each run about 3.5 CPU-seconds of
imports; there TensorFlow is imported before the example quiets its start-up, so only a
run with ``fresh=True`` (a new ``python``, as a user starts it: the race demo's and the
exactly-once example's smoke tests, and every run with ``SAFEVARS_TEST_FORK=0``) checks
that the start-up log stays hidden. ``examples/test_quiet.py`` checks that every example
quiets TensorFlow before it imports it.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Callable

from _quiet import VERBOSE_ENV, startup_noise

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:  # (the forked children's server imports tests.support.forked)
    sys.path.insert(0, REPO)
from tests.support import forked  # noqa: E402

#: Seconds times ``SAFEVARS_TEST_TIMEOUT_SCALE``: ``tests/support/deadlines.py``, run from
#: its file (the examples' tests are not in the ``tests`` package).
scaled: Callable[[float], float] = runpy.run_path(
    os.path.join(HERE, os.pardir, "tests", "support", "deadlines.py")
)["scaled"]
ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", VERBOSE_ENV)
}


def start(
    script: str, *args: object, timeout: float = 300, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` with ``args``; returns the finished process.

    ``timeout``: seconds at scale 1, a bound on a hang (multiplied by
    ``SAFEVARS_TEST_TIMEOUT_SCALE``). ``fresh``: a new ``python`` process, not a forked
    one (see the module's docstring).
    """
    command = [os.path.join(HERE, script), *map(str, args)]
    return forked.run(command, timeout=scaled(timeout), env=ENV, fork=False if fresh else None)


def run_example(script: str, *args: object, timeout: float = 300, fresh: bool = False) -> str:
    """Runs ``examples/<script>`` (:func:`start`); fails unless it exits 0 (and, in a
    new ``python``, with no start-up log line: :func:`check_quiet`).

    Returns its standard output.
    """
    done = start(script, *args, timeout=timeout, fresh=fresh)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    check_quiet(done, fresh)
    return done.stdout


def check_quiet(done: subprocess.CompletedProcess, fresh: bool) -> None:
    """Fails if an example's stderr holds a start-up log line. Only a new ``python``
    is checked: a forked child finds TensorFlow imported, so the example's quieting does
    nothing and the first look at the devices logs (``failed call to cuInit``)."""
    if fresh or not forked.enabled():
        assert startup_noise(done.stderr) == [], done.stderr
