"""Shared pytest configuration.

* Two logical CPU devices are configured before TensorFlow initializes its devices, so
  ``MirroredStrategy`` runs with two real replicas on any machine.
* ``mode`` runs a behavioural test eagerly and inside ``tf.function``: call
  ``mode(fn)`` to get ``fn`` back either as is or wrapped in a ``tf.function``.
* ``pytest-timeout`` must be active (the ``timeout`` in ``pyproject.toml`` is its option):
  without it a hang that a thread join does not catch blocks the run forever. A run without
  the plugin fails at start-up when ``CI`` is set to true, and otherwise warns in the
  header, as a warning and again in the summary.
"""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 2

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )
except RuntimeError:  # Devices already initialized by an earlier import.
    pass


@pytest.fixture(params=["eager", "tf_function"])
def mode(request):
    """Returns a wrapper: identity eagerly, ``tf.function`` otherwise."""

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


def pytest_configure(config: pytest.Config) -> None:
    """Fails the run on CI, and warns elsewhere, when pytest-timeout is not active."""
    if not _timeout_plugin_missing(config):
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
    """Repeats it at the end, where it is seen after a long run."""
    if _timeout_plugin_missing(config):
        terminalreporter.write_sep("!", "pytest-timeout is not active", red=True, bold=True)
        terminalreporter.write_line(f"WARNING: {_NO_TIMEOUT_MESSAGE}", red=True, bold=True)
