"""The global lock order, and the check that keeps every thread inside it.

Locks are ordered by creation (:attr:`SectionLock.order`, drawn from
``section_lock._ORDER``).
Sections that name several locks take them in that order (:func:`sorted_locks`), which
rules out deadlock. A thread that holds some locks may take more only in increasing
order: :func:`_check_order` raises :class:`~safevars.LockOrderError` otherwise, *before*
any lock is taken. A lock that :func:`~safevars.locking.share_lock` merges others into
keeps the earliest place among them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from safevars.errors import LockOrderError
from safevars.locking.ownership import _holding

if TYPE_CHECKING:
    from safevars.locking.section_lock import SectionLock


class HasLock(Protocol):
    """Anything with a lock (a :class:`~safevars.locking.Guard`): what is sorted."""

    @property
    def lock(self) -> SectionLock:
        """The lock it is protected by."""


def _check_order(held: list[SectionLock], first_new: SectionLock, me: threading.Thread) -> None:
    """Raises unless ``first_new`` sorts after every lock the thread holds."""
    held[:] = [lock for lock in held if _holding(lock, me)]
    if not held:
        return
    top = max(held, key=lambda lock: lock.order)
    if first_new.order < top.order:
        raise LockOrderError(
            f"This thread holds the lock of {top.name!r} and tried to take the lock of "
            f"{first_new.name!r}, which comes earlier in safevars' global lock order; "
            "that could deadlock. Name every variable up front: "
            "safevars.locked(a, b, ...) or safevars.transaction([a, b, ...], fn)."
        )


def sorted_locks(guards: Iterable[HasLock]) -> list[SectionLock]:
    """The distinct locks of ``guards``, in the global order."""
    return sorted({id(g.lock): g.lock for g in guards}.values(), key=lambda lock: lock.order)
