"""Griffe extension: a class whose ``__signature__`` is set from a function shows it.

Griffe reads the code without running it, so it takes a class's signature from its
``__init__``. ``SafeOptimizer(opt, ...)`` is implemented by its metaclass' ``__call__``
and declares what it takes at run time, for ``inspect.signature`` and IDEs::

    SafeOptimizer.__signature__ = inspect.signature(_make_safe).replace(...)

For such a module-level assignment (``<Class>.__signature__ = inspect.signature(<f>)``,
optionally followed by ``.replace(...)``), this extension gives the class an ``__init__``
with ``<f>``'s parameters, so the reference page shows the constructor's signature with
its defaults (mkdocs.yml merges ``__init__`` into the class).

A ``__signature__`` computed some other way (``SafeVariable``'s is ``tf.Variable``'s,
read from the installed TensorFlow) cannot be read from the code: for those the extension
imports the module and asks ``inspect.signature`` for the class, exactly what a notebook
shows. If that import fails, a warning says so, which fails ``mkdocs build --strict``:
the page would silently show a signature other than the one the class declares.
"""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
from typing import Any

import griffe

#: (module path, class name, function name) of each assignment found.
_FOUND: list[tuple[str, str, str]] = []
#: (module path, class name, line) of each assignment computed at run time.
_RUNTIME: list[tuple[str, str, int]] = []


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
                _RUNTIME.append((mod.path, target.value.id, statement.lineno))
                continue
            _FOUND.append((mod.path, target.value.id, source))

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module_path, class_name, line in _RUNTIME:
            if module_path != pkg.path and not module_path.startswith(pkg.path + "."):
                continue
            module = pkg.modules_collection[module_path]
            cls = module.members.get(class_name)
            try:
                declared = inspect.signature(
                    getattr(importlib.import_module(module_path), class_name)
                )
            except Exception as error:  # noqa: BLE001 - any failure is reported, strictly.
                griffe.logger.warning(
                    f"{module.filepath}:{line}: {class_name}.__signature__ could not be read "
                    f"by importing {module_path} ({error!r}); its reference page would not "
                    "show that signature."
                )
                continue
            if cls is None:
                continue
            cls = cls.final_target if cls.is_alias else cls
            cls.set_member("__init__", _init_from(declared, line))
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
            init = _init(function.parameters, function.lineno, function.endlineno)
            cls.set_member("__init__", init)


def _default_text(default: Any) -> str | None:
    """A parameter's default as the reference page shows it (an enum as ``Class.MEMBER``)."""
    if default is inspect.Parameter.empty:
        return None
    if isinstance(default, enum.Enum):
        return f"{type(default).__name__}.{default.name}"
    return repr(default)


def _init_from(declared: inspect.Signature, line: int) -> griffe.Function:
    """An ``__init__`` for griffe with the parameters of a run-time signature."""
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: griffe.ParameterKind.positional_only,
        inspect.Parameter.POSITIONAL_OR_KEYWORD: griffe.ParameterKind.positional_or_keyword,
        inspect.Parameter.VAR_POSITIONAL: griffe.ParameterKind.var_positional,
        inspect.Parameter.KEYWORD_ONLY: griffe.ParameterKind.keyword_only,
        inspect.Parameter.VAR_KEYWORD: griffe.ParameterKind.var_keyword,
    }
    parameters = []
    for parameter in declared.parameters.values():
        annotation = parameter.annotation
        parameters.append(
            griffe.Parameter(
                parameter.name,
                kind=kinds[parameter.kind],
                annotation=None
                if annotation is inspect.Parameter.empty
                else inspect.formatannotation(annotation),
                default=_default_text(parameter.default),
            )
        )
    return _init(parameters, line, line)


def _init(parameters: Any, lineno: Any, endlineno: Any) -> griffe.Function:
    """An ``__init__`` for griffe: ``self``, then ``parameters``."""
    self_parameter = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    return griffe.Function(
        "__init__",
        parameters=griffe.Parameters(self_parameter, *parameters),
        returns=None,
        lineno=lineno,
        endlineno=endlineno,
    )
