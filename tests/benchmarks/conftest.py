"""Shared set-up of the benchmark suite's tests (``tests/benchmarks/``).

The repository root goes first on ``sys.path`` (``benchmarks`` is not an installed
package), and ``fake_package`` writes a package of fake case families
(:data:`benchmark_fakes.FAKE_FAMILIES`) and discovers it. The fakes themselves live in
``benchmark_fakes.py``, which the test modules import.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark_fakes import FAKE_FAMILIES  # noqa: E402

from benchmarks import discovery  # noqa: E402


@pytest.fixture
def fake_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[discovery.FamilyInfo]]:
    """A package of fake families: one good, one that fails to import, one raising...

    Each test imports its own copy: the modules are dropped afterwards, so module state
    (``bench_counted``'s build counter) starts afresh whatever ran before.
    """
    package = tmp_path / "fakebench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in FAKE_FAMILIES.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield discovery.discover(package, "fakebench_pkg")
    for name in [m for m in sys.modules if m.split(".")[0] == "fakebench_pkg"]:
        del sys.modules[name]
