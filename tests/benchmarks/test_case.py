"""The contract between the runner and the families (:mod:`benchmarks.case`)."""

from __future__ import annotations

import pytest

from benchmarks.case import goal_spec


def test_goal_forms():
    assert goal_spec(("v", 1.1)) == ("v", "<=", 1.1)
    assert goal_spec(("v", ">=", 2)) == ("v", ">=", 2.0)
    for bad in (("v",), ("v", "<", 1.0), ("v", 0.0), ("v", True), (1, 1.0)):
        with pytest.raises(ValueError):
            goal_spec(bad)
