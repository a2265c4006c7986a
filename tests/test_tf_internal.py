"""The one door to private TensorFlow/Keras APIs, and its version check."""

from __future__ import annotations

import ast
import pathlib
import re
import warnings

import pytest

import safevars
from safevars import _tf_internal

PACKAGE = pathlib.Path(safevars.__file__).parent
PRIVATE = re.compile(r"^(tensorflow\.python|keras\.src)(\.|$)")


def _private_references(path: pathlib.Path) -> list[str]:
    """Imports of private modules, and strings naming them, in one source file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if PRIVATE.match(n)]
    return found


def test_only_the_door_reaches_private_apis():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != PACKAGE / "_tf_internal.py":
            offenders += _private_references(path)
    assert offenders == []
    # The check itself sees what it is looking for.
    assert _private_references(PACKAGE / "_tf_internal.py")


def test_tested_versions_are_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tf_internal.check_versions("2.21.0", "3.15.1") == ""
        assert _tf_internal.check_versions("2.21.3rc1", "3.15.0") == ""


@pytest.mark.parametrize(
    ("tensorflow", "keras", "named"),
    [
        ("2.20.0", "3.15.1", ["TensorFlow 2.20.0"]),
        ("2.21.0", "3.16.0", ["Keras 3.16.0"]),
        ("2.22.0rc0", "3.9.2", ["TensorFlow 2.22.0rc0", "Keras 3.9.2"]),
    ],
)
def test_untested_versions_warn_naming_them(tensorflow, keras, named):
    with pytest.warns(RuntimeWarning, match="tested with TensorFlow 2.21.x and Keras 3.15.x"):
        text = _tf_internal.check_versions(tensorflow, keras)
    for name in named:
        assert name in text
    assert "pip install" in text


def test_installed_versions_are_the_declared_range():
    """pyproject.toml declares what the suite runs against; this run is one of them."""
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    for name, (major, minor) in [
        ("tensorflow", _tf_internal.TESTED_TENSORFLOW),
        ("keras", _tf_internal.TESTED_KERAS),
    ]:
        assert f'"{name}>={major}.{minor},<{major}.{minor + 1}"' in pyproject
    assert _tf_internal.check_versions() == ""
