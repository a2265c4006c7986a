"""Shared pytest configuration.

* Two logical CPU devices are configured before TensorFlow initializes its devices, so
  ``MirroredStrategy`` runs with two real replicas on any machine.
* ``mode`` runs a behavioural test eagerly and inside ``tf.function``: call
  ``mode(fn)`` to get ``fn`` back either as is or wrapped in a ``tf.function``.
* ``pytest-timeout`` must be active (the ``timeout`` in ``pyproject.toml`` is its option):
  without it a hang that a thread join does not catch blocks the run forever. A run without
  the plugin fails at start-up when ``CI`` is set to true, and otherwise warns in the
  header, as a warning and again in the summary. Its per-test limit is multiplied by
  ``SAFEVARS_TEST_TIMEOUT_SCALE`` (``tests/support/deadlines.py``), as every deadline of
  the tests is.
* TensorFlow gives each op one thread (``TF_NUM_INTRAOP_THREADS``, which a run may set
  itself): the workers below are the run's parallelism (:func:`intra_op_threads`).
* The run is spread over worker processes by pytest-xdist (in the ``test`` extra): one
  more than the CPUs this process may use (:func:`_workers`), ``--dist loadfile``, so
  each test file runs whole in one worker, in order, as it does without xdist: a
  module-scoped fixture (a subprocess cluster, the quick benchmark run, the
  documentation blocks) runs once. Set here rather than in ``addopts``, so that
  ``-p no:xdist`` (and a run without the plugin) still works; ``-n 0`` runs in one
  process, ``-n N`` in N. A test whose worker dies of a fatal signal (TensorFlow's own
  SIGSEGV) runs once more and the crash is printed at the end
  (``tests/support/worker_crashes.py``).
"""

from __future__ import annotations

import gc
import itertools
import os
from collections.abc import MutableMapping
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def intra_op_threads(environ: MutableMapping[str, str]) -> int:
    """The threads TensorFlow gives one op in this run: ``TF_NUM_INTRAOP_THREADS`` when
    set, else 1, which this sets in ``environ`` for the processes the tests start.

    The workers already run the suite in parallel, one per CPU plus one (see
    :func:`_workers`), and the tests' tensors are small: with TensorFlow's default of
    one intra-op thread per core, each worker's ops also split their work over every
    core, and the threads of three workers compete for two. Measured on 2 cores, nothing
    else running (2026-11-30): the whole suite 8 min 36 s and 851 CPU-seconds with the
    default, 7 min 5 s and 700 CPU-seconds with one thread per op. Only how an op's work
    is divided changes (ops still run concurrently, on the inter-op threads), and the
    bitwise tests compare runs of one process, with one setting.
    """
    value = environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"TF_NUM_INTRAOP_THREADS must be a whole number of threads per op (0: one per "
            f"core, TensorFlow's default), got {value!r}; unset it for one thread per op."
        ) from None


INTRA_OP_THREADS = intra_op_threads(os.environ)

import pytest  # noqa: E402

from tests.support import worker_crashes  # noqa: E402
from tests.support.deadlines import scaled  # noqa: E402
from tests.support.signals import default_sigint  # noqa: E402

default_sigint()  # (a run started in the background may have SIGINT ignored)

NUM_LOGICAL_CPUS = 2


def _set_up_tensorflow() -> None:
    """Two logical CPUs and the intra-op threads, before TensorFlow initializes its
    devices: in each process that runs tests (not in pytest-xdist's controller, which
    only hands them out: importing TensorFlow there delayed the workers' start by 2 s)."""
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
        )
    except RuntimeError:  # Devices already initialized by an earlier import.
        pass
    try:  # (the environment variable reaches the processes the tests start)
        tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    except RuntimeError:  # The context already exists (an earlier import ran an op).
        pass


@pytest.fixture(params=["eager", "tf_function"])
def mode(request):
    """Returns a wrapper: identity eagerly, ``tf.function`` otherwise."""

    import tensorflow as tf

    def run(fn):
        if request.param == "eager":
            return fn
        return tf.function(fn, autograph=False)

    run.name = request.param
    return run


_COLLECTIVE_KEY_BASES = itertools.count(1)


@pytest.fixture
def mirrored_strategy(monkeypatch):
    """A MirroredStrategy over the logical CPU devices (at least two replicas).

    Every strategy built in one process numbers its collective groups from the same base,
    and TensorFlow caches a collective's shape per key; a fresh base per test (the knob
    TensorFlow's own tests use) keeps one test's collectives from clashing with another's.
    """
    import tensorflow as tf

    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(devices) >= 2, "conftest must configure two logical CPUs first"
    monkeypatch.setattr(
        tf.distribute.MirroredStrategy,
        "_collective_key_base",
        1_000_000 * next(_COLLECTIVE_KEY_BASES),
    )
    return tf.distribute.MirroredStrategy(devices[:NUM_LOGICAL_CPUS])


# ---------------------------------------------------------------------- pytest-timeout

