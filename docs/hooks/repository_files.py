"""MkDocs hook: links from the docs to files of the repository resolve on the built site.

A docs page links a repository file by its relative path, the way GitHub resolves it:
``[race_demo.py](../../examples/race_demo.py)`` from ``docs/guide/``. The site has no such
file, and the repository has no public address to link to instead, so this hook adds one
generated page per linked file, under ``files/`` (``files/examples/race_demo.py/``): a
Python, TOML, YAML or shell file is shown highlighted, a Markdown file (CONTRIBUTING.md)
is rendered, its own relative links treated the same way. A link to a directory gets a
page listing its files. The links are rewritten to those pages, so ``mkdocs build
--strict`` checks them like any other; a link to a path that does not exist fails the
build.

Only links outside fenced code blocks are considered; links into ``docs/`` itself,
absolute URLs and anchors within a page are left to MkDocs.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

#: Where the generated pages go in the site.
PREFIX = "files"
_LINK = re.compile(r"(?P<open>\]\()(?P<target>[^()\s#]+)(?P<anchor>#[^()\s]*)?(?P<close>\))")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_LANGUAGES = {
    ".py": "python",
    ".toml": "toml",
    ".yml": "yaml",
    ".yaml": "yaml",
    ".json": "json",
    ".sh": "bash",
    ".cfg": "ini",
    ".txt": "text",
}
#: Generated page (src_uri) -> the repository path it shows, for links inside it.
_SHOWN: dict[str, str] = {}


def _root(config: Any) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _outside_fences(markdown: str) -> list[bool]:
    outside, fence = [], None
    for line in markdown.splitlines(keepends=True):
        match = _FENCE.match(line)
        if fence is None:
            outside.append(match is None)
            if match:
                fence = match.group(1)
        else:
            outside.append(False)
            if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                fence = None
    return outside


def _targets(markdown: str) -> list[re.Match[str]]:
    lines = markdown.splitlines(keepends=True)
    outside = _outside_fences(markdown)
    found, offset = [], 0
    for line, ok in zip(lines, outside):
        if ok:
            found += list(_LINK.finditer(markdown, offset, offset + len(line)))
        offset += len(line)
    return found


def _repository_path(where: str, target: str, root: Path, docs: Path) -> str | None:
    """The repository-relative path ``target`` names from the file at ``where``
    (repository-relative), or None when MkDocs handles it (a URL, a docs file)."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = posixpath.normpath(posixpath.join(posixpath.dirname(where), target))
    resolved = (root / path).resolve()
    if resolved == docs or docs in resolved.parents:
        return None
    if path.startswith("../") or path == "..":
        raise PluginError(f"{where}: the link {target!r} leaves the repository.")
    if not resolved.exists():
        raise PluginError(f"{where}: the link {target!r} names {path}, which does not exist.")
    return path


def _page_for(path: str, root: Path) -> str:
    """The generated page's src_uri for repository path ``path``."""
    if (root / path).is_dir():
        return f"{PREFIX}/{path}/index.md"
    return f"{PREFIX}/{path}" if path.endswith(".md") else f"{PREFIX}/{path}.md"


def _content(path: str, root: Path) -> str:
    full = root / path
    if full.is_dir():
        entries = sorted(p for p in full.iterdir() if p.is_file() and not p.name.startswith("."))
        items = [
            f"- [`{p.name}`]({p.name if p.suffix == '.md' else p.name + '.md'})"
            for p in entries
            if p.suffix != ".pyc"
        ]
        return f"# `{path}/`\n\n" + "\n".join(items) + "\n"
    text = full.read_text(encoding="utf-8")
    if full.suffix == ".md":
        return text
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    language = _LANGUAGES.get(full.suffix, "text")
    return f"# `{path}`\n\n{fence}{language}\n{text.rstrip()}\n{fence}\n"


def on_files(files: Files, config: Any) -> Files:
    """Adds a generated page for every repository file the pages link (transitively)."""
    root, docs = _root(config), Path(config["docs_dir"]).resolve()
    docs_prefix = docs.relative_to(root).as_posix()
    pending = [
        (f"{docs_prefix}/{f.src_uri}", f.content_string) for f in files.documentation_pages()
    ]
    while pending:
        where, markdown = pending.pop()
        for match in _targets(markdown):
            path = _repository_path(where, match["target"], root, docs)
            if path is None:
                continue
            entries = [path]
            if (root / path).is_dir():
                entries += [
                    f"{path}/{p.name}"
                    for p in sorted((root / path).iterdir())
                    if p.is_file() and not p.name.startswith(".") and p.suffix != ".pyc"
                ]
            for entry in entries:
                uri = _page_for(entry, root)
                if uri in _SHOWN:
                    continue
                _SHOWN[uri] = entry
                content = _content(entry, root)
                files.append(File.generated(config, uri, content=content))
                if entry.endswith(".md"):
                    pending.append((entry, content))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrites links to repository files into links to their generated pages."""
    root, docs = _root(config), Path(config["docs_dir"]).resolve()
    uri = page.file.src_uri
    where = _SHOWN.get(uri) or f"{docs.relative_to(root).as_posix()}/{uri}"
    if uri in _SHOWN and not where.endswith(".md"):
        return markdown  # a listing or a highlighted file: its links are already pages
    docs_prefix = docs.relative_to(root).as_posix()
    out, last = [], 0
    for match in _targets(markdown):
        path = _repository_path(where, match["target"], root, docs)
        if path is not None:
            target_uri = _page_for(path, root)
        elif uri in _SHOWN and "://" not in match["target"]:
            # A rendered repository file (CONTRIBUTING.md) linking into docs/.
            in_docs = posixpath.normpath(posixpath.join(posixpath.dirname(where), match["target"]))
            if not in_docs.startswith(docs_prefix + "/"):
                continue
            target_uri = in_docs[len(docs_prefix) + 1 :]
        else:
            continue
        relative = posixpath.relpath(target_uri, posixpath.dirname(uri) or ".")
        out += [markdown[last : match.start("target")], relative]
        last = match.end("target")
    return "".join(out) + markdown[last:]
