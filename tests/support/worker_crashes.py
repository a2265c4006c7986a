"""A test whose pytest-xdist worker dies of a fatal signal runs once more, and the crash is
shown, not hidden.

Why: TensorFlow itself crashes now and then. TensorFlow 2.18's ``MirroredStrategy`` ended
a worker with a fatal signal twice in CI runs of the ``core-tf2.18`` cell, both in
``model.fit`` (the first a SIGSEGV in Keras' ``EpochIterator.reset``); 15 runs of that cell's tests here and 20 of
the strategy tests alone did not crash again. With ``--dist loadfile`` pytest-xdist
already gives a crashed worker's unfinished file to a new worker, the crashed test
included, and runs it again; but it counts the crash as a failure whatever that second
run gives, so one crash of TensorFlow's own failed the whole run.

What this plugin changes, in pytest-xdist's controller:

* A worker writes its fatal-error report (:mod:`faulthandler`: every thread's Python
  stack, the crashing one headed "Current thread") to a file of its own. When the
  worker dies, the controller reads it.
* If the worker died of a fatal signal (the report says ``Fatal Python error``), the
  test's first crash is reported as ``rerun`` (``R``, and ``1 rerun`` in the closing
  line), and its run in the new worker is what counts. A second crash of the same test
  fails it, as does a worker that died otherwise (killed, ``os._exit``: no report).
* Every crash is listed in the summary, with the report, whether or not it was run
  again; a crashed test that never ran again (no worker left to run it) fails the run,
  and so does a crash under a scheduler that does not re-queue it (``--dist load``).

Loaded by ``tests/conftest.py``; without pytest-xdist (``-p no:xdist``, ``-n 0``) a
crash ends the run, as it always did.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from typing import IO, Any

import pytest

#: The words of :mod:`faulthandler`'s report of a fatal signal (SIGSEGV, SIGFPE,
#: SIGABRT, SIGBUS, SIGILL).
FATAL = "Fatal Python error"

_INPUT_KEY = "safevars_crash_reports"  # workerinput: the directory of the reports

# The controller's state.
_directory: str | None = None
_last_down: str | None = None
_crashes: dict[str, list[str]] = {}  # nodeid -> the report of each crash
_ran_again: set[str] = set()
_never_ran_again: set[str] = set()

# A worker's report file, kept open for faulthandler.
_report_file: IO[str] | None = None


def _report_path(directory: str, worker: str) -> str:
    return os.path.join(directory, f"{worker}.txt")


def pytest_configure(config: pytest.Config) -> None:
    """The controller makes the reports' directory; a worker writes its report there
    (this runs after pytest's own faulthandler plugin, whose stderr it replaces)."""
    global _directory, _report_file
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        directory = workerinput.get(_INPUT_KEY)
        if directory:
            _report_file = open(_report_path(directory, workerinput["workerid"]), "w")  # noqa: SIM115
            faulthandler.enable(_report_file, all_threads=True)
    elif config.pluginmanager.hasplugin("dsession"):  # (xdist's, in its controller)
        _directory = tempfile.mkdtemp(prefix="safevars-worker-crashes-")


def pytest_unconfigure(config: pytest.Config) -> None:
    global _directory, _report_file
    if _report_file is not None:
        faulthandler.disable()
        _report_file.close()
        _report_file = None
    if _directory is not None:
        shutil.rmtree(_directory, ignore_errors=True)
        _directory = None


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks, absent without the plugin
def pytest_configure_node(node: Any) -> None:
    if _directory is not None:
        node.workerinput[_INPUT_KEY] = _directory


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    global _last_down
    _last_down = node.gateway.id  # (the crashed test is handed over next)


def _read_report(worker: str | None) -> str:
    if _directory is None or worker is None:
        return ""
    try:
        with open(_report_path(_directory, worker)) as file:
            return file.read()
    except OSError:
        return ""


def _requeues_crashed_tests(sched: Any) -> bool:
    """pytest-xdist's scope schedulers (``--dist loadfile``, ``loadscope``) give a dead
    worker's unfinished scope, the crashed test included, to another worker."""
    from xdist.scheduler.loadscope import LoadScopeScheduling

    return isinstance(sched, LoadScopeScheduling)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    report_text = _read_report(_last_down)
    crashes = _crashes.setdefault(crashitem, [])
    crashes.append(report_text)
    if len(crashes) == 1 and FATAL in report_text and _requeues_crashed_tests(sched):
        # Not a failure: pytest-xdist has put the test back in the queue.
        report.outcome = "rerun"  # type: ignore[assignment]


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = report.nodeid
    if nodeid in _crashes and nodeid not in _never_ran_again and report.when != "???":
        _ran_again.add(nodeid)  # ("???": pytest-xdist's report of the crash)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Any:
    """After the tests: a test that crashed once and never ran again is a failure."""
    result = yield
    for nodeid, crashes in _crashes.items():
        if len(crashes) == 1 and nodeid not in _ran_again and FATAL in crashes[0]:
            _never_ran_again.add(nodeid)
            path = nodeid.split("::")[0]
            failed = pytest.TestReport(
                nodeid=nodeid,
                location=(path, None, path),
                keywords={},
                outcome="failed",
                longrepr=f"{nodeid} crashed its worker and did not run again",
                when="call",
            )
            session.config.hook.pytest_runtest_logreport(report=failed)
    return result


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for nodeid, crashes in _crashes.items():
        if len(crashes) == 1 and FATAL in crashes[0]:
            then = "did not run again: failed" if nodeid in _never_ran_again else "ran again"
        else:
            then = "failed"
        terminalreporter.write_sep("!", f"worker crashed in {nodeid} ({then})", yellow=True)
        for number, text in enumerate(crashes, 1):
            terminalreporter.write_line(f"crash {number} of {len(crashes)}:")
            terminalreporter.write_line(text.strip() or "(no fatal-error report: no signal)")
