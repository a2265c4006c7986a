"""What the exactly-once modules share: the key layout, the tokens, the locks, and this
process's :class:`~safevars.exactly_once.Tables` once :func:`~safevars.exactly_once.tables`
made it."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")

_SECTION_BITS = 20  # key = token << _SECTION_BITS | section id
_USER_TOKENS = 1 << (62 - _SECTION_BITS)  # Tokens below this are the caller's to choose.
_TOKENS = itertools.count(_USER_TOKENS)  # Drawn ones; next() is atomic in CPython.
_WATERMARK_KEY = -1  # The table entry holding the watermark (every other key is >= 0).
_LOCK = threading.Lock()
_FENCING = threading.Lock()  # Held by a checkpoint save: no new table or lock record then.
TABLES: Any = None  # This process's Tables, made by tables() (under _LOCK); None before.


def get_or_make(table: MutableMapping[K, V], key: K, make: Callable[[], V]) -> V:
    """``table[key]``, made by ``make()`` the first time (outside :data:`_LOCK`: two
    threads may both make one, and the first stored is the one both get)."""
    with _LOCK:
        found = table.get(key)
    if found is None:
        made = make()
        with _LOCK:
            found = table.setdefault(key, made)
    return found
