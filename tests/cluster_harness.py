"""Runs the scripts in ``tests/distributed/`` as subprocesses and reads their results.

In-process ``tf.distribute`` servers cannot be shut down, so every cluster runs in
processes of its own on 127.0.0.1; each script prints one JSON line as its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str) -> str:
    """The path of ``tests/distributed/<name>``."""
    return os.path.join(HERE, "distributed", name)


def last_json_line(text: str) -> dict:
    """The last line of ``text`` that starts with ``{``, parsed."""
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result in output:\n{text[-3000:]}"
    return json.loads(lines[-1])


def run_together(
    commands: list[list[str]], timeout: float, *, dump_after: bool = False
) -> list[dict]:
    """Starts every command at once with this Python; returns their JSON results in order.

    Fails if any process exits non-zero or the group is not done within ``timeout``
    seconds; every process still running then is killed (a worker whose peer died
    waits forever on its collectives). With ``dump_after``, each command gets
    ``--dump-after T`` (10 s before the deadline): a script that supports it prints
    its threads' stacks and exits, so a hang shows where it hangs.
    """
    if dump_after:
        commands = [c + ["--dump-after", str(max(1.0, timeout - 10.0))] for c in commands]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    procs = [
        subprocess.Popen(
            [sys.executable, *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for command in commands
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for command, proc in zip(commands, procs):
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, f"{command[0]} failed:\n{err[-5000:]}"
            results.append(last_json_line(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results
