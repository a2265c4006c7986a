"""Processes forked from a server that has imported TensorFlow once, instead of new
``python`` processes that each import it again.

A test's child process (a documentation block, a cluster script) spends about 3.5
CPU-seconds importing TensorFlow, Keras and safevars before it does anything: measured
on 2026-11-29 on 2 cores, before the cluster scripts were forked, the suite's 77 new
Python processes used 283 of its 781 CPU-seconds. :func:`start` forks the child
from a ``multiprocessing`` forkserver that imported :data:`PRELOAD` and did nothing
else: no device set up, no eager context, no thread pool, no server, so the child may
still configure logical devices, set ``TF_CONFIG`` and start servers as a fresh process
would. It runs the script (``-c`` code, ``-m`` module) as ``__main__``, with the given
arguments, environment and working directory, its output in the given files (file
descriptors 1 and 2 too, for TensorFlow's C++ log). :func:`run` forks one and waits for
it, as ``subprocess.run`` does.

What differs from ``python script.py``: the modules of :data:`PRELOAD` are imported
before the script runs (so a missing import of them would not fail, and whatever a
script does before it imports TensorFlow, such as the examples' quieting of its start-up
log, finds it imported), and environment variables TensorFlow reads when it is imported
(``TF_CPP_MIN_LOG_LEVEL``) are those of the test process. ``SAFEVARS_TEST_FORK=0``
starts every child as a new ``python`` process instead, exactly as a user runs it
(slower).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence

#: What a forked child starts with: these modules imported, nothing run.
PRELOAD = ("numpy", "tensorflow", "keras", "safevars")


def enabled() -> bool:
    """Whether children are forked (the default) rather than started as ``python``."""
    return (
        os.environ.get("SAFEVARS_TEST_FORK", "1") != "0"
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


class Process:
    """A forked child, with the part of :class:`subprocess.Popen` the tests use."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode  # (exitcode joins a child that has ended)

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()


def start(
    argv: Sequence[str],
    stdout: str,
    stderr: str,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> Process:
    """Forks a child that runs ``python *argv`` (a script path and its arguments,
    ``-c CODE`` or ``-m MODULE``), writing its output to the files ``stdout`` and
    ``stderr``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    environment = dict(os.environ if env is None else env)
    process = context.Process(
        target=_child, args=(list(argv), stdout, stderr, environment, cwd), daemon=False
    )
    process.start()
    return Process(process)


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    fork: bool | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``,
    forked (:func:`start`) if ``fork``, by default unless :func:`enabled` says no. Not
    forked, it is exactly that call, with standard input empty as a forked child's is.

    Raises:
      subprocess.TimeoutExpired: the child still ran after ``timeout`` seconds (it is
        killed first), as ``subprocess.run`` does.
    """
    if not (enabled() if fork is None else fork):
        return subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
        )
    with tempfile.TemporaryDirectory(prefix="forked-") as directory:
        out, err = os.path.join(directory, "out"), os.path.join(directory, "err")
        child = start(argv, out, err, env=env, cwd=cwd)
        ended = child.wait(timeout) is not None
        if not ended:
            child.kill()
            child.wait()
        stdout, stderr = (_read(path) for path in (out, err))
    if not ended:
        raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, *argv], child.returncode, stdout, stderr)


def _read(path: str) -> str:
    """What the child wrote to ``path`` ("" if it never opened it)."""
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _child(
    argv: list[str], stdout: str, stderr: str, env: dict[str, str], cwd: str | None
) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # A crash of TensorFlow's (SIGSEGV, SIGABRT) prints each thread's Python stack in
    # the child's stderr, which the test's failure shows (python -X faulthandler).
    faulthandler.enable(sys.stderr, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # (runpy sets argv[0] to the module's file)
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = [script, *argv[1:]]
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        _exit(code)
    except BaseException:
        traceback.print_exc()
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """Ends the child at once, as a script's end would, without the forkserver's own
    clean-up (its atexit handlers belong to the server)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
