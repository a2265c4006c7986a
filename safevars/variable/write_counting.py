"""Who counts a write: the SafeVariable itself, or enclosing code that counts it once.

Every write through a SafeVariable adds 1 to its version, unless the calling thread is
inside :func:`writes_counted_by_caller` for that variable: then the caller counts the
whole logical update itself (one version per optimizer step, however many writes Keras
makes; one per ``strategy.extended.update``, however many replica copies it writes).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from safevars.locking import Guard


class _CountFrame:
    """One open :func:`writes_counted_by_caller` context: its guards, and those written."""

    __slots__ = ("guards", "written")

    def __init__(self, guards: Iterable[Guard]) -> None:
        self.guards = set(guards)
        self.written: set[Guard] = set()


_counting = threading.local()  # .frames: the open contexts of this thread, outermost first
# Contexts open in any thread: while none is, a write skips the thread-local lookup (the
# common case; an eager scalar write costs about 10 us in all).
_open_frames = [0]
_open_frames_lock = threading.Lock()


def _writes_to_count(guard: Guard, writes: int) -> int:
    """The versions a write through a SafeVariable adds itself: ``writes``, or 0 when an
    enclosing :func:`writes_counted_by_caller` of this thread counts that variable."""
    if not _open_frames[0]:
        return writes
    frames = getattr(_counting, "frames", None)
    if not frames:
        return writes
    for frame in frames:
        if guard in frame.guards:
            frame.written.add(guard)
            return 0
    return writes


@contextlib.contextmanager
def writes_counted_by_caller(guards: Iterable[Guard]) -> Iterator[set[Guard]]:
    """Inside, writes through the SafeVariables of ``guards`` are locked but not counted.

    For code that makes one logical update out of several writes and counts it itself:
    :class:`~safevars.SafeOptimizer` (one version per step, however many writes Keras
    makes), and :mod:`safevars.creator_scope` (one version per
    ``strategy.extended.update``, however many replica copies it writes).

    Args:
      guards: The guards whose writes the caller counts.

    Yields:
      The set of those guards written so far through a SafeVariable (filled as the
      writes happen); the caller adds their versions (``Guard.bump_eager`` eagerly,
      ``Guard.bump_graph`` while tracing).

    Thread safety: applies to the calling thread only (eager writes and writes traced
    by it). When contexts nest, the outermost one that names a guard counts it.

    Modes: eager and while tracing a ``tf.function``.
    """
    frame = _CountFrame(guards)
    frames = getattr(_counting, "frames", None)
    if frames is None:
        frames = _counting.frames = []
    with _open_frames_lock:
        _open_frames[0] += 1
    try:
        frames.append(frame)
        yield frame.written
    finally:
        if frame in frames:
            frames.remove(frame)
        with _open_frames_lock:
            _open_frames[0] -= 1