_TIMEOUT_PLUGIN = "timeout"  # The name pytest-timeout registers (``-p no:timeout``).
_NO_TIMEOUT_MESSAGE = (
    "pytest-timeout is not active, so a test that hangs (a deadlock a thread join does "
    "not catch) blocks this run forever instead of failing after the `timeout` set in "
    'pyproject.toml. Install the test extra: pip install -e ".[test]" (and do not pass '
    "-p no:timeout)."
)


def _timeout_plugin_missing(config: pytest.Config) -> bool:
    return not config.pluginmanager.hasplugin(_TIMEOUT_PLUGIN)


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@pytest.hookimpl(trylast=True)  # after pytest-timeout's own, whose limit it scales
def pytest_configure(config: pytest.Config) -> None:
    """Sets TensorFlow up unless this is pytest-xdist's controller; fails the run on CI,
    and warns elsewhere, when pytest-timeout is not active; scales its per-test limit
    otherwise; loads :mod:`tests.support.worker_crashes` (a test whose worker dies of a
    fatal signal runs once more)."""
    config.pluginmanager.register(worker_crashes, "safevars-worker-crashes")
    if not config.pluginmanager.hasplugin("dsession"):  # (xdist's, in its controller)
        _set_up_tensorflow()
    if not _timeout_plugin_missing(config):
        _scale_the_per_test_timeout(config)
        return
    if _on_ci():
        raise pytest.UsageError(f"CI is set: refusing to run. {_NO_TIMEOUT_MESSAGE}")
    config.issue_config_time_warning(
        pytest.PytestConfigWarning(f"WARNING: {_NO_TIMEOUT_MESSAGE}"), stacklevel=2
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Puts the warning at the top of the output."""
    if _timeout_plugin_missing(config):
        return [f"WARNING: {_NO_TIMEOUT_MESSAGE}"]
    return []


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """Repeats it at the end, where it is seen after a long run; under pytest-xdist, prints
    the documentation blocks' timings a worker handed back."""
    if _FROM_WORKERS:
        from tests.docs.conftest import summarize

        summarize(terminalreporter, _FROM_WORKERS["timings"], _FROM_WORKERS["run"])
    if _timeout_plugin_missing(config):
        terminalreporter.write_sep("!", "pytest-timeout is not active", red=True, bold=True)
        terminalreporter.write_line(f"WARNING: {_NO_TIMEOUT_MESSAGE}", red=True, bold=True)


def _scale_the_per_test_timeout(config: pytest.Config) -> None:
    """pytest-timeout's limit (``timeout`` in ``pyproject.toml``, ``PYTEST_TIMEOUT`` or
    ``--timeout``, as the plugin resolved it; 0 is off) times the documented factor."""
    base = getattr(config, "_env_timeout", None)
    if base:
        config._env_timeout = scaled(base)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freezes what start-up and collection made (TensorFlow, Keras, the test modules:
    about 340,000 objects that live to the end of the run) out of the garbage
    collector's way (``gc.freeze``), so that a full collection, which tests trigger
    with ``gc.collect()`` and Python's thresholds, walks only what tests made since."""
    gc.freeze()


# ---------------------------------------------------------------------- pytest-xdist


def _workers() -> int:
    """Worker processes when the command line says nothing: one per CPU, plus one.

    About a fifth of the suite's time on 2 cores is spent waiting, not computing (cluster
    processes starting, subprocesses, threads joined): with 2 workers the run used 1.4 of
    the 2 cores, with 3 workers 1.6. Measured on 2 cores with nothing else running
    (2026-11-29 and 30): 2 workers 7 min 31 s to 9 min 46 s in four runs, 3 workers
    6 min 48 s, 4 workers 9 min 21 s (the thread-heavy tests contend); in ``.ci/run``,
    2 workers 7 min 55 s to 8 min 59 s in three runs, 3 workers 8 min 58 s. So 3 is as
    fast as 2 in CI and faster in the runs by hand, and passed the suite beside two CPU
    hogs.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cpus = os.cpu_count() or 1
    return cpus + 1


#: Worker processes when the command line says nothing.
WORKERS = _workers()

#: Whole files to a worker. (Not ``loadgroup`` with ``xdist_group`` marks: with pytest
#: 9.2 and pytest-xdist 3.8 the marks are silently ignored, pytest-xdist issue 1386.)
DIST = "loadfile"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the options
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Runs the suite in parallel (``-n WORKERS --dist loadfile``) unless the command line
    says otherwise (``-n``, ``--dist``, ``-p no:xdist``) or this is a worker already."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    option = config.option
    if (
        option.numprocesses is None
        and getattr(option, "dist", "no") == "no"
        and not getattr(option, "tx", None)
    ):
        option.numprocesses = WORKERS
        option.dist = DIST


#: What workers handed back for the summary (``tests/docs/conftest.py``'s figures).
_FROM_WORKERS: dict[str, Any] = {}


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, absent without the plugin
def pytest_testnodedown(node: Any, error: Any) -> None:
    """In the controller: the figures a worker's tests left in its output."""
    _FROM_WORKERS.update(getattr(node, "workeroutput", {}).get("safevars_doc_blocks", {}))
