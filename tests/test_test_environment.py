"""The test environment itself: hangs fail, and fail soon.

* ``pytest-timeout`` is active (declared in the ``test`` extra, configured in
  ``pyproject.toml``), and a run without it says so: it fails at start-up when ``CI`` is
  true and warns loudly otherwise (``tests/conftest.py``). Checked end to end by running
  pytest in a subprocess with ``-p no:timeout`` against this repository's own
  ``pyproject.toml`` and ``conftest.py``.
* The thread helpers (``tests/support/threading_harness.py``) join every thread against one
  deadline, so n deadlocked threads fail after one timeout, not n.
* TensorFlow gives each op one thread unless the run says otherwise (``conftest.py``).
* The default run is parallel (``conftest.py``), and a run started with Ctrl-C ignored
  gives the processes it starts Ctrl-C back (``tests/support/signals.py``).
* A child forked from the preloaded server (``tests/support/forked.py``) gets what a new
  ``python`` process would: arguments, environment, directory, exit status.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import types

import pytest
import tensorflow as tf

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
import safevars
from tests.support import forked, threading_harness
from tests.support.deadlines import scaled
from tests.support.threading_harness import call_bounded, join_all, run_threads

REPO = pathlib.Path(__file__).resolve().parent.parent
THIS_FILE = pathlib.Path(__file__).resolve().relative_to(REPO)
MISSING = "pytest-timeout is not active"


# ---------------------------------------------------------------------- TensorFlow's threads


def test_tensorflow_gives_each_op_the_threads_the_environment_names():
    """One thread per op unless the run sets ``TF_NUM_INTRAOP_THREADS`` (conftest.py): in
    this process, and as the variable in the environment that the processes tests start
    inherit (that they get this process's environment is the forked-child test below)."""
    from tests.conftest import intra_op_threads

    threads = int(os.environ["TF_NUM_INTRAOP_THREADS"])
    assert tf.config.threading.get_intra_op_parallelism_threads() == threads
    unset: dict[str, str] = {}
    assert intra_op_threads(unset) == 1 and unset == {"TF_NUM_INTRAOP_THREADS": "1"}
    chosen = {"TF_NUM_INTRAOP_THREADS": "2"}
    assert intra_op_threads(chosen) == 2 and chosen == {"TF_NUM_INTRAOP_THREADS": "2"}
    with pytest.raises(ValueError, match="TF_NUM_INTRAOP_THREADS .* got 'two'"):
        intra_op_threads({"TF_NUM_INTRAOP_THREADS": "two"})


# ---------------------------------------------------------------------- the parallel run


def _command_line_config(**options: object) -> types.SimpleNamespace:
    """What ``pytest_cmdline_main`` reads of a controller's config, with pytest-xdist."""
    plugins = types.SimpleNamespace(hasplugin=lambda name: name == "xdist")
    defaults = {"numprocesses": None, "dist": "no", "tx": []}
    return types.SimpleNamespace(
        pluginmanager=plugins, option=types.SimpleNamespace(**{**defaults, **options})
    )


def test_the_default_run_is_parallel_and_a_chosen_one_is_left_alone():
    """With nothing said on the command line, the run spreads whole files over
    ``WORKERS`` workers; a command line that chooses its own distribution keeps it."""
    from tests import conftest

    config = _command_line_config()
    conftest.pytest_cmdline_main(config)
    assert (config.option.numprocesses, config.option.dist) == (conftest.WORKERS, "loadfile")
    chosen = _command_line_config(numprocesses=2, dist="load")
    conftest.pytest_cmdline_main(chosen)
    assert (chosen.option.numprocesses, chosen.option.dist) == (2, "load")
    one = _command_line_config(numprocesses=0)
    conftest.pytest_cmdline_main(one)
    assert (one.option.numprocesses, one.option.dist) == (0, "no")


# ---------------------------------------------------------------------- Ctrl-C


_SIGINT_OF_A_CHILD = (
    "import signal, subprocess, sys\n"
    "from tests.support.signals import default_sigint\n"
    "restored = default_sigint() if sys.argv[1] == 'restore' else None\n"
    "code = 'import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)'\n"
    "child = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
    "print(restored, child.stdout.strip())\n"
)


@pytest.mark.parametrize("restore", [True, False])
def test_a_run_started_with_ctrl_c_ignored_gives_its_children_ctrl_c(restore):
    """A run started with SIGINT ignored (``python -m pytest &`` from a script): after
    ``default_sigint`` (``conftest.py``) the processes it starts raise
    ``KeyboardInterrupt`` on Ctrl-C; without it they ignore it, as the Ctrl-C tests'
    children did."""
    done = subprocess.run(
        [sys.executable, "-c", _SIGINT_OF_A_CHILD, "restore" if restore else "leave"],
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        timeout=scaled(60),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == (["True", "True"] if restore else ["None", "False"])


# ---------------------------------------------------------------------- pytest-timeout


def test_the_timeout_plugin_is_active_and_configured(pytestconfig):
    assert pytestconfig.pluginmanager.hasplugin("timeout"), MISSING
    assert float(pytestconfig.getini("timeout")) > 0


def test_the_test_extra_declares_pytest_timeout():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    extra = project["project"]["optional-dependencies"]["test"]
    assert any(req.replace(" ", "").startswith("pytest-timeout") for req in extra), extra
    assert project["tool"]["pytest"]["ini_options"]["timeout"] > 0


def _pytest_without_timeout(ci: str | None) -> subprocess.Popen:
    """Starts ``pytest -p no:timeout --collect-only`` on this file, in the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    if ci is not None:
        env["CI"] = ci
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:timeout",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            str(THIS_FILE),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_run_without_pytest_timeout_fails_on_ci_and_warns_elsewhere():
    # Both runs at once: each pays for importing TensorFlow (conftest.py does).
    on_ci, local = _pytest_without_timeout("true"), _pytest_without_timeout(None)
    try:
        ci_out, _ = on_ci.communicate(timeout=threading_harness.JOIN_TIMEOUT)
        local_out, _ = local.communicate(timeout=threading_harness.JOIN_TIMEOUT)
    finally:
        for proc in (on_ci, local):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # On CI: a usage error before anything is collected.
    assert on_ci.returncode == pytest.ExitCode.USAGE_ERROR, ci_out
    assert "CI is set: refusing to run" in ci_out and "pytest-timeout" in ci_out, ci_out
    assert "collected" not in ci_out, ci_out
    # Elsewhere: the run goes on, and says so in the header, the warnings and the summary.
    assert local.returncode == pytest.ExitCode.OK, local_out
    header, _, rest = local_out.partition("collected")
    assert MISSING in header, local_out
    assert "PytestConfigWarning: WARNING: pytest-timeout" in rest, local_out
    assert re.search(rf"^!+ {MISSING} !+$", rest, re.MULTILINE), local_out  # summary


# ---------------------------------------------------------------------- worker crashes

_CRASHING_TESTS = """
import ctypes, os, pathlib
CRASHED = pathlib.Path(__file__).with_name("crashed")

def test_before():
    pass

def test_crashing():
    how = os.environ["HOW"]
    if how == "segfault_once" and CRASHED.exists():
        return
    CRASHED.write_text("x")
    if how == "exit":
        os._exit(3)
    ctypes.string_at(0)  # SIGSEGV

def test_after():
    pass
"""

_REGISTER_THE_PLUGIN = """
import pytest
from tests.support import worker_crashes

@pytest.hookimpl(trylast=True)  # as tests/conftest.py does it
def pytest_configure(config):
    config.pluginmanager.register(worker_crashes, "safevars-worker-crashes")
"""


def _crashing_run(directory: pathlib.Path, how: str, *options: str) -> subprocess.Popen:
    """Starts pytest with two workers on ``_CRASHING_TESTS`` (no TensorFlow: it takes
    about a second), ``how`` the crashing test crashes."""
    directory.mkdir()
    (directory / "test_crashing.py").write_text(_CRASHING_TESTS)
    (directory / "conftest.py").write_text(_REGISTER_THE_PLUGIN)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env.update(HOW=how, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", *options]
    return subprocess.Popen(
        command,
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_test_whose_worker_dies_of_a_signal_runs_once_more_and_the_crash_is_shown(tmp_path):
    """``tests/support/worker_crashes.py``: a first SIGSEGV is a rerun (its next run
    counts), shown with the crashed worker's stacks; a second one fails, as do a worker
    that died without a signal, a crash the scheduler does not give to another worker,
    and a rerun that never came (no worker left to run it)."""
    runs = {
        "once": _crashing_run(tmp_path / "once", "segfault_once", "--dist", "loadfile"),
        "always": _crashing_run(
            tmp_path / "always", "segfault", "--dist", "loadfile", "--max-worker-restart", "1"
        ),
        "exit": _crashing_run(
            tmp_path / "exit", "exit", "--dist", "loadfile", "--max-worker-restart", "0"
        ),
        "load": _crashing_run(tmp_path / "load", "segfault_once", "--dist", "load"),
        "no_restart": _crashing_run(
            tmp_path / "no_restart",
            "segfault_once",
            "--dist",
            "loadfile",
            "--max-worker-restart",
            "0",
        ),
    }
    out = {}
    try:
        for name, run in runs.items():
            out[name], _ = run.communicate(timeout=threading_harness.JOIN_TIMEOUT)
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.wait()
    closing = {name: text.strip().splitlines()[-1] for name, text in out.items()}

    once = out["once"]
    assert runs["once"].returncode == pytest.ExitCode.OK, once
    assert re.fullmatch(r"3 passed, 1 rerun in .*", closing["once"]), once
    assert "worker crashed in test_crashing.py::test_crashing (ran again)" in once, once
    report = once.partition("(ran again)")[2]
    assert "Fatal Python error: Segmentation fault" in report, once
    assert re.search(r'File ".*test_crashing\.py", line \d+ in test_crashing', report), once

    assert runs["always"].returncode == pytest.ExitCode.TESTS_FAILED, out["always"]
    # (pytest-xdist gives the file to a third worker, past --max-worker-restart: it stops)
    assert re.match(r"1 failed, .*1 rerun in ", closing["always"]), out["always"]
    assert "test_crashing (failed)" in out["always"], out["always"]

    assert runs["exit"].returncode == pytest.ExitCode.TESTS_FAILED, out["exit"]
    assert "rerun" not in closing["exit"] and "failed" in closing["exit"], out["exit"]
    assert "(no fatal-error report: no signal)" in out["exit"], out["exit"]

    assert runs["load"].returncode == pytest.ExitCode.TESTS_FAILED, out["load"]
    assert "rerun" not in closing["load"] and "failed" in closing["load"], out["load"]

    no_restart = out["no_restart"]  # a rerun that never came: a failure
    assert runs["no_restart"].returncode == pytest.ExitCode.TESTS_FAILED, no_restart
    assert re.match(r"1 failed, .*1 rerun in ", closing["no_restart"]), no_restart
    assert "test_crashing (did not run again: failed)" in no_restart, no_restart


# ---------------------------------------------------------------------- thread joins


class _Recorded(threading.Thread):
    """A thread that records the timeout of every ``join``."""

    timeouts: list[float | None]

    def join(self, timeout: float | None = None) -> None:
        type(self).timeouts.append(timeout)
        super().join(timeout)


class _RecordedEvent(threading.Event):
    """An event that records the timeout of every ``wait``."""

    timeouts: list[float | None]

    def wait(self, timeout: float | None = None) -> bool:
        type(self).timeouts.append(timeout)
        return super().wait(timeout)


@pytest.fixture
def stuck():
    """An event that stuck workers wait on; set at teardown so they all end."""
    release = threading.Event()
    yield release
    release.set()


def test_stuck_threads_fail_together_after_one_deadline(monkeypatch, stuck):
    """Six deadlocked workers fail after one JOIN_TIMEOUT, not six."""
    budget = 0.2
    _Recorded.timeouts = []
    monkeypatch.setattr(threading_harness, "JOIN_TIMEOUT", budget)
    # Only the harness's own threads are recorded (threading.Thread itself is untouched).
    _RecordedEvent.timeouts = []
    monkeypatch.setattr(
        threading_harness,
        "threading",
        types.SimpleNamespace(
            Thread=_Recorded, Barrier=threading.Barrier, Event=_RecordedEvent, Lock=threading.Lock
        ),
    )
    with pytest.raises(AssertionError, match="deadlock") as failure:
        run_threads(6, lambda i: stuck.wait())
    assert len(_Recorded.timeouts) == 6
    # One budget shared by every wait of the call: the wait for the workers may take it
    # all, each join gets what is left.
    waits = _Recorded.timeouts + _RecordedEvent.timeouts
    assert all(t is not None and 0.0 <= t <= budget for t in waits)
    assert sum(waits) <= budget
    assert str(failure.value).count("Thread-") == 6  # every stuck thread is named


def test_join_all_returns_the_threads_still_alive(stuck):
    done = threading.Thread(target=lambda: None, name="done")
    waiting = threading.Thread(target=stuck.wait, name="waiting", daemon=True)
    for t in (done, waiting):
        t.start()
    assert join_all([waiting, done], timeout=0.1) == ["waiting"]
    stuck.set()
    assert join_all([waiting, done]) == []


def test_run_threads_reraises_a_worker_error():
    def work(i):
        if i == 2:
            raise KeyError("worker 2")

    with pytest.raises(KeyError, match="worker 2"):
        run_threads(4, work)


# A worker's own error, while the others wait for it for good. Run inside call_bounded
# with a bound far below JOIN_TIMEOUT (raised for the test, so a harness that waits for
# the others cannot pass): the error must come out at once, not as "still running".
PROMPTLY = 60.0  # seconds (scaled): a bound on a hang, far above the milliseconds it takes


@pytest.fixture
def long_join_timeout(monkeypatch):
    monkeypatch.setattr(threading_harness, "JOIN_TIMEOUT", 10 * scaled(PROMPTLY))


def test_a_worker_error_is_raised_while_the_others_wait_on_a_barrier_for_it(
    long_join_timeout,
):
    """Rounds on a barrier: worker 0 fails in round 1 (a LockOrderError, taking locks out
    of the global order); the others wait at the round's barrier for a worker that never
    comes. The test sees the LockOrderError, not a deadlock report."""
    first, second = safevars.SafeVariable(0.0), safevars.SafeVariable(0.0)
    rounds = threading.Barrier(4)

    def work(i):
        for r in range(3):
            if i == 0 and r == 1:
                with safevars.locked(second):
                    first.assign(1.0)  # out of order: LockOrderError
            second.update(lambda x: x + 1.0)
            rounds.wait()  # no timeout: the harness must not wait for this

    try:
        with pytest.raises(safevars.LockOrderError, match="global lock order") as failure:
            call_bounded(lambda: run_threads(4, work), timeout=PROMPTLY)
    finally:
        rounds.abort()  # lets the three waiting workers end
    if sys.version_info >= (3, 11):  # the note names the workers still running
        (note,) = failure.value.__notes__
        assert note.startswith("run_threads: raised by a worker; still running then:"), note
        assert note.count("Thread-") == 3, note


def test_a_worker_error_is_raised_while_the_others_wait_on_a_lock_it_left_held(
    long_join_timeout,
):
    held = threading.Lock()
    taken = threading.Event()

    def work(i):
        if i == 0:
            held.acquire()  # and never released: the worker fails holding it
            taken.set()
            raise KeyError("worker 0 failed holding the lock")
        taken.wait()
        with held:
            pass

    try:
        with pytest.raises(KeyError, match="holding the lock"):
            call_bounded(lambda: run_threads(3, work), timeout=PROMPTLY)
    finally:
        held.release()  # lets the two waiting workers end


def test_call_bounded_returns_reraises_and_fails_when_stuck(stuck):
    assert call_bounded(lambda: 41 + 1) == 42
    with pytest.raises(KeyError, match="inside"):
        call_bounded(lambda: {}["inside"])
    with pytest.raises(AssertionError, match=f"still running after {scaled(0.1)}s"):
        call_bounded(stuck.wait, timeout=0.1)


# ---------------------------------------------------------------------- forked children


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "python"])
def test_a_child_gets_the_arguments_environment_and_directory_python_would(tmp_path, fork):
    """A cluster script or documentation block runs forked from a server that imported
    TensorFlow (``tests/support/forked.py``): as ``python script.py ARGS`` would, with
    its arguments, its own environment only (not the server's: ``tests/conftest.py``
    set ``TF_CPP_MIN_LOG_LEVEL`` before the server started), its directory and its exit
    status."""
    assert "TF_CPP_MIN_LOG_LEVEL" in os.environ
    script = tmp_path / "child.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(),\n"
        "    'mine': os.environ.get('MINE'), 'log': os.environ.get('TF_CPP_MIN_LOG_LEVEL'),\n"
        "    'main': __name__, 'path0': sys.path[0]}))\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    out, err = tmp_path / "out", tmp_path / "err"
    env = {"MINE": "yes", "PATH": os.environ.get("PATH", "")}
    if fork:
        child = forked.start([str(script), "a b", "3"], str(out), str(err), env, str(tmp_path))
    else:
        with open(out, "w") as o:
            child = subprocess.Popen(
                [sys.executable, str(script), "a b", "3"], stdout=o, env=env, cwd=tmp_path
            )
    assert child.wait(scaled(60)) == 3
    assert json.loads(out.read_text()) == {
        "argv": ["a b", "3"],
        "cwd": str(tmp_path),
        "mine": "yes",
        "log": None,
        "main": "__main__",
        "path0": str(tmp_path),
    }


def test_a_forked_child_reports_code_errors_and_can_be_killed(tmp_path):
    out, err = str(tmp_path / "out"), str(tmp_path / "err")
    child = forked.start(
        ["-c", "import sys; print(sys.argv[1:]); raise SystemExit('no')", "x"], out, err
    )
    assert child.wait(scaled(60)) == 1
    assert (tmp_path / "out").read_text() == "['x']\n"
    assert (tmp_path / "err").read_text().strip() == "no"
    child = forked.start(["-c", "raise ValueError('bad')"], out, err)
    assert child.wait(scaled(60)) == 1
    assert "ValueError: bad" in (tmp_path / "err").read_text()
    child = forked.start(["-c", "import time; time.sleep(600)"], out, err)
    assert child.poll() is None
    child.kill()
    assert child.wait(scaled(60)) == -9


@pytest.mark.parametrize("fork", ["1", "0"], ids=["forked", "python"])
def test_run_gives_what_subprocess_run_gives(tmp_path, monkeypatch, fork):
    """``forked.run``: a module run with ``-m`` as ``__main__`` from the directory given,
    its exit status and both outputs; a child past its timeout is killed and raises
    ``subprocess.TimeoutExpired`` with what it wrote, as ``subprocess.run`` does."""
    monkeypatch.setenv("SAFEVARS_TEST_FORK", fork)
    (tmp_path / "mod.py").write_text(
        "import os, sys\n"
        "print(__name__, sys.argv[1:], os.getcwd())\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(4)\n"
    )
    done = forked.run(["-m", "mod", "x"], timeout=scaled(60), cwd=str(tmp_path))
    assert (done.returncode, done.stdout, done.stderr) == (
        4,
        f"__main__ ['x'] {tmp_path}\n",
        "to stderr\n",
    )
    hang = "import time; print('started', flush=True); time.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        forked.run(["-c", hang], timeout=scaled(2))
    assert "started" in str(caught.value.stdout)
