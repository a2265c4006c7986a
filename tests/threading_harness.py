"""Run test workers for real: start them on a barrier, join with a timeout, re-raise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

JOIN_TIMEOUT = 120.0


def run_threads(n: int, target: Callable[..., Any], *args: Any) -> None:
    """Runs ``target(index, *args)`` in ``n`` threads released together by a barrier.

    Fails if a thread is still alive after ``JOIN_TIMEOUT`` seconds (a deadlock) and
    re-raises the first exception a worker raised.
    """
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=JOIN_TIMEOUT)
            target(index, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {JOIN_TIMEOUT}s (deadlock?): {alive}"
    if errors:
        raise errors[0]
