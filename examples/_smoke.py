"""How the smoke tests run an example: as a user would, quiet, with a bounded wait.

The environment is the user's default (no ``TF_CPP_MIN_LOG_LEVEL``, not verbose, no
``TF_CONFIG``), so a smoke test also checks that TensorFlow's start-up log stays hidden.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from collections.abc import Callable

from _quiet import VERBOSE_ENV, startup_noise

HERE = os.path.dirname(os.path.abspath(__file__))
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


def start(script: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``examples/<script>`` with ``args``; returns the finished process.

    ``timeout``: seconds at scale 1, a bound on a hang (multiplied by
    ``SAFEVARS_TEST_TIMEOUT_SCALE``).
    """
    command = [sys.executable, os.path.join(HERE, script), *map(str, args)]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=scaled(timeout), env=ENV
    )


def run_example(script: str, *args: object, timeout: float = 300) -> str:
    """Runs ``examples/<script>``; fails unless it exits 0 with no start-up log line.

    Returns its standard output.
    """
    done = start(script, *args, timeout=timeout)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    assert startup_noise(done.stderr) == [], done.stderr
    return done.stdout
