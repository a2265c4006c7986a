"""The compatibility matrix and the package check, one command: ``nox``.

``pip install -e ".[matrix]"`` (nox and uv, pinned), then:

* ``nox`` runs every session below; ``nox -l`` lists them; ``nox -s core-tf2.18`` runs one;
  ``nox -t core`` runs the package check and every core cell (what ``.ci/run`` runs:
  it runs the whole suite itself, in its own environment, as the README says).
* ``package``: ``python -m build`` (wheel and sdist), ``twine check --strict``, and what
  the wheel holds. Every other session installs that wheel (not the checkout, not
  editable) into a fresh virtual environment, so the tests import the installed package.
* ``newest``: the newest TensorFlow and Keras, the whole suite.
* ``core-tf2.16`` ... ``core-tf2.20``: each older TensorFlow minor with the newest Keras it
  supports, and ``core-keras3.12``: the oldest Keras with the oldest TensorFlow, run
  :data:`CORE_TESTS`. Python 3.10 and 3.13 are each one cell's Python.

pytest runs in parallel in every cell, as in the checkout (``tests/conftest.py``: one
worker per CPU plus one, whole files to a worker; pytest-xdist comes with the ``test``
extra).

The ranges here are the ones ``pyproject.toml`` declares and
``safevars/_tf_internal.py`` (``TESTED_*``) checks at import; ``tests/test_tf_internal.py``
fails when they disagree with the installed versions, so every cell checks its own.

Environments are made by uv (from PyPI; it does not read pip's configuration) with its
cache in ``$UV_CACHE_DIR`` (``.ci/run`` puts it in the clone, so it starts empty and is
rebuilt by each run). Interpreters: ``python3.X`` on ``PATH``, else pyenv's
``versions/3.X.*``; a missing one fails the session (it is not skipped).
"""

from __future__ import annotations

import glob
import os
import pathlib
import shutil
import subprocess
import tempfile
import zipfile

import nox

nox.needs_version = "==2026.10.20"  # the `matrix` extra of pyproject.toml pins the same
nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.download_python = "never"  # only package registries are reachable here

ROOT = pathlib.Path(__file__).resolve().parent
DIST = ROOT / ".nox" / "dist"

# The tests every cell runs: the behaviour most likely to differ between TensorFlow and
# Keras releases. One entry per idea; paths (or node ids) relative to the checkout.
CORE_TESTS = [
    "tests/test_tf_internal.py",  # the door: private APIs, version ranges, call_each
    "tests/variable",  # SafeVariable: writes, versions, snapshots, errors
    "tests/locking/test_locks.py",  # locks, eager and in graphs
    "tests/locking/test_runtime_mode.py",  # run-time mode, XLA-only locks
    # TensorFlow's fast path runs no Python code in a first write (a Ctrl-C is kept)
    "tests/locking/test_ctrl_c.py::test_tensorflow_fast_path_runs_no_python_code_in_a_write_of_a_common_value_type",
    "tests/sections/test_reentrant_sections.py",  # sections in graphs, re-entry
    "tests/sections/test_xla.py",  # sections in XLA-compiled functions
    # SafeOptimizer, with model.fit, savers, mixed precision (not the clusters)
    "tests/optimizer/test_fidelity.py",
    "tests/optimizer/test_atomicity.py",
    "tests/optimizer/test_accumulation.py",
    "tests/optimizer/test_saving.py",
    "tests/optimizer/test_mirrored.py",
    # safevars.scope(): one lock per step, fit, the mistakes it absorbs (not clusters)
    "tests/scope/test_scope.py",
    # (the lock count at 2 and 16 variables for one kind of step)
    "tests/scope/test_one_lock_per_step.py::test_a_traced_step_takes_one_lock_whatever_the_model_size[fit-safe]",
    "tests/scope/test_one_lock_per_step.py::test_threads_training_a_scope_model_equal_the_same_steps_in_one_thread",
    "tests/scope/test_one_lock_per_step.py::test_threads_running_fit_steps_equal_the_same_steps_in_one_thread",
    "tests/scope/test_common_mistakes.py",
    "tests/accumulator/test_add_take.py",  # GradientAccumulator
    "tests/accumulator/test_mirrored.py",
    "tests/rng/test_replica_rng.py",  # ReplicaRNG
    # Checkpoints and Keras savers taking locks (the threaded accumulator ones are slow
    # and test the accumulator, not the savers: one of them).
    "tests/locking/test_checkpoints.py::test_checkpoints_written_during_transactions_are_whole",
    "tests/locking/test_checkpoints.py::test_a_restore_during_transactions_is_one_section",
    "tests/locking/test_checkpoints.py::test_keras_save_weights_during_training_is_a_state_that_existed",
    "tests/locking/test_checkpoints.py::test_an_accumulator_saved_while_threads_add_restores_an_exact_mean[False-False]",
    "tests/locking/test_checkpoints.py::test_accumulator_locked_holds_contributions_still",
    "tests/locking/test_checkpoints.py::test_a_safe_optimizer_checkpointed_while_it_steps_pairs_weights_and_iterations",
    "tests/conformance/test_keras_optimizers.py",  # Keras' own optimizer tests
]


