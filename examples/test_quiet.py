"""examples/_quiet.py: TensorFlow's start-up log is hidden by default, shown with --verbose.

The examples' smoke tests check that an example's stderr holds no start-up line (the race
demo's and the exactly-once example's, run as a new ``python``; the others run forked from
a process that imported TensorFlow already, see ``_smoke.py``); this file checks that
every example quiets TensorFlow before it imports it, the classifier, that nothing else is
hidden (a warning printed during the import, an import error's traceback), and the
benchmark CLI in both modes.
"""

from __future__ import annotations

import ast
import glob
import os
import subprocess
import sys
import textwrap

import pytest
from _quiet import VERBOSE_ENV, is_startup_noise, startup_noise, verbose_requested
from _smoke import scaled

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# The default: no TF_CPP_MIN_LOG_LEVEL, not verbose.
ENV = {
    k: v
    for k, v in os.environ.items()
    if k not in ("TF_CONFIG", "TF_CPP_MIN_LOG_LEVEL", VERBOSE_ENV)
}

# What importing TensorFlow 2.21 (CPU only) and listing its devices printed here.
STARTUP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795441446.794811   12591 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795441446.795189   12591 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.",
    "I0000 00:00:1795441446.894300   12591 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AVX_VNNI FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.",
    "E0000 00:00:1795441450.357066   12591 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "W1123 13:44:52.123456   12591 dso_loader.cc:64] Could not load dynamic library 'libcudnn.so.9'",
    # TensorFlow 2.16 (its own log format up to 2.17, and the factory errors it printed).
    "2026-11-28 12:43:41.743030: I tensorflow/core/util/port.cc:113] oneDNN custom operations are on.",
    "2026-11-28 12:43:41.798805: E external/local_xla/xla/stream_executor/cuda/cuda_fft.cc:479] Unable to register cuFFT factory: Attempting to register factory for plugin cuFFT when one has already been registered",
    "2026-11-28 12:43:41.837826: E external/local_xla/xla/stream_executor/cuda/cuda_dnn.cc:10575] Unable to register cuDNN factory: Attempting to register factory for plugin cuDNN when one has already been registered",
    "2026-11-28 12:43:49.353536: W tensorflow/compiler/tf2tensorrt/utils/py_utils.cc:38] TF-TRT Warning: Could not find TensorRT",
]
NOT_STARTUP = [
    "E0000 00:00:1795441450.357066   12591 mutex_ops.cc:52] an error TensorFlow reports",
    "2026-11-28 12:43:41.798805: E tensorflow/core/kernels/mutex_ops.cc:52] a 2.16 error",
    "F0000 00:00:1795441450.357066   12591 check.cc:12] Check failed: a fatal error",
    "Traceback (most recent call last):",
    "/tmp/x.py:4: UserWarning: a warning",
    "WARNING:tensorflow:5 out of the last 5 calls to <function f> triggered tf.function retracing.",
    "safevars benchmarks (quick) on CPU AMD EPYC (/CPU:0): rng",
    "",
]


# Packages whose import imports TensorFlow (and so prints its start-up log).
IMPORT_TENSORFLOW = {"tensorflow", "keras", "safevars"}
EXAMPLES = sorted(
    os.path.basename(path)
    for path in glob.glob(os.path.join(HERE, "*.py"))
    if not os.path.basename(path).startswith(("_", "test_"))
)


def _imported(node: ast.stmt) -> set[str]:
    """The top-level packages an import statement imports."""
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return {node.module.split(".")[0]}
    return set()


@pytest.mark.parametrize("script", EXAMPLES)
def test_every_example_quiets_tensorflow_before_it_imports_it(script):
    """What the forked smoke tests cannot see: the example calls
    ``quiet_tensorflow_startup()`` at its top level before any import of TensorFlow."""
    with open(os.path.join(HERE, script)) as f:
        body = ast.parse(f.read()).body
    quieted = False
    for node in body:
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "quiet_tensorflow_startup"
        ):
            quieted = True
        early = _imported(node) & IMPORT_TENSORFLOW
        assert quieted or not early, f"{script} imports {early} before it quiets TensorFlow"
    assert quieted, f"{script} never calls quiet_tensorflow_startup()"


def test_the_examples_are_found():
    assert len(EXAMPLES) >= 8 and "race_demo.py" in EXAMPLES, EXAMPLES


@pytest.mark.parametrize("line", STARTUP)
def test_startup_lines_are_noise(line):
    assert is_startup_noise(line)


