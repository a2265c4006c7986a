"""MkDocs hook: load the documented packages once, with the site-wide handler options.

mkdocstrings' Python handler loads a package when a page first names it, with the options
of *that* ``:::`` block, and every member keeps those docstring-parser options; a later
block's own ``docstring_options`` apply to its root object only. So a block that relaxes a
check for one object (``safevars.SafeOptimizer`` in reference/optimizer.md) would relax
it for the whole package whenever its page happened to be rendered first. Loading the
packages here, before any page, with the options of mkdocs.yml, keeps the site-wide
checks site-wide whatever the page order.
"""

from __future__ import annotations

from typing import Any

PACKAGES = ("safevars", "benchmarks")


def on_pre_build(config: Any) -> None:
    """Collect every package of ``PACKAGES`` with the handler's global options."""
    handler = config.plugins["mkdocstrings"].get_handler("python")
    options = handler.get_options({})
    for package in PACKAGES:
        handler.collect(package, options)
