"""Griffe extension: a class whose ``__signature__`` is set from a function shows it.

Griffe reads the code without running it, so it takes a class's signature from its
``__init__``. ``SafeOptimizer(opt, ...)`` is implemented by its metaclass' ``__call__``
and declares what it takes at run time, for ``inspect.signature`` and IDEs::

    SafeOptimizer.__signature__ = inspect.signature(_make_safe).replace(...)

For such a module-level assignment (``<Class>.__signature__ = inspect.signature(<f>)``,
optionally followed by ``.replace(...)``), this extension gives the class an ``__init__``
with ``<f>``'s parameters, so the reference page shows the constructor's signature with
its defaults (mkdocs.yml merges ``__init__`` into the class). Any other assignment to a
``__signature__`` is reported as a warning, which fails ``mkdocs build --strict``: the
page would silently show a signature other than the one the class declares.
"""

from __future__ import annotations

import ast
from typing import Any

import griffe

#: (module path, class name, function name) of each assignment found.
_FOUND: list[tuple[str, str, str]] = []


def _signature_source(value: ast.expr) -> str | None:
    """``f`` of ``inspect.signature(f)`` (possibly ``.replace(...)``d), else None."""
    node = value
    while (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "replace"
    ):
        node = node.func.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "signature"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "inspect"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Name)
    ):
        return node.args[0].id
    return None


class DeclaredSignatures(griffe.Extension):
    """Finds ``<Class>.__signature__ = inspect.signature(<f>)`` and applies it."""

    def on_module_instance(self, *, node: Any, mod: griffe.Module, **kwargs: Any) -> None:
        if not isinstance(node, ast.Module):
            return
        for statement in node.body:
            if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
                continue
            target = statement.targets[0]
            if not (
                isinstance(target, ast.Attribute)
                and target.attr == "__signature__"
                and isinstance(target.value, ast.Name)
            ):
                continue
            source = _signature_source(statement.value)
            if source is None:
                griffe.logger.warning(
                    f"{mod.filepath}:{statement.lineno}: {target.value.id}.__signature__ is "
                    "set in a form docs/hooks/signatures.py cannot read; its reference page "
                    "would not show that signature (extend the hook)."
                )
                continue
            _FOUND.append((mod.path, target.value.id, source))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module_path, class_name, source in _FOUND:
            if module_path != pkg.path and not module_path.startswith(pkg.path + "."):
                continue
            module = pkg.modules_collection[module_path]
            cls, function = module.members.get(class_name), module.members.get(source)
            if cls is None or function is None:
                griffe.logger.warning(
                    f"{module.filepath}: {class_name}.__signature__ = "
                    f"inspect.signature({source}): not found by docs/hooks/signatures.py."
                )
                continue
            function = function.final_target if function.is_alias else function
            cls = cls.final_target if cls.is_alias else cls
            self_parameter = griffe.Parameter(
                "self", kind=griffe.ParameterKind.positional_or_keyword
            )
            init = griffe.Function(
                "__init__",
                parameters=griffe.Parameters(self_parameter, *function.parameters),
                returns=None,
                lineno=function.lineno,
                endlineno=function.endlineno,
            )
            cls.set_member("__init__", init)
