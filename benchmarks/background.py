"""A thread that repeats some work while a case is timed (a busy writer, a trainer).

:class:`Background` starts on the first call of a variant that needs it (so a case that
is skipped or fails to build starts nothing) and stops in the case's ``teardown``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Background"]

JOIN_TIMEOUT = 60.0  # seconds to wait for the thread to stop


class Background:
    """Runs ``work()`` again and again in a daemon thread, from :meth:`ensure_running`
    until :meth:`close`."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self.work = work
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def ensure_running(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.work()

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(JOIN_TIMEOUT)