def _cell(
    name: str, python: str, tensorflow: str, keras: str, tests: list[str], tags: list[str]
) -> None:
    """Defines session ``name``: Python ``python``, TensorFlow ``tensorflow``.*, Keras
    ``keras``.*, the built wheel with its ``test`` extra, then pytest on ``tests``."""

    @nox.session(name=name, python=_interpreter(python), requires=["package"], tags=tags)
    def cell(session: nox.Session) -> None:
        wheel = _built_wheel(session)
        session.install(f"{wheel}[test]", f"tensorflow=={tensorflow}.*", f"keras=={keras}.*")
        # The tests must import the wheel, not the checkout. Checked from a directory
        # outside the checkout (`python -c` puts the current directory first on
        # sys.path); pytest's own script puts no checkout directory there (tests/ and
        # tests/conformance/ only, for their helper modules), so it imports the same.
        # (Not session.create_tmp(): it points TMPDIR into the checkout for the tests.)
        with tempfile.TemporaryDirectory() as outside, session.chdir(outside):
            session.run("python", "-c", _CHECK_INSTALLED, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
        session.run("pytest", "-q", "-p", "no:cacheprovider", *tests, *session.posargs)


_CHECK_INSTALLED = """
import pathlib, sys, sysconfig
import keras, safevars, tensorflow
where = pathlib.Path(safevars.__file__).resolve()
print("safevars", where, "| Python", sys.version.split()[0], "| TensorFlow",
      tensorflow.__version__, "| Keras", keras.__version__)
assert where.is_relative_to(pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()), where
"""


def _interpreter(version: str) -> str:
    """``python3.X`` if it runs, else pyenv's 3.X.* (a pyenv shim of a Python that is not
    selected is on ``PATH`` but fails), else the version (nox reports it missing)."""
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates = sorted(
        glob.glob(os.path.join(root, "versions", f"{version}.*", "bin", f"python{version}"))
    )
    return candidates[-1] if candidates else version


def _built_wheel(session: nox.Session) -> str:
    wheels = sorted(DIST.glob("safevars-*.whl"))
    if len(wheels) != 1:
        session.error(f"expected one wheel in {DIST} (the package session), found {wheels}")
    return str(wheels[0])


@nox.session(python=_interpreter("3.11"), tags=["core"])
def package(session: nox.Session) -> None:
    """Builds the wheel and the sdist, checks them with twine and looks inside the wheel."""
    session.install("build[uv]==1.6.1", "twine==7.0.0")
    shutil.rmtree(DIST, ignore_errors=True)
    session.run("python", "-m", "build", "--installer", "uv", "--outdir", str(DIST), str(ROOT))
    artifacts = sorted(str(p) for p in DIST.iterdir())
    session.run("twine", "check", "--strict", *artifacts)
    (wheel,) = DIST.glob("safevars-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = sorted({n.split("/")[0] for n in names})
    plugin = "_safevars_pytestplugin.py"  # pytest --safevars-audit (entry point pytest11)
    others = [t for t in tops if not t.startswith("safevars") and t != plugin]
    if others or plugin not in tops or "safevars/py.typed" not in names:
        session.error(f"the wheel should hold safevars/ (with py.typed) and {plugin}: {tops}")
    session.log(f"{wheel.name}: {len(names)} files, {wheel.stat().st_size} bytes")


# The newest combination: the whole suite.
_cell("newest", "3.11", "2.21", "3.15", [], tags=["newest"])

# Every older TensorFlow minor with the newest Keras it supports, then the oldest Keras
# (3.12, see TESTED_KERAS in safevars/_tf_internal.py) with the oldest TensorFlow. Python 3.13 has
# TensorFlow wheels from 2.20 on; Keras 3.13 and newer need Python 3.11.
_cell("core-tf2.16", "3.11", "2.16", "3.15", CORE_TESTS, tags=["core"])
_cell("core-tf2.17", "3.11", "2.17", "3.15", CORE_TESTS, tags=["core"])
_cell("core-tf2.18", "3.12", "2.18", "3.15", CORE_TESTS, tags=["core"])
_cell("core-tf2.19", "3.12", "2.19", "3.15", CORE_TESTS, tags=["core"])
_cell("core-tf2.20", "3.13", "2.20", "3.15", CORE_TESTS, tags=["core"])
_cell("core-keras3.12", "3.10", "2.16", "3.12", CORE_TESTS, tags=["core"])
