"""The docs tests' summary: how long the code blocks took, the slowest, the fragments.

Under pytest-xdist the blocks run in a worker, which hands the figures to the controller
(``tests/conftest.py`` prints them there).
"""

from __future__ import annotations

from typing import Any

import pytest

#: Filled by tests/docs/test_code_blocks.py: block id -> seconds, and the wall time.
TIMINGS: dict[str, float] = {}
RUN: dict[str, Any] = {}


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    summarize(terminalreporter, TIMINGS, RUN)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: the figures go to the controller, which prints them
    (``tests/conftest.py``)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None and TIMINGS:
        output["safevars_doc_blocks"] = {"timings": dict(TIMINGS), "run": dict(RUN)}


def summarize(terminalreporter: Any, timings: dict[str, float], run: dict[str, Any]) -> None:
    if not timings:
        return
    slowest = sorted(timings.items(), key=lambda item: -item[1])[:5]
    write = terminalreporter.write_line
    terminalreporter.section("documentation code blocks")
    write(
        f"{len(timings)} blocks ran in {run.get('wall_s', 0.0):.0f} s "
        f"({run.get('jobs', 1)} at a time, {sum(timings.values()):.0f} s in all); "
        f"{run.get('fragments', 0)} fragment(s) not run"
    )
    write("slowest: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest))
