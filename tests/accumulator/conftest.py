"""Fixtures of the GradientAccumulator tests."""

from __future__ import annotations

import pytest

from safevars.accumulator import state as accumulator_state


@pytest.fixture(params=["one_row", "blocks"])
def layout(request, monkeypatch):
    """Runs a test with both deterministic buffer layouts: small models store each
    contribution as one row; models with gradients of at least ``_DIRECT`` elements
    store blocks of ``_CHUNK``-element rows, large gradients straight from the tensor
    (see ``_Layout``). "blocks" shrinks both constants so that the tests' small
    variables take that path: direct rows, a partial last row (tail) and padding."""
    if request.param == "blocks":
        monkeypatch.setattr(accumulator_state, "_CHUNK", 4)
        monkeypatch.setattr(accumulator_state, "_DIRECT", 8)
    return request.param
