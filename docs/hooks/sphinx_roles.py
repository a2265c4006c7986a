"""Griffe extension: render the Sphinx roles of safevars' docstrings as code, linked if possible.

The docstrings are Google style but name other objects with Sphinx roles
(``:class:`~safevars.SafeVariable```, ``:meth:`update```, ``:mod:`benchmarks.timing```).
Markdown has no such syntax, so without this they would show as ``:meth:`` followed by
code. Each role becomes its text in code style (``~`` keeps the last component, as in
Sphinx) and, when griffe can resolve the name from where the docstring is, an *optional*
cross-reference: a link when the target is rendered on some page of the site, plain code
otherwise (an unrendered target, such as a private helper, is not a build warning).
A line ending in reST's literal-block marker ``::`` ends in ``:`` (or nothing after a
space), as Sphinx shows it; the indented block below it is a Markdown code block already.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

_LITERAL = re.compile(r"(?P<space>[ \t]?)::$", re.MULTILINE)
_ROLE = re.compile(
    r":(?:py:)?(?P<role>class|func|meth|attr|mod|data|exc|obj|const):`(?P<target>[^`]+)`"
)


def _resolve(obj: griffe.Object, root: griffe.Module, target: str, role: str) -> str | None:
    """The full path ``target`` names in the scope of ``obj``, or None if griffe cannot tell.

    A package re-exports some functions under their own submodule's name
    (``safevars.snapshot``, ``safevars.transaction``, ``safevars.audit``): at run time the
    name is the function, so a role other than ``:mod:`` gets the function.
    """
    first, _, rest = target.partition(".")
    if first == root.name:
        base = root.path
    else:
        try:
            base = obj.resolve(first)
        except griffe.NameResolutionError:
            return None
    path = f"{base}.{rest}" if rest else base
    try:
        found = root.modules_collection[path]
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    if role != "mod" and found.is_module and found.name in found.members:
        found = found.members[found.name]
    try:
        return found.canonical_path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return path


def _convert(obj: griffe.Object, root: griffe.Module, text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        short = target.startswith("~")
        target = target.lstrip("~")
        shown = target.rsplit(".", 1)[-1] if short else target
        path = _resolve(obj, root, target, match.group("role"))
        if path is None:
            return f"`{shown}`"
        return (
            f'<autoref identifier="{html.escape(path)}" optional>'
            f"<code>{html.escape(shown)}</code></autoref>"
        )

    return _LITERAL.sub(_literal_marker, _ROLE.sub(replace, text))


def _literal_marker(match: re.Match[str]) -> str:
    # reST's "text::" introduces a literal (code) block and shows as "text:"; a lone
    # " ::" shows as nothing. The indented block itself is already Markdown code.
    return "" if match.group("space") else ":"


def _walk(obj: griffe.Object, root: griffe.Module) -> None:
    if obj.docstring is not None and ":" in obj.docstring.value:
        obj.docstring.value = _convert(obj, root, obj.docstring.value)
    for member in obj.members.values():
        if not member.is_alias:
            _walk(member, root)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of a loaded package once, after the whole package loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        _walk(pkg, pkg)
