"""One test inside an audit: what ``pytest --safevars-audit`` does around each test.

The plugin itself is the top-level module ``_safevars_pytestplugin`` (registered with
pytest by the entry point ``pytest11``), which imports nothing but pytest until a test
runs under ``--safevars-audit``; it then runs the test's call inside a :class:`TestAudit`.
"""

from __future__ import annotations

from typing import Any

from safevars.audit.context_manager import _audit
from safevars.audit.report import AuditReport
from safevars.errors import RaceDetectedError

__all__ = ["TestAudit"]

SECTION = "safevars audit"


class TestAudit:
    """The audit of one test's call: started by the constructor, ended by :meth:`close`;
    :meth:`check` fails the test on any race.

    The test's arguments (its fixtures' values) and its instance are searched for locks
    made before the audit began, as the project's modules are.

    Thread safety: as :func:`safevars.audit`: every thread's accesses are recorded while
    the test runs, also those of threads started before it.

    Modes: as :func:`safevars.audit`.
    """

    def __init__(self, item: Any) -> None:
        self.item = item
        roots: list[Any] = []
        funcargs = getattr(item, "funcargs", None)
        if isinstance(funcargs, dict):
            roots.append(funcargs)
        instance = getattr(item, "instance", None)
        if instance is not None:
            roots.append(instance)
        self._context = _audit(False, True, roots)
        self.report: AuditReport = self._context.__enter__()

    def close(self, failed: bool = False) -> None:
        """Ends the audit. A test that ``failed`` on its own keeps its failure, and a
        report with races is added to its output (the section "safevars audit")."""
        self._context.__exit__(None, None, None)
        if failed and self.report.races:
            self.item.add_report_section("call", SECTION, str(self.report))

    def check(self) -> None:
        """Raises :class:`~safevars.RaceDetectedError` (an ``AssertionError``) with the
        report if it lists a race."""
        __tracebackhide__ = True
        if self.report.races:
            raise RaceDetectedError(
                f"{self.item.nodeid}: safevars.audit() found unsynchronized variable "
                "access (pytest --safevars-audit; @pytest.mark.safevars_no_audit runs a "
                "test without it):\n" + str(self.report)
            )
