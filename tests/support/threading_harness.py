"""Run test workers for real: start them on a barrier, join by one deadline, re-raise.

A deadlock must fail a test, not hang it, and fail it soon: every join in one call shares
a single deadline, so six deadlocked threads fail after ``JOIN_TIMEOUT`` seconds in all,
not six times that. :func:`call_bounded` runs one body (a section that might wait on
itself) in a thread the same way.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tests.support.deadlines import scaled

T = TypeVar("T")

#: The bound, in seconds, on every join of one call (a deadlock detector, far above the
#: few seconds a thread test takes; scaled by ``SAFEVARS_TEST_TIMEOUT_SCALE``).
JOIN_TIMEOUT = scaled(120.0)


def join_all(threads: Sequence[threading.Thread], timeout: float | None = None) -> list[str]:
    """Joins ``threads`` against one deadline ``timeout`` seconds from now.

    Args:
      threads: Started threads.
      timeout: Seconds for all of them together at scale 1 (multiplied by
        ``SAFEVARS_TEST_TIMEOUT_SCALE``); ``JOIN_TIMEOUT`` (read at call time, so a test
        may monkeypatch it) if None.

    Returns:
      The names of the threads still alive at the deadline (empty when all finished).
    """
    return _join_by(threads, JOIN_TIMEOUT if timeout is None else scaled(timeout))


def _join_by(threads: Sequence[threading.Thread], budget: float) -> list[str]:
    """:func:`join_all` with ``budget`` seconds as given (already scaled)."""
    deadline = time.monotonic() + budget
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threads if t.is_alive()]


def run_threads(n: int, target: Callable[..., Any], *args: Any) -> None:
    """Runs ``target(index, *args)`` in ``n`` threads released together by a barrier.

    Re-raises the first exception a worker raised as soon as it is raised: the threads
    still running then (waiting on a barrier of the test for the failed worker, or on a
    lock it left held) do not turn it into a timeout; they are named in a note on the
    exception (Python 3.11+) and left behind (daemon threads). Fails if no worker failed
    and one is still alive ``JOIN_TIMEOUT`` seconds after the threads started (one
    deadline for all of them: a deadlock).
    """
    budget = JOIN_TIMEOUT
    deadline = time.monotonic() + budget
    barrier = threading.Barrier(n)
    errors: list[tuple[threading.Thread, BaseException]] = []
    settled = threading.Event()  # a worker failed, or every worker ended
    count_lock = threading.Lock()
    running = [n]

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=budget)
            target(index, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append((threading.current_thread(), e))
            settled.set()
        finally:
            with count_lock:
                running[0] -= 1
                if running[0] == 0:
                    settled.set()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    settled.wait(budget)
    if errors:
        failed, first = errors[0]
        alive = [t.name for t in threads if t.is_alive() and t is not failed]
        if alive and hasattr(first, "add_note"):  # Python 3.11+
            first.add_note(f"run_threads: raised by a worker; still running then: {alive}")
        raise first
    alive = _join_by(threads, max(0.0, deadline - time.monotonic()))
    assert not alive, f"threads still running after {budget}s in all (deadlock?): {alive}"


def call_bounded(fn: Callable[[], T], timeout: float | None = None) -> T:
    """Returns ``fn()`` run in a fresh thread, failing if it has not returned in time.

    For a body that could wait on a lock its own thread holds: the test fails after
    ``timeout`` seconds at scale 1 (multiplied by ``SAFEVARS_TEST_TIMEOUT_SCALE``;
    ``JOIN_TIMEOUT`` if None) instead of hanging. The stuck thread is a daemon and is
    left behind. Whatever ``fn`` raises is re-raised here, as soon as it is raised.
    """
    budget = JOIN_TIMEOUT if timeout is None else scaled(timeout)
    outcome: dict[str, Any] = {}

    def body() -> None:
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            outcome["error"] = e

    thread = threading.Thread(target=body, name=getattr(fn, "__name__", "body"), daemon=True)
    thread.start()
    alive = _join_by([thread], budget)
    assert not alive, (
        f"{alive[0]} still running after {budget}s: it waits on something that never "
        "comes (a thread waiting on a lock it holds itself?)"
    )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def in_frame(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is running ``function`` now (anywhere on its stack): where a
    test finds a thread that waits inside a given call."""
    frame = sys._current_frames().get(thread.ident)  # type: ignore[arg-type]
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def wait_for(
    condition: Callable[[], bool],
    what: str,
    timeout: float = 60.0,
    errors: Sequence[BaseException] = (),
) -> None:
    """Waits until ``condition()`` holds, failing after ``timeout`` seconds at scale 1
    (a deadlock detector) with ``what`` in the message. ``errors``: a list the workers
    append their own exceptions to; one there ends the wait at once and is raised as the
    cause (a worker that died never makes the condition hold)."""
    deadline = time.monotonic() + scaled(timeout)
    while not condition():
        if errors:
            raise AssertionError(f"a worker failed while waiting for {what}") from errors[0]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.0002)
