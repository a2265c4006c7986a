"""The sections this thread is tracing, and the hooks applied to their bodies.

A section traced inside another (in the same graph, or in a ``tf.cond``/``tf.while_loop``
body or nested ``tf.function`` inside it) runs inside the outer one's critical section,
so it must not take the locks the outer one holds. Each thread therefore keeps a stack
of the sections it is tracing (``_graph_held``: graph, locks, write ops), on a
``threading.local`` of its own; :func:`held_in_graph` and :func:`_enclosing_sections`
read it against the chain of graphs around the current one.

Body wrappers are the hook :mod:`safevars.exactly_once` registers (per thread with
:func:`body_wrappers`, per graph with :func:`graph_body_wrappers`): each section's body
is passed through them before it is traced.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.locking import Guard, SectionLock

__all__ = ["body_wrappers", "graph_body_wrappers", "graph_inputs", "held_in_graph"]

_local = threading.local()  # Per thread: graph_held and body_wrappers.


def _graph_held() -> list[tuple[Any, frozenset[SectionLock], list[Any]]]:
    """Stack of (graph, locks, write-ops) for sections being traced by this thread."""
    try:
        return _local.graph_held
    except AttributeError:
        _local.graph_held = []
        return _local.graph_held


def body_wrappers() -> list[tuple[Any, Callable[..., Any]]]:
    """Stack of (graph, wrapper) applied to the body of sections traced in ``graph``.

    A wrapper is called as ``wrapper(locks, fn)`` inside the section (the locks taken)
    and returns the function to trace instead of ``fn``; :mod:`safevars.exactly_once`
    uses it to skip a section whose update was already applied. Innermost last.
    """
    try:
        return _local.body_wrappers
    except AttributeError:
        _local.body_wrappers = []
        return _local.body_wrappers


# Graph -> wrapper, for sections traced in that graph (or a graph nested in it) by ANY
# thread: MirroredStrategy (and ParameterServerStrategy's strategy.run) trace replica
# functions in threads of their own, which a thread-local stack does not reach.
_GRAPH_WRAPPERS: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()


def graph_body_wrappers() -> weakref.WeakKeyDictionary[Any, Callable[..., Any]]:
    """Graph -> wrapper applied, as :func:`body_wrappers`, in every thread tracing into it."""
    return _GRAPH_WRAPPERS


def _graph_chain() -> list[Any]:
    """The current graph and every graph enclosing it, innermost first."""
    chain = []
    g = tfi.default_graph()
    while g is not None:
        chain.append(g)
        g = getattr(g, "outer_graph", None)
    return chain


def _wrapped_body(locks: list[SectionLock], fn: Callable[[], Any]) -> Callable[[], Any]:
    stack = body_wrappers()
    if not stack and not _GRAPH_WRAPPERS:
        return fn
    chain = _graph_chain()
    for graph, wrapper in stack:
        if any(graph is c for c in chain):
            fn = wrapper(locks, fn)
    for graph in reversed(chain):  # outermost first, as the stack is
        graph_wrapper = _GRAPH_WRAPPERS.get(graph)
        if graph_wrapper is not None:
            fn = graph_wrapper(locks, fn)
    return fn


def graph_inputs(after: Any) -> list[Any]:
    """The tensors and ops of ``after`` (any nest, composites included): what a section
    waits for, or its body's writes wait for."""
    return [
        x
        for x in tf.nest.flatten(after, expand_composites=True)
        if isinstance(x, (tf.Tensor, tf.Operation))
    ]


def held_in_graph(guard: Guard) -> list[Any] | None:
    """The write-op list of the section being traced that holds ``guard``'s lock, if any.

    A write traced inside ``safevars.transaction`` (in the transaction's own graph or a
    ``tf.cond``/``tf.while_loop`` body nested in it) runs inside the transaction's
    critical section, so it must not lock again.
    """
    lock = guard.lock
    for locks, writes in _enclosing_sections():
        if lock in locks:
            return writes
    return None


def _enclosing_sections() -> list[tuple[frozenset[SectionLock], list[Any]]]:
    """(locks, write-op list) of the sections being traced around the current graph.

    Innermost first: sections traced in this graph or in a graph enclosing it (a
    ``tf.cond``/``tf.while_loop`` body, a nested ``tf.function``).
    """
    stack = _graph_held()
    if not stack:
        return []
    chain = _graph_chain()
    return [
        (locks, writes)
        for txn_graph, locks, writes in reversed(stack)
        if any(txn_graph is c for c in chain)
    ]
