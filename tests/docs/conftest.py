"""The docs tests' summary: how long the code blocks took, the slowest, the fragments."""

from __future__ import annotations

from typing import Any

import pytest

#: Filled by tests/docs/test_code_blocks.py: block id -> seconds, and the wall time.
TIMINGS: dict[str, float] = {}
RUN: dict[str, Any] = {}


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if not TIMINGS:
        return
    slowest = sorted(TIMINGS.items(), key=lambda item: -item[1])[:5]
    write = terminalreporter.write_line
    terminalreporter.section("documentation code blocks")
    write(
        f"{len(TIMINGS)} blocks ran in {RUN.get('wall_s', 0.0):.0f} s "
        f"({RUN.get('jobs', 1)} at a time, {sum(TIMINGS.values()):.0f} s in all); "
        f"{RUN.get('fragments', 0)} fragment(s) not run"
    )
    write("slowest: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in slowest))
