"""The entry point: ``safevars.audit()``, the context manager that runs an audit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from safevars._validation import check_bool
from safevars.audit.happens_before import _Detector
from safevars.audit.patching import _activate, _deactivate
from safevars.audit.report import AuditReport
from safevars.errors import RaceDetectedError

__all__ = ["audit"]


def audit(
    raise_on_race: bool = False, *, predictive: bool = True
) -> contextlib.AbstractContextManager[AuditReport]:
    """Context manager watching every ``tf.Variable`` access for races while it is active.

    Example::

        with safevars.audit() as report:
            run_threads()
        for race in report.races:
            print(race)

        # In a test suite: fail the test on any finding.
        with safevars.audit(raise_on_race=True):
            run_threads()

    Args:
      raise_on_race: If True, raise :class:`~safevars.RaceDetectedError` (an
        ``AssertionError``) when the block ends normally and the report lists a race.
        A block that raises keeps its own exception.
      predictive: If True (default), report conflicts between accesses that nothing
        orders (see the module docstring); if False, only those whose operations were
        recorded in flight at the same time.

    Returns:
      A context manager; ``with`` gives the :class:`AuditReport`.

    Raises:
      InvalidArgumentError: an argument is not a bool.
      RaceDetectedError: at the end of the block, with ``raise_on_race=True``.

    Thread safety: records accesses from every thread while active. Audits may nest and
    overlap across threads; each sees every access made while it is active. The patches
    are installed by the first active audit and removed by the last, also on exceptions.

    Modes: eager accesses are seen as they happen; ``tf.function`` accesses are seen at
    trace time and replayed at each eager call of the function (graph execution itself
    is invisible; see :mod:`safevars.audit`).
    """
    raise_on_race = check_bool(raise_on_race, "raise_on_race")
    predictive = check_bool(predictive, "predictive")
    return _audit(raise_on_race, predictive)


@contextlib.contextmanager
def _audit(
    raise_on_race: bool, predictive: bool, roots: Iterable[Any] = ()
) -> Iterator[AuditReport]:
    """The audit; ``roots`` are further objects where locks made before it are looked
    for (the pytest plugin passes a test's arguments)."""
    detector = _Detector(predictive)
    report = AuditReport(detector)
    _activate(detector, roots)
    try:
        yield report
    finally:
        _deactivate(detector)
    if raise_on_race and report.races:
        raise RaceDetectedError(
            "safevars.audit(raise_on_race=True) found unsynchronized variable access:\n"
            + str(report)
        )
