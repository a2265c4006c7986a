"""safevars' pytest plugin: ``pytest --safevars-audit`` runs every test inside an audit.

Each test runs inside ``safevars.audit()``; a test whose report lists a race fails with
the report (a test that fails on its own keeps its failure, with the report beside it).
``@pytest.mark.safevars_no_audit`` runs a test without an audit.

pytest loads this module (entry point ``pytest11``) in every project where safevars is
installed, at start-up. Importing safevars imports TensorFlow, which may initialize its
devices, after which a ``conftest.py`` can no longer configure them. So this module
imports nothing but pytest: safevars is imported at the first audited test, and only
under ``--safevars-audit`` (as Hypothesis does with ``_hypothesis_pytestplugin``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest

OPTION = "--safevars-audit"
MARKER = "safevars_no_audit"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("safevars")
    group.addoption(
        OPTION,
        action="store_true",
        default=False,
        dest="safevars_audit",
        help=(
            "run every test inside safevars.audit() and fail a test whose report lists a "
            f"race (@pytest.mark.{MARKER} opts a test out)"
        ),
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(reason=None): run this test without safevars.audit() under {OPTION}",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    __tracebackhide__ = True
    if not item.config.getoption("safevars_audit") or item.get_closest_marker(MARKER):
        return (yield)
    from safevars.audit.pytest_support import TestAudit  # only now: it imports TensorFlow

    audit = TestAudit(item)
    try:
        result = yield
    except BaseException:
        audit.close(failed=True)
        raise
    audit.close()
    audit.check()
    return result
