"""Every Python code block of README.md and docs/ runs as written (CONTRIBUTING.md, "Docs").

The blocks run in fresh processes, ``SAFEVARS_DOC_JOBS`` (default 2) at a time, once per
session for the tests selected; each block's test then reports its own outcome. The
summary at the end of the run names the slowest blocks.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs import conftest
from tests.docs.code_blocks import DOCUMENTS, ROOT, Block, Outcome, all_blocks, blocks_of, run

BLOCKS = all_blocks()
RUNNABLE = {b.id: b for b in BLOCKS if b.fragment is None}
FRAGMENTS = [b for b in BLOCKS if b.fragment is not None]


@pytest.fixture(scope="session")
def outcomes(request: pytest.FixtureRequest) -> dict[str, Outcome]:
    """Runs every block whose test was selected, in parallel; block id -> outcome."""
    selected = [
        item.callspec.params["block_id"]
        for item in request.session.items
        if getattr(item, "callspec", None) and "block_id" in item.callspec.params
    ]
    jobs = max(1, int(os.environ.get("SAFEVARS_DOC_JOBS", "2")))
    start = time.perf_counter()
    with ThreadPoolExecutor(jobs) as pool:
        results = dict(zip(selected, pool.map(lambda i: run(RUNNABLE[i]), selected)))
    conftest.RUN.update(wall_s=time.perf_counter() - start, jobs=jobs, fragments=len(FRAGMENTS))
    conftest.TIMINGS.update({i: o.seconds for i, o in results.items()})
    return results


@pytest.mark.parametrize("block_id", list(RUNNABLE))
def test_code_block_runs(block_id: str, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[block_id]
    assert outcome.ok, (
        f"{block_id} exited with {outcome.returncode} after {outcome.seconds:.1f} s\n"
        f"--- code ---\n{RUNNABLE[block_id].code}\n"
        f"--- stdout ---\n{outcome.stdout[-3000:]}\n--- stderr ---\n{outcome.stderr[-5000:]}"
    )


def test_there_are_blocks_and_few_fragments() -> None:
    assert len(RUNNABLE) >= 10, sorted(RUNNABLE)
    assert len(FRAGMENTS) <= len(BLOCKS) // 5, [(f.id, f.fragment) for f in FRAGMENTS]


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "python"])
def test_a_failing_block_fails(fork: bool) -> None:
    """The runner reports a block that raises, exits non-zero, or hangs, as failed, and
    a forked block starts with nothing defined (a missing import fails)."""
    fine = run(Block("x.md", 1, "import sys\nprint('fine', file=sys.stderr)\n"), fork=fork)
    assert fine.ok and "fine" in fine.stderr, fine
    broken = run(Block("x.md", 1, "raise ValueError('broken')\n"), fork=fork)
    assert not broken.ok and "ValueError: broken" in broken.stderr, broken
    assert run(Block("x.md", 1, "import sys\nsys.exit(3)\n"), fork=fork).returncode == 3
    assert not run(Block("x.md", 1, "tf.constant(1)\n"), fork=fork).ok  # NameError: tf
    hung = run(Block("x.md", 1, "import time\ntime.sleep(60)\n"), timeout=2, fork=fork)
    assert not hung.ok and hung.returncode is None


def test_blocks_and_fragments_are_found() -> None:
    text = (
        "Text.\n\n```python\nprint(1)\n```\n\n"
        "1. In a list:\n\n   ```py\n   x = 2\n   ```\n\n"
        "<!-- fragment: needs a cluster -->\n\n```python\nstrategy.run(step)\n```\n\n"
        "```bash\nls\n```\n\n````markdown\n```python\nnot a block\n```\n````\n"
    )
    blocks = blocks_of(text, "page.md")
    assert [(b.line, b.code, b.fragment) for b in blocks] == [
        (3, "print(1)\n", None),
        (9, "x = 2\n", None),
        (15, "strategy.run(step)\n", "needs a cluster"),
    ]
    with pytest.raises(ValueError, match="needs a reason"):
        blocks_of("<!-- fragment -->\n```python\nx\n```\n", "page.md")


def test_the_readme_second_quickstart_command_is_what_ci_runs() -> None:
    """README's test command ends with the line `.ci/run` runs (after its own venv)."""
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    ci_command = next(line for line in reversed(ci_lines) if "python -m pytest" in line)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = quickstart.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(commands) == 2, commands
    assert "python -m benchmarks" in commands[0]
    assert commands[1].endswith(ci_command.strip()), (commands[1], ci_command)


#: Code lines fit the site's code blocks at common widths without wrapping.
MAX_COLUMNS = 88


def test_code_lines_fit() -> None:
    long = [
        f"{b.id} +{i}: {len(line)} columns"
        for b in BLOCKS
        for i, line in enumerate(b.code.splitlines(), 1)
        if len(line) > MAX_COLUMNS
    ]
    assert not long, f"lines over {MAX_COLUMNS} columns: {long}"


def test_no_placeholder_is_left_in_the_markdown() -> None:
    """A figure to fill in later (``TIME_PLACEHOLDER``) never reaches a reader."""
    patterns = (*DOCUMENTS, "CHANGELOG.md", "CONTRIBUTING.md")
    pages = sorted({page for pattern in patterns for page in ROOT.glob(pattern)})
    left = [
        f"{page.relative_to(ROOT)}:{number}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"[A-Z]+_PLACEHOLDER|\bTBD\b", line)
    ]
    assert not left, f"placeholders left in: {left}"


def test_readme_is_short() -> None:
    lines = Path(ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)


def test_readme_headline_results_table_is_marked_and_short() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("<!-- headline-results -->\n", 1)[1].split(
        "<!-- /headline-results -->", 1
    )[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert rows[0].startswith("| case |") and len(rows) - 2 <= 15, rows
