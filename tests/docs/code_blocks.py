"""The Python code blocks of README.md and docs/**/*.md, and running one as a user would.

A block is a fenced ```` ```python ```` (or ```` ```py ````) block, at any indentation
(inside a list item too). Every block must run as written, in a fresh process, from an
empty directory. A block that is deliberately a fragment says so on the line right
before its fence (blank lines between are allowed)::

    <!-- fragment: needs a TF_CONFIG cluster of two machines -->

The reason is required. Fragments are listed in the test's summary, so they stay few.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support import forked
from tests.support.deadlines import scaled

ROOT = Path(__file__).resolve().parents[2]
#: The Markdown files whose blocks run: the README and the documentation site's pages.
DOCUMENTS = ("README.md", "docs/**/*.md")
#: A hang bound, not a timing assertion (CONTRIBUTING.md, "Thread tests"): blocks are
#: written to take about 10 s on 2 cores, TensorFlow's import included. Scaled by
#: ``SAFEVARS_TEST_TIMEOUT_SCALE``.
TIMEOUT_S = scaled(240.0)

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_FRAGMENT = re.compile(r"^\s*<!-- fragment(?::\s*(?P<reason>.*?))?\s*-->\s*$")
_PYTHON = {"python", "py", "python3"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One Python code block: where it is, its code, and why it is a fragment (if it is)."""

    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    fragment: str | None = None  # the reason given, None for a block that must run

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks_of(text: str, path: str) -> list[Block]:
    """The Python blocks of one Markdown document, in order.

    Raises:
      ValueError: a fragment marker without a reason, or a fence never closed.
    """
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        words = opening["info"].strip().split()
        language = words[0].lower() if words else ""
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            closing = _FENCE.match(lines[i])
            if (
                closing
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
            i += 1
        else:
            raise ValueError(f"{path}:{start + 1}: code fence never closed")
        i += 1
        if language not in _PYTHON:
            continue
        before = next((line for line in reversed(lines[:start]) if line.strip()), "")
        marker = _FRAGMENT.match(before)
        reason = None
        if marker is not None:
            reason = (marker["reason"] or "").strip()
            if not reason:
                raise ValueError(
                    f"{path}:{start + 1}: a fragment marker needs a reason: "
                    "<!-- fragment: why this block cannot run as written -->"
                )
        found.append(Block(path, start + 1, "\n".join(body) + "\n", reason))
    return found


def all_blocks(root: Path = ROOT) -> list[Block]:
    """Every Python block of :data:`DOCUMENTS`, files in sorted order."""
    paths = sorted({p for pattern in DOCUMENTS for p in root.glob(pattern)})
    return [
        block
        for p in paths
        for block in blocks_of(p.read_text(encoding="utf-8"), p.relative_to(root).as_posix())
    ]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a block's run ended."""

    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def environment() -> dict[str, str]:
    """A user's environment, with this repository's safevars first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # readable failures; changes no result
    return env


def run(block: Block, timeout: float = TIMEOUT_S, fork: bool | None = None) -> Outcome:
    """Runs ``block`` in a fresh process, in an empty directory, as ``snippet.py``.

    Forked (the default, see :mod:`tests.support.forked`): the process is a fork of a
    server that imported NumPy, TensorFlow, Keras and safevars and nothing else, and
    runs the file with a fresh ``__main__`` namespace; it saves TensorFlow's import per
    block (several seconds). Not forked (``SAFEVARS_TEST_FORK=0``): ``python snippet.py``.
    """
    with tempfile.TemporaryDirectory(prefix="safevars-doc-") as directory:
        script = Path(directory) / "snippet.py"
        script.write_text(block.code, encoding="utf-8")
        start = time.perf_counter()
        try:
            done = forked.run(
                [script.name], timeout=timeout, env=environment(), cwd=directory, fork=fork
            )
        except subprocess.TimeoutExpired as e:
            return Outcome(
                None,
                time.perf_counter() - start,
                _text(e.stdout),
                _text(e.stderr) + f"\n(killed after {timeout:.0f} s)",
            )
        return Outcome(done.returncode, time.perf_counter() - start, done.stdout, done.stderr)


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
