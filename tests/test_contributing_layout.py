"""CONTRIBUTING.md's "Where things live" matches the tree (issue 39).

Its table is how a newcomer finds a module, so it must name every module of ``safevars/``
and ``benchmarks/`` in the row of its package, every test directory, and nothing that
does not exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _table() -> list[str]:
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `")]


def _row(path: str) -> str:
    rows = [line for line in _table() if line.startswith(f"| `{path}")]
    assert rows, f"CONTRIBUTING.md's 'Where things live' has no row for {path}"
    return rows[0]


def _packages(top: str) -> list[Path]:
    return sorted(p.parent for p in (ROOT / top).glob("*/__init__.py"))


@pytest.mark.parametrize("package", _packages("safevars"), ids=lambda p: p.name)
def test_every_module_of_a_package_is_in_its_row(package):
    row = _row(f"safevars/{package.name}/")
    missing = [
        m.name
        for m in sorted(package.glob("*.py"))
        if m.name != "__init__.py"
        if f"`{m.name}`" not in row
    ]
    assert not missing, f"safevars/{package.name}/: {missing} not in CONTRIBUTING.md's row"


def test_every_top_level_module_and_benchmark_module_is_named():
    table = "\n".join(_table())
    modules = [m for m in sorted((ROOT / "safevars").glob("*.py")) if m.name != "__init__.py"]
    modules += [
        m
        for m in sorted((ROOT / "benchmarks").glob("*.py"))
        if m.name not in {"__init__.py", "__main__.py"} and not m.name.startswith("bench_")
    ]
    missing = [
        str(m.relative_to(ROOT))
        for m in modules
        if f"`{m.name}`" not in table and f"`{m.relative_to(ROOT)}`" not in table
    ]
    assert not missing, f"not in CONTRIBUTING.md's 'Where things live': {missing}"


def test_every_test_directory_is_named():
    table = "\n".join(_table())
    directories = sorted(p.parent.name for p in (ROOT / "tests").glob("*/__init__.py"))
    missing = [d for d in directories if f"`tests/{d}/`" not in table]
    assert not missing, f"test directories not in CONTRIBUTING.md: {missing}"


def test_every_path_the_table_names_exists():
    paths = {
        p
        for line in _table()
        for p in re.findall(r"`((?:safevars|benchmarks|tests|docs|examples)/[^`*<>]*)`", line)
    }
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"
