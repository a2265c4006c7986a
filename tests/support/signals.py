"""Ctrl-C reaches the processes the tests start, however the run itself was started.

A shell without job control starts a background command (``python -m pytest &`` in a
script, a CI step sent to the background) with SIGINT ignored, and an ignored signal
stays ignored in every process started from it: Python then installs no
``KeyboardInterrupt`` handler, and the tests that send Ctrl-C to a child (the fault, Ctrl-C
and benchmark-interruption tests) all fail, the child never interrupted. Measured
2026-11-30: a whole run started as ``(python -m pytest &)`` failed those three tests.
"""

from __future__ import annotations

import signal


def default_sigint() -> bool:
    """Gives this process Python's default Ctrl-C handler if SIGINT was ignored (a handler,
    unlike an ignored signal, is not inherited: a process this one starts gets SIGINT's
    default and installs its own). Returns whether it was ignored."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return False
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return True
