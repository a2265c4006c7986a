"""Program order for graph writes: inside a traced transaction, a write waits for every
op traced before it.

:func:`program_order` is opened by :func:`safevars.transaction` around its ``fn`` while
tracing; :func:`_earlier_ops` is what a SafeVariable's graph write adds as control
dependencies, so a run-time failure stops every write that comes after it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

# Graphs in which a transaction's body is being traced: graph -> [index of the first op
# of the outermost such body, how many are open]. Keyed by graph, not by thread: under
# MirroredStrategy, replica threads trace into one graph and merge_call runs writes in
# yet another thread.
_ORDERED: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
_ORDERED_LOCK = threading.Lock()


@contextlib.contextmanager
def program_order() -> Iterator[None]:
    """While tracing, writes through SafeVariables wait for every op traced before them.

    :func:`safevars.transaction` traces its ``fn`` inside this, so a run-time failure
    (a ``tf.debugging`` assertion, a failing kernel) stops every write that comes after
    it in ``fn``: writes before it are made (a graph transaction does not roll back).

    Modes: a no-op eagerly, where Python runs ``fn`` in order anyway.
    """
    if tf.executing_eagerly():
        yield
        return
    graph = tf.compat.v1.get_default_graph()
    with _ORDERED_LOCK:
        entry = _ORDERED.get(graph)
        if entry is None:
            _ORDERED[graph] = entry = [len(graph.get_operations()), 0]
        entry[1] += 1
    try:
        yield
    finally:
        with _ORDERED_LOCK:
            entry[1] -= 1
            if not entry[1]:
                del _ORDERED[graph]


def _earlier_ops() -> list[Any]:
    """Ops of the current graph traced since the outermost :func:`program_order` began."""
    if not _ORDERED:
        return []
    graph = tf.compat.v1.get_default_graph()
    entry = _ORDERED.get(graph)
    return [] if entry is None else graph.get_operations()[entry[0] :]
