"""Python log records and warnings held while a progress line is open.

The runner prints a case's progress line in two parts: its name, then, once the case
was measured, its figures. Anything TensorFlow (or Keras, or the case) logs in between
would land in the middle of that line: a ``tf.function`` retracing warning did
(issue 38). :func:`held` collects, for the duration of a ``with`` block, the records of
the Python loggers that have handlers (TensorFlow's ``tensorflow`` logger, absl's and
the root logger, where absl installs its handler) and the :mod:`warnings` shown; the
caller ends its line, then :meth:`Held.replay` hands every record to its logger and
every warning to :func:`warnings.showwarning` again, so each prints whole, on its own
lines, formatted as it would have been.

What TensorFlow's C++ code writes to file descriptor 2 cannot be held this way;
``python -m benchmarks`` keeps those lines to errors (``TF_CPP_MIN_LOG_LEVEL=2``, see
``examples/_quiet.py``).

Thread safety: records and warnings from any thread are held (a contention case's
workers too); :func:`held` itself is for the one thread that runs the cases, and it
changes process-wide state (handlers, the warnings filters and ``showwarning``) until
the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

__all__ = ["LOGGERS", "Held", "held"]

#: The loggers whose handlers are held (the root logger is ``""``).
LOGGERS = ("tensorflow", "absl", "")


class _Collector(logging.Handler):
    """Stands in for the held loggers' handlers: keeps each record once."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__()
        self._records = records
        self._seen: set[int] = set()
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._guard:  # one record reaches every held logger it propagates to
            if id(record) not in self._seen:
                self._seen.add(id(record))
                self._records.append(record)


class Held:
    """The records and warnings of one :func:`held` block, until :meth:`replay`.

    Attributes:
      records: The log records, in the order they were logged.
      warnings: The warnings shown, in order.
    """

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self.warnings: list[warnings.WarningMessage] = []
        self.collector = _Collector(self.records)

    def replay(self) -> None:
        """Emits everything held, in order, through the handlers restored by then, and
        forgets it."""
        records, shown = self.records[:], self.warnings[:]
        self.records.clear()
        self.warnings.clear()
        for record in records:
            logging.getLogger(record.name).handle(record)
        for w in shown:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)


@contextlib.contextmanager
def held(loggers: tuple[str, ...] = LOGGERS) -> Iterator[Held]:
    """Holds log records and warnings until the block ends; :meth:`Held.replay` prints
    them (after the caller has ended its line)."""
    hold = Held()
    saved: dict[str, list[logging.Handler]] = {}
    for name in loggers:
        logger = logging.getLogger(name)
        if logger.handlers:
            saved[name] = logger.handlers[:]
            logger.handlers = [hold.collector]
    try:
        with warnings.catch_warnings(record=True) as caught:
            try:
                yield hold
            finally:
                hold.warnings.extend(caught)
    finally:
        for name, handlers in saved.items():
            logging.getLogger(name).handlers = handlers
