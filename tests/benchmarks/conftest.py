"""Shared set-up of the benchmark suite's tests (``tests/benchmarks/``).

The repository root goes first on ``sys.path`` (``benchmarks`` is not an installed
package), and ``fake_package`` writes a package of fake case families
(:data:`benchmark_fakes.FAKE_FAMILIES`) and discovers it. The fakes themselves live in
``benchmark_fakes.py``, which the test modules import.
"""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import discovery, runner  # noqa: E402
from tests.support.benchmark_fakes import FAKE_FAMILIES  # noqa: E402


@pytest.fixture
def family_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[str, dict[str, str]], list[discovery.FamilyInfo]]]:
    """Returns ``make(package, sources)``: writes a package of families (file name ->
    source) and discovers it.

    Each test imports its own copy: the packages' modules are dropped afterwards, so
    module state (``bench_counted``'s build counter) starts afresh whatever ran before.

    The runner's full garbage collection after each case and family is skipped (and
    so is its freeze of what is alive): with TensorFlow loaded it takes about 0.25 s,
    most of a run of fake families, which hold nothing to collect.
    """
    monkeypatch.setattr(
        runner, "gc", types.SimpleNamespace(collect=lambda: 0, freeze=lambda: None)
    )
    made: list[str] = []

    def make(name: str, sources: dict[str, str]) -> list[discovery.FamilyInfo]:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        for file, source in sources.items():
            (package / file).write_text(textwrap.dedent(source))
        made.append(name)
        return discovery.discover(package, name)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for module in [m for m in sys.modules if m.split(".")[0] in made]:
        del sys.modules[module]


@pytest.fixture
def fake_package(family_package) -> list[discovery.FamilyInfo]:
    """A package of fake families: one good, one that fails to import, one raising..."""
    return family_package("fakebench_pkg", FAKE_FAMILIES)