@pytest.mark.parametrize("line", NOT_STARTUP)
def test_errors_warnings_and_output_are_not_noise(line):
    assert not is_startup_noise(line)


def test_startup_noise_picks_the_lines():
    assert startup_noise("\n".join([*NOT_STARTUP, *STARTUP])) == STARTUP


def test_verbose_requested(monkeypatch):
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    assert not verbose_requested([])
    assert not verbose_requested(["--steps", "3"])
    assert verbose_requested(["--steps", "3", "--verbose"])
    for value, verbose in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(VERBOSE_ENV, value)
        assert verbose_requested([]) is verbose


FAKE_TENSORFLOW = textwrap.dedent(
    """
    import os, sys, warnings
    os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are "
                b"written to STDERR\\n")
    os.write(2, b"I0000 00:00:1795441825.340760   30726 port.cc:153] oneDNN is on.\\n")
    warnings.warn("a warning during the import", UserWarning)
    os.write(2, b"E0000 00:00:1795441827.402344   30726 other.cc:52] a real C++ error\\n")
    if os.environ.get("FAKE_TF_FAILS"):
        raise ImportError("a broken TensorFlow")

    class config:
        @staticmethod
        def list_physical_devices():
            os.write(2, b"E0000 00:00:1795441827.402344   30726 cuda_platform.cc:52] "
                        b"failed call to cuInit: UNKNOWN ERROR (303)\\n")
            return []
    """
)
SCRIPT = "import _quiet; _quiet.quiet_tensorflow_startup(); print('imported')"


@pytest.fixture
def fake_tensorflow(tmp_path):
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(FAKE_TENSORFLOW)
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), HERE])}


def run(env, *args):
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=scaled(60), env=env
    )


def test_quiet_hides_only_the_startup_lines(fake_tensorflow):
    done = run(fake_tensorflow, "-c", SCRIPT)
    assert done.returncode == 0 and done.stdout == "imported\n", done
    lines = done.stderr.splitlines()
    assert startup_noise(done.stderr) == [], done.stderr
    assert "UserWarning: a warning during the import" in done.stderr
    assert lines[-1].endswith("other.cc:52] a real C++ error"), done.stderr


def test_verbose_hides_nothing(fake_tensorflow):
    done = run({**fake_tensorflow, VERBOSE_ENV: "1"}, "-c", SCRIPT)
    assert done.returncode == 0, done
    assert len(startup_noise(done.stderr)) == 2, done.stderr  # the notice and the I line
    assert "a real C++ error" in done.stderr


def test_a_failing_import_shows_its_output_and_traceback(fake_tensorflow):
    done = run({**fake_tensorflow, "FAKE_TF_FAILS": "1"}, "-c", SCRIPT)
    assert done.returncode == 1 and done.stdout == "", done
    assert "UserWarning: a warning during the import" in done.stderr
    assert "a real C++ error" in done.stderr
    assert "Traceback (most recent call last):" in done.stderr
    assert done.stderr.rstrip().endswith("ImportError: a broken TensorFlow"), done.stderr


# The kinds of start-up line TensorFlow 2.21 prints on a CPU-only machine.
KINDS = ("absl::InitializeLog()", "port.cc", "cudart_stub.cc", "cpu_feature_guard.cc", "cuInit")


def test_benchmark_cli_hides_the_startup_log_and_verbose_shows_it(tmp_path):
    command = [
        *(sys.executable, "-m", "benchmarks", "--cases", "rng", "--quick", "--rounds", "1"),
        *("--sizes", "1", "--min-time", "0.001", "--warmup", "0", "--no-plots"),
    ]
    stderr = {}
    for mode, extra in (("quiet", ()), ("verbose", ("--verbose",))):
        done = subprocess.run(
            [*command, "--out", str(tmp_path / mode), *extra],
            capture_output=True,
            text=True,
            timeout=scaled(300),
            cwd=REPO,
            env={**ENV, "PYTHONPATH": REPO},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert "safevars benchmarks (quick) on CPU" in done.stderr, done.stderr
        stderr[mode] = done.stderr
    assert startup_noise(stderr["quiet"]) == [], stderr["quiet"]
    assert not [kind for kind in KINDS if kind in stderr["quiet"]], stderr["quiet"]
    # Whatever this TensorFlow prints at start-up shows (here: every kind in KINDS).
    assert startup_noise(stderr["verbose"]), stderr["verbose"]
