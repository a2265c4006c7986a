"""``pytest --safevars-audit``, run for real: pytest in a subprocess, on a test file of its own.

The plugin is the installed entry point (``pytest11``), as in a user's project. Without
the option it must import neither safevars nor TensorFlow (a project's ``conftest.py``
may configure TensorFlow's devices, which importing TensorFlow first would prevent);
with it, a racy test fails with the report, a correctly synchronized one passes, and a
racy test marked ``safevars_no_audit`` passes, a test that fails on its own keeps its
failure with the report beside it. With pytest-xdist installed the audited run uses two
workers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

TESTS = textwrap.dedent(
    """
    import sys
    import threading

    import pytest


    def test_plugin_loaded_without_importing_safevars(pytestconfig):
        if pytestconfig.getoption("safevars_audit"):
            pytest.skip("the audited run imports safevars")
        assert pytestconfig.pluginmanager.hasplugin("safevars")
        assert "safevars" not in sys.modules
        assert "tensorflow" not in sys.modules
        assert "keras" not in sys.modules


    def _two_threads(work):
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
            assert not t.is_alive()


    def _increment(v, lock=None):
        def work():
            for _ in range(3):
                if lock is None:
                    v.assign(v.read_value() + 1)  # RACY LINE
                else:
                    with lock:
                        v.assign(v.read_value() + 1)
        return work


    def test_racy():
        import tensorflow as tf

        _two_threads(_increment(tf.Variable(0, name="shared_counter")))


    def test_locked():
        import tensorflow as tf

        _two_threads(_increment(tf.Variable(0, name="locked_counter"), threading.Lock()))


    @pytest.fixture
    def lock():
        return threading.Lock()  # made before the test's audit: found in its arguments


    def test_locked_by_a_fixture(lock):
        import tensorflow as tf

        _two_threads(_increment(tf.Variable(0, name="fixture_counter"), lock))


    def test_racy_and_failing_on_its_own():
        import tensorflow as tf

        _two_threads(_increment(tf.Variable(0, name="failing_counter")))
        assert False, "the test's own failure"


    @pytest.mark.safevars_no_audit
    def test_racy_opted_out():
        import tensorflow as tf

        _two_threads(_increment(tf.Variable(0, name="opted_out_counter")))
    """
)


def _plugin_installed() -> bool:
    return any(
        e.value == "_safevars_pytestplugin"
        for e in importlib.metadata.entry_points(group="pytest11")
    )


def _pytest(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_user_project.py").write_text(TESTS)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(autouse=True)
def _installed():
    assert _plugin_installed(), (
        "the pytest11 entry point of safevars is not installed in this environment: "
        'reinstall the package (pip install -e ".[test]")'
    )


def test_without_the_option_nothing_is_imported_and_nothing_audited(tmp_path):
    # (test_racy_and_failing_on_its_own fails on its own assertion, audited or not.)
    run = _pytest(tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "1 failed, 5 passed" in output, output
    assert "safevars audit" not in output


def test_with_the_option_a_racy_test_fails_with_the_report(tmp_path):
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []
    run = _pytest(tmp_path, "--safevars-audit", *workers)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "FAILED test_user_project.py::test_racy" in output, output
    for passed in ("test_locked", "test_locked_by_a_fixture", "test_racy_opted_out"):
        assert f"PASSED test_user_project.py::{passed}" in output, output
    assert "2 failed, 3 passed, 1 skipped" in output, output
    # A test failing on its own keeps its failure, with the report as a section.
    assert "AssertionError: the test's own failure" in output
    assert "safevars audit" in output and "failing_counter" in output
    # The report: the finding, the variable, the racy line, the fix.
    assert "RaceDetectedError" in output and "lost update on 'shared_counter:0'" in output
    assert "v.assign(v.read_value() + 1)  # RACY LINE" in output
    assert "safevars.locked" in output
    assert "opted_out_counter" not in output and "locked_counter" not in output
    if workers:
        assert "2 workers" in output or "[gw" in output, output
