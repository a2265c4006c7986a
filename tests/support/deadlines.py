"""The one factor every deadline of the test suite is multiplied by.

A deadline in a test is a bound on a hang (a thread join, a subprocess's or a cluster's
run, a wait for a worker), never a timing check: on a busy machine the suite may take
longer, but it must not fail. Every such bound is written as ``scaled(seconds)``, with
``seconds`` generous on an idle 2-core machine, and ``SAFEVARS_TEST_TIMEOUT_SCALE``
(default 1) multiplies them all: a CI runner that is slower or busier than that sets,
say, ``SAFEVARS_TEST_TIMEOUT_SCALE=3``. pytest-timeout's per-test limit (``timeout`` in
``pyproject.toml``) is scaled by ``tests/conftest.py`` with the same factor.

This module is the only place that reads the variable. It imports nothing of the
repository, so the cluster scripts (``tests/distributed/scripts/``) and the examples'
smoke tests, which run outside the ``tests`` package, load it too; subprocesses inherit
the variable with the environment.
"""

from __future__ import annotations

import math
import os

ENV_VAR = "SAFEVARS_TEST_TIMEOUT_SCALE"


def _read_scale() -> float:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{ENV_VAR} must be a positive number (a factor for every deadline of the "
            f"tests), got {raw!r}. Unset it for 1, or set e.g. {ENV_VAR}=3 on a slow machine."
        )
    return value


#: The factor, read once at import from ``SAFEVARS_TEST_TIMEOUT_SCALE``.
SCALE: float = _read_scale()


def scaled(seconds: float) -> float:
    """``seconds`` times :data:`SCALE`: a deadline that grows with the documented factor."""
    return seconds * SCALE
