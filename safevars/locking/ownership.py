"""Who holds a lock: the holder record, each thread's held list, where a lock was taken.

A :class:`~safevars.locking.section_lock.SectionLock` is held by a ``threading.Thread``
object (``lock._slot == [thread]`` while held), never by a thread identifier, so a new
thread that reuses an ended thread's identifier is a different holder. Only the holder
empties the slot, so another thread reads it once (``me in slot``,
:func:`~safevars.locking.section_lock.holder_of`):
a check and then an index could see it full, then empty. Each thread keeps
the locks it may hold eagerly in a thread-local list (:func:`_held`), pruned lazily by
the lock order check (:mod:`safevars.locking.lock_order`). Graph sections keep their
own per-thread stacks (:mod:`safevars.sections.tracing`).
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

    from safevars.locking.section_lock import SectionLock


_local = threading.local()
_PACKAGE = __name__.split(".", 1)[0] + "."  # "safevars.": frames of any safevars module
_current_thread = threading.current_thread


def _held() -> list[SectionLock]:
    """Locks the calling thread may hold eagerly, in acquisition order.

    Entries are pruned lazily: a lock counts as held only while its holder is the
    calling thread (:func:`_holding`), so a lock released by another thread (a kept
    ``locked`` context closed elsewhere) never confuses the order check.
    """
    try:
        return _local.held
    except AttributeError:
        _local.held = []
        return _local.held


def _holding(lock: SectionLock, me: threading.Thread) -> bool:
    # One read of the slot: ``slot and slot[0] is me`` reads it twice, and the holder
    # (another thread) can empty it in between, raising IndexError.
    return me in lock._slot


def _caller_location() -> str:
    """``file:line`` of the innermost frame outside safevars (where a lock was taken)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"
