"""Run test workers for real: start them on a barrier, join by one deadline, re-raise.

A deadlock must fail a test, not hang it, and fail it soon: every join in one call shares
a single deadline, so six deadlocked threads fail after ``JOIN_TIMEOUT`` seconds in all,
not six times that. :func:`call_bounded` runs one body (a section that might wait on
itself) in a thread the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

JOIN_TIMEOUT = 120.0


def join_all(threads: Sequence[threading.Thread], timeout: float | None = None) -> list[str]:
    """Joins ``threads`` against one deadline ``timeout`` seconds from now.

    Args:
      threads: Started threads.
      timeout: Seconds for all of them together; ``JOIN_TIMEOUT`` (read at call time, so
        a test may monkeypatch it) if None.

    Returns:
      The names of the threads still alive at the deadline (empty when all finished).
    """
    budget = JOIN_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + budget
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def run_threads(n: int, target: Callable[..., Any], *args: Any) -> None:
    """Runs ``target(index, *args)`` in ``n`` threads released together by a barrier.

    Fails if a thread is still alive ``JOIN_TIMEOUT`` seconds after the threads started
    (one deadline for all of them: a deadlock) and re-raises the first exception a worker
    raised.
    """
    budget = JOIN_TIMEOUT
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=budget)
            target(index, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    alive = join_all(threads, budget)
    assert not alive, f"threads still running after {budget}s in all (deadlock?): {alive}"
    if errors:
        raise errors[0]


def call_bounded(fn: Callable[[], T], timeout: float | None = None) -> T:
    """Returns ``fn()`` run in a fresh thread, failing if it has not returned in time.

    For a body that could wait on a lock its own thread holds: the test fails after
    ``timeout`` seconds (``JOIN_TIMEOUT`` if None) instead of hanging. The stuck thread
    is a daemon and is left behind. Whatever ``fn`` raises is re-raised here.
    """
    budget = JOIN_TIMEOUT if timeout is None else timeout
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            outcome["error"] = e

    thread = threading.Thread(target=body, name=getattr(fn, "__name__", "body"), daemon=True)
    thread.start()
    alive = join_all([thread], budget)
    assert not alive, (
        f"{alive[0]} still running after {budget}s: it waits on something that never "
        "comes (a thread waiting on a lock it holds itself?)"
    )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]
