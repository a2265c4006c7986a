"""Runs the scripts in ``tests/distributed/`` as subprocesses and reads their results.

In-process ``tf.distribute`` servers cannot be shut down, so every cluster runs in
processes of its own on 127.0.0.1; each script prints one JSON line as its result.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import portpicker

from tests.support import forked
from tests.support.deadlines import scaled

HERE = os.path.dirname(os.path.abspath(__file__))


def script(name: str) -> str:
    """The path of ``tests/distributed/scripts/<name>``."""
    return os.path.join(HERE, "scripts", name)


def last_json_line(text: str) -> dict:
    """The last line of ``text`` that starts with ``{``, parsed."""
    lines = [line for line in text.splitlines() if line.startswith("{")]
    assert lines, f"no JSON result in output:\n{text[-3000:]}"
    return json.loads(lines[-1])


# What a process prints when its server cannot bind its port: another process took the
# port between portpicker finding it free and the server binding it.
_PORT_TAKEN = ("Could not start gRPC server", "Address already in use")
# What TensorFlow's coordinator raised once (2026-11-28, 1 of 19 runs of the
# exactly-once cluster, under .ci/run) after a worker was killed on purpose: a surviving
# worker answered a RunComponentFunction with gRPC status 13, which the coordinator does
# not take for a worker failure, so its join() raised InternalError. A transport error of
# TensorFlow's, not a result of the code under test: the group runs again.
_TRANSPORT_FAILED = ("Unable to parse request",)
# A group a process of which failed saying one of these runs again, up to ATTEMPTS runs
# in all.
_RUN_AGAIN = _PORT_TAKEN + _TRANSPORT_FAILED
ATTEMPTS = 3
# Seconds the other processes get to end on their own once one has failed (a script
# with --dump-after prints its stacks then); after that they are killed.
_GRACE = 5.0


def _start(
    command: list[str], out: str, err: str, env: dict[str, str]
) -> subprocess.Popen[str] | forked.Process:
    """``python *command``: forked from a server that imported TensorFlow
    (:mod:`tests.support.forked`), or a new process with ``SAFEVARS_TEST_FORK=0``."""
    if forked.enabled():
        return forked.start(command, out, err, env=env)
    with open(out, "w") as o, open(err, "w") as e:
        return subprocess.Popen([sys.executable, *command], stdout=o, stderr=e, env=env)


def _run_all(
    commands: list[list[str]], timeout: float, dump_after: bool
) -> list[tuple[int | None, str, str]]:
    """Starts every command at once; returns ``(returncode, stdout, stderr)`` of each,
    ``returncode`` None for a process killed at the deadline or after another failed."""
    if dump_after:
        commands = [c + ["--dump-after", str(max(1.0, timeout - 10.0))] for c in commands]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as files:
        # Files, not pipes: the processes are polled together, none is read until all end.
        outs = [
            files.enter_context(open(os.path.join(tmp, f"{i}.out"), "w+"))
            for i in range(len(commands))
        ]
        errs = [
            files.enter_context(open(os.path.join(tmp, f"{i}.err"), "w+"))
            for i in range(len(commands))
        ]
        procs = [_start(c, o.name, e.name, env) for c, o, e in zip(commands, outs, errs)]
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                codes = [p.poll() for p in procs]  # every one, each time round
                if None not in codes:
                    break
                if any(code not in (None, 0) for code in codes):
                    # The others would wait for the failed one on their collectives.
                    deadline = min(deadline, time.monotonic() + _GRACE)
                time.sleep(0.05)
        finally:
            codes = [p.poll() for p in procs]
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        texts = []
        for o, e in zip(outs, errs):
            o.seek(0)
            e.seek(0)
            texts.append((o.read(), e.read()))
    return [(code, out, err) for code, (out, err) in zip(codes, texts)]


def _results(
    commands: list[list[str]], runs: list[tuple[int | None, str, str]], timeout: float
) -> list[dict]:
    # A process that failed first: the others may only have been killed because of it.
    for command, (code, _, err) in zip(commands, runs):
        assert code in (0, None), f"{command[0]} failed ({code}):\n{err[-5000:]}"
    for command, (code, _, err) in zip(commands, runs):
        assert code == 0, f"{command[0]} did not end within {timeout} s:\n{err[-5000:]}"
    return [last_json_line(out) for _, out, _ in runs]


def run_together(
    commands: list[list[str]], timeout: float, *, dump_after: bool = False
) -> list[dict]:
    """Starts every command at once with this Python; returns their JSON results in order.

    Fails if any process exits non-zero or the group is not done within ``timeout``
    seconds at scale 1 (multiplied by ``SAFEVARS_TEST_TIMEOUT_SCALE``, see
    ``tests/support/deadlines.py``); every process still running then is killed, and once one process failed
    the others are killed 5 s later (a worker whose peer died waits forever on its
    collectives). With ``dump_after``, each command gets ``--dump-after T`` (10 s
    before the deadline): a script that supports it prints its threads' stacks and
    exits, so a hang shows where it hangs.

    Scripts that pick their cluster's ports themselves (the parameter-server ones whose
    workers run as processes of their own) can lose one to another process before its
    server binds it: when a process fails for that, the group runs again (new ports),
    up to ``ATTEMPTS`` times; so does a group whose coordinator hit TensorFlow's
    transport error ``_TRANSPORT_FAILED`` after a worker was killed on purpose.
    """
    return _run_retrying(lambda: commands, scaled(timeout), dump_after)


def _run_retrying(
    group: Callable[[], list[list[str]]], timeout: float, dump_after: bool
) -> list[dict]:
    """Runs ``group()`` together, and a new ``group()`` again (up to ``ATTEMPTS``
    runs) while a process fails because a server could not bind its port or because of
    TensorFlow's transport error ``_TRANSPORT_FAILED`` (said on stderr)."""
    for attempt in range(1, ATTEMPTS + 1):
        commands = group()
        runs = _run_all(commands, timeout, dump_after)
        again = [
            text
            for code, _, err in runs
            if code not in (0, None)
            for text in _RUN_AGAIN
            if text in err
        ]
        if not again or attempt == ATTEMPTS:
            return _results(commands, runs, timeout)
        print(f"cluster run {attempt} failed ({again[0]!r}); running it again", file=sys.stderr)
    raise AssertionError("unreachable")


def run_on_ports(
    count: int,
    commands: Callable[[str], list[list[str]]],
    timeout: float,
    *,
    dump_after: bool = False,
) -> list[dict]:
    """:func:`run_together` of ``commands(ports)``, ``ports`` ``count`` free 127.0.0.1
    ports joined by commas (a MultiWorkerMirroredStrategy cluster's ``TF_CONFIG``);
    ``timeout`` is scaled as there.

    A port found free can be taken by another process before a server binds it (another
    cluster starting at the same time, such as the parameter-server script a test runs
    alongside): when a process fails for that, the whole group runs again on new ports,
    up to ``ATTEMPTS`` times.
    """

    def on_fresh_ports() -> list[list[str]]:
        return commands(",".join(str(portpicker.pick_unused_port()) for _ in range(count)))

    return _run_retrying(on_fresh_ports, scaled(timeout), dump_after)
