"""Finding the case families: every ``bench_<family>.py`` module of a package.

A family is described *statically*: ``FAMILY``, ``DESCRIPTION``, ``DEFAULT``, ``ORDER``,
``PLOT_AGAINST``, ``SECONDS`` and ``ISOLATED`` are read from the module's source with :mod:`ast`,
without importing it. So ``--cases`` knows every
family's name even when one of them fails to import (that family is then reported as
failed, with the error), and an optional family (``DEFAULT = False``, like the
``distributed`` family) is not even imported unless it is selected. A module whose
``FAMILY`` is not a literal is imported to learn its name.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.case import Case, Context, LazyCase

__all__ = [
    "FamilyInfo",
    "UnknownFamilyError",
    "discover",
    "load_cases_function",
    "select",
]

PACKAGE_DIR = Path(__file__).resolve().parent
PREFIX = "bench_"


class UnknownFamilyError(ValueError):
    """``--cases`` named a family that does not exist. The message lists the known ones."""


@dataclasses.dataclass(frozen=True)
class FamilyInfo:
    """What is known about a family before it is imported.

    Attributes:
      name: The ``FAMILY`` name (``--cases`` selects it), or the file stem without
        ``bench_`` when the module could not be read.
      module: The importable module name, e.g. ``"benchmarks.bench_eager"``.
      path: The module's file.
      description: ``DESCRIPTION`` ("" when absent).
      default: Whether the family runs when ``--cases`` is not given.
      order: ``ORDER``: position in runs and reports (``None`` sorts last, by file).
      plot_against: ``PLOT_AGAINST``: the numeric case parameter the family's ratios are
        plotted against (``<family>_vs_<param>.png``), or ``None``.
      isolated: ``ISOLATED``: a full run measures the family in a process of its own
        (see :mod:`benchmarks.cli`).
      seconds: ``SECONDS``: about how long the family runs, by mode (``"full"``,
        ``"quick"``), as ``(mode, seconds)`` pairs, for the progress line's estimate;
        empty when not given.
      problem: Why the module cannot be used, found without running it (a syntax error,
        no ``FAMILY``), or ``None``.
    """

    name: str
    module: str
    path: Path
    description: str = ""
    default: bool = True
    order: int | None = None
    plot_against: str | None = None
    problem: str | None = None
    seconds: tuple[tuple[str, float], ...] = ()
    isolated: bool = False

    def expected_seconds(self, mode: str) -> float | None:
        """``SECONDS[mode]`` (``"full"`` or ``"quick"``), or None when not given."""
        return dict(self.seconds).get(mode)


_NOT_LITERAL = object()


def _literals(source: str) -> dict[str, Any]:
    """Module-level ``NAME = <literal>`` assignments of ``source``."""
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                found[target.id] = ast.literal_eval(value)
            except ValueError:
                found[target.id] = _NOT_LITERAL
    return found


def _describe(path: Path, package: str) -> FamilyInfo:
    stem_name = path.stem[len(PREFIX) :]
    module = f"{package}.{path.stem}"
    try:
        values = _literals(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as e:
        return FamilyInfo(stem_name, module, path, problem=f"{type(e).__name__}: {e}")
    name = values.get("FAMILY")
    if name is _NOT_LITERAL:
        try:
            name = getattr(importlib.import_module(module), "FAMILY", None)
        except Exception as e:  # noqa: BLE001 - reported as the family's failure
            return FamilyInfo(stem_name, module, path, problem=f"{type(e).__name__}: {e}")
    if not isinstance(name, str) or not name:
        return FamilyInfo(
            stem_name,
            module,
            path,
            problem=f'{path.name} defines no FAMILY = "<name>" (see benchmarks/case.py).',
        )
    description = values.get("DESCRIPTION", "")
    default = values.get("DEFAULT", True)
    order = values.get("ORDER")
    plot_against = values.get("PLOT_AGAINST")
    seconds = values.get("SECONDS")
    return FamilyInfo(
        name=name,
        module=module,
        path=path,
        description=description if isinstance(description, str) else "",
        default=default if isinstance(default, bool) else True,
        order=order if isinstance(order, int) and not isinstance(order, bool) else None,
        plot_against=plot_against if isinstance(plot_against, str) and plot_against else None,
        seconds=_seconds(seconds),
        isolated=values.get("ISOLATED") is True,
    )


def _seconds(value: Any) -> tuple[tuple[str, float], ...]:
    """``SECONDS`` as ``(mode, seconds)`` pairs: its non-negative numbers only."""
    if not isinstance(value, dict):
        return ()
    return tuple(
        (str(mode), float(n))
        for mode, n in value.items()
        if isinstance(n, (int, float)) and not isinstance(n, bool) and n >= 0
    )


def discover(directory: Path = PACKAGE_DIR, package: str = "benchmarks") -> list[FamilyInfo]:
    """Every ``bench_*.py`` family in ``directory`` (the package ``package``).

    Families are sorted by ``ORDER``, then by file name (those without ``ORDER`` last).

    Two modules declaring the same ``FAMILY`` are both kept; the second one gets a problem
    saying so (and is reported as failed if it runs).
    """
    families: list[FamilyInfo] = []
    seen: dict[str, Path] = {}
    for path in sorted(directory.glob(f"{PREFIX}*.py")):
        info = _describe(path, package)
        if info.problem is None and info.name in seen:
            info = dataclasses.replace(
                info,
                name=f"{info.name}:{path.stem}",
                problem=f"{path.name} declares FAMILY = {info.name!r}, already declared by "
                f"{seen[info.name].name}; family names must be unique.",
            )
        seen.setdefault(info.name, path)
        families.append(info)
    families.sort(key=lambda f: (f.order is None, f.order or 0, f.path.name))
    return families


def select(families: Sequence[FamilyInfo], requested: str | None) -> list[FamilyInfo]:
    """The families ``--cases`` asks for, in discovery order.

    Args:
      families: From :func:`discover`.
      requested: A comma-separated list of family names, ``"all"`` (every family,
        optional ones included), or ``None``/``""`` (the default families).

    Raises:
      UnknownFamilyError: a name is not a known family; the message lists the known ones.
    """
    if not requested:
        return [f for f in families if f.default]
    names = [n.strip() for n in requested.split(",") if n.strip()]
    if names == ["all"]:
        return list(families)
    known = {f.name: f for f in families}
    unknown = [n for n in names if n not in known]
    if unknown:
        listing = ", ".join(f.name + ("" if f.default else " (optional)") for f in families)
        raise UnknownFamilyError(
            f"unknown case famil{'y' if len(unknown) == 1 else 'ies'} "
            f"{', '.join(map(repr, unknown))}; known families: {listing}, or 'all'."
        )
    wanted = set(names)
    return [f for f in families if f.name in wanted]


def load_cases_function(info: FamilyInfo) -> Callable[[Context], list[Case | LazyCase]]:
    """Imports the family's module and returns its ``cases`` function.

    Raises:
      RuntimeError: the family has a static problem, or the module has no callable
        ``cases``. Whatever the import raises propagates.
    """
    if info.problem is not None:
        raise RuntimeError(info.problem)
    module = importlib.import_module(info.module)
    cases = getattr(module, "cases", None)
    if not callable(cases):
        raise RuntimeError(
            f"{info.path.name} defines no cases(ctx) function (see benchmarks/case.py)."
        )
    return cases
