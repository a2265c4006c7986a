"""Imports run one way: no cycle among safevars' modules, every import down the layers.

The layers are written once, in the docstring of ``safevars/__init__.py``; this test
reads them from there. Every ``import`` and ``from ... import`` of a safevars module
counts: at module level, inside functions, and under ``if TYPE_CHECKING:`` (a type-only
cycle still means one module cannot be read without the other). The implicit import of
a parent package when a submodule is imported does not. Pure AST: no TensorFlow import,
well under a second.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = "safevars"
PACKAGE = Path(importlib.util.find_spec(ROOT).origin).parent  # the copy pytest imports


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = (ROOT, *path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, source: str, modules: set[str]) -> set[str]:
    """The safevars modules ``source`` (module ``name``) imports, anywhere in it."""
    is_package = name not in modules or any(m.startswith(name + ".") for m in modules)
    package = name if is_package else name.rpartition(".")[0]

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:  # the longest prefix that is a module
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(resolve(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base != ROOT and not base.startswith(ROOT + "."):
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else resolve(base))
    return {m for m in found if m is not None and m != name}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    names = set(files)
    return {m: imported_modules(m, p.read_text(encoding="utf-8"), names) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layers(package: Path = PACKAGE) -> dict[str, int]:
    """Unit (top-level module or package, ``__init__`` for the package itself) -> layer,
    from the numbered list in the package docstring."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text("utf-8")))
    table = {}
    for line in (docstring or "").splitlines():
        match = re.match(r"(\d+)\. (.*)", line)
        if match:
            named = match.group(2).split(":")[0]
            for unit in re.findall(r"``([A-Za-z_]+)``", named):
                table[unit] = int(match.group(1))
    return table


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    """Imports of a unit by a unit of the same or a lower layer."""
    wrong = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = unit(module), unit(target)
            if here != there and table[there] >= table[here]:
                wrong.append(
                    f"{module} (layer {table[here]}) imports {target} (layer {table[there]})"
                )
    return wrong


def test_the_layer_list_places_every_unit():
    table = layers()
    units = {unit(m) for m in module_files()}
    assert len(set(table.values())) > 5, table
    assert units - set(table) == set(), "place these in safevars/__init__.py's layer list"
    assert set(table) - units == set(), "the layer list names what does not exist"


def test_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles (counting imports in functions and TYPE_CHECKING)"


def test_every_import_goes_down_the_layers():
    assert upward_imports(import_graph(), layers()) == []


def test_the_check_sees_imports_in_functions_and_type_checking_and_finds_cycles():
    modules = {"safevars", "safevars.a", "safevars.b", "safevars.c", "safevars.pkg"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import safevars.pkg.missing\n"
        "if TYPE_CHECKING:\n    from safevars import b\n"
        "def f():\n    from .c import name\n"
    )
    assert imported_modules("safevars.a", source, modules) == {
        "safevars.b",
        "safevars.c",
        "safevars.pkg",
    }
    graph = {"safevars.a": {"safevars.b"}, "safevars.b": {"safevars.c"}, "safevars.c": set()}
    assert cycles(graph) == []
    graph["safevars.c"].add("safevars.a")
    assert cycles(graph) == [["safevars.a", "safevars.b", "safevars.c"]]
    table = {"a": 2, "b": 1, "c": 1}
    assert upward_imports({"safevars.b": {"safevars.c"}}, table) == [
        "safevars.b (layer 1) imports safevars.c (layer 1)"
    ]
