"""MkDocs hook: include sections of the repository's README.md into docs pages.

README.md is what users read on GitHub, so it stays the source of the guide; the docs
pages include its sections instead of copying them, and cannot drift. A docs page asks
for a section with an HTML comment on a line of its own:

    <!-- readme "## SafeVariable" level=1 -->
    <!-- readme "# safevars" intro -->

* The quoted text is the README heading line, exactly (``#`` marks included). A heading
  that is missing or found twice fails the build, so renaming a README heading without
  updating the docs is caught by ``mkdocs build --strict``.
* The section runs from that heading to the next heading of the same or a higher level
  (headings inside fenced code blocks do not count), subsections included.
* ``level=N`` shifts every included heading so the section's own heading is at level N.
* ``intro`` includes only the text below the heading and before its first subheading,
  without the heading line itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

_DIRECTIVE = re.compile(
    r'^<!-- readme "(?P<heading>[^"]+)"(?P<options>(?: +(?:level=[1-6]|intro))*) -->[ \t]*$',
    re.MULTILINE,
)
_HEADING = re.compile(r"^(#{1,6}) ")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def _lines_outside_fences(lines: list[str]) -> list[bool]:
    """For each line, whether it is outside a fenced code block (so may be a heading)."""
    outside: list[bool] = []
    fence: str | None = None
    for line in lines:
        match = _FENCE.match(line)
        if fence is None:
            outside.append(match is None)
            if match:
                fence = match.group(1)
        else:
            outside.append(False)
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                if not line.strip()[len(match.group(1)) :].strip():
                    fence = None
    return outside


def _section(readme: str, heading: str, options: str, page: str) -> str:
    lines = readme.splitlines()
    outside = _lines_outside_fences(lines)
    headings = [
        (i, len(m.group(1)))
        for i, line in enumerate(lines)
        if outside[i] and (m := _HEADING.match(line))
    ]
    starts = [(i, level) for i, level in headings if lines[i].rstrip() == heading]
    if len(starts) != 1:
        found = "not found" if not starts else f"found {len(starts)} times"
        raise PluginError(
            f"{page}: README.md heading {heading!r} {found}; the page includes it with "
            f"<!-- readme {heading!r} -->. Update the page to the README's heading."
        )
    start, level = starts[0]
    stop_levels = range(1, 7) if "intro" in options else range(1, level + 1)
    end = next((i for i, lvl in headings if i > start and lvl in stop_levels), len(lines))
    body = lines[start + 1 : end] if "intro" in options else lines[start:end]
    shift = 0
    if (wanted := re.search(r"level=(\d)", options)) is not None:
        shift = int(wanted.group(1)) - level
    if shift:
        body_outside = outside[start + 1 : end] if "intro" in options else outside[start:end]
        body = [
            ("#" * max(1, min(6, len(m.group(1)) + shift)) + line[len(m.group(1)) :])
            if inside_ok and (m := _HEADING.match(line))
            else line
            for line, inside_ok in zip(body, body_outside)
        ]
    return "\n".join(body).strip("\n") + "\n"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every ``<!-- readme "..." -->`` line of a page by that README section."""
    if "<!-- readme " not in markdown:
        return markdown
    readme = (Path(config["config_file_path"]).parent / "README.md").read_text(encoding="utf-8")
    page_path = page.file.src_uri
    unknown = [line for line in markdown.splitlines() if line.startswith("<!-- readme ")]
    unknown = [line for line in unknown if not _DIRECTIVE.match(line)]
    if unknown:
        raise PluginError(f"{page_path}: malformed README include {unknown[0]!r}")
    return _DIRECTIVE.sub(
        lambda m: _section(readme, m.group("heading"), m.group("options"), page_path), markdown
    )
