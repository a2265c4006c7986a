"""The call wrapper: an XLA-compiled function runs under the locks it recorded, and no
function is called eagerly by a thread that holds a lock its graph takes.

``ConcreteFunction._call_flat`` is wrapped once (:func:`install`, at import of
:mod:`safevars.sections`): a function whose graph recorded locks
(:mod:`safevars.sections.xla`) is called eagerly while holding those locks (and their
mutexes), and inside another ``tf.function`` as the body of a section
(:func:`~safevars.sections.section.lock_section`); its preparations run first, under
the same locks. A call nested in a bigger compiled function records its locks on that
one instead. Every eager call is first checked against the locks the calling thread
holds, and a call traced into another function adds the callee's locks to the caller's
graph (:mod:`safevars.sections.reentry`).

An eager call of a function whose graph takes some locks' mutexes is counted on each of
them while it runs (``lock.graph_calls``, :func:`~safevars.locking.acquisition.admit_call`,
which first waits for an eager section over the lock): eager sections take a lock's
mutex only while such a call runs. A call on an asynchronous executor returns before its
graph has run, and a function called while tracing a ``tf.data`` transformation runs on
tf.data's threads: their locks are marked ``untracked`` (every eager section takes the
mutex).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import locking
from safevars.locking import hold_locks
from safevars.locking.acquisition import admit_call, mark_untracked
from safevars.sections.reentry import check_not_held, current_graph_records, graph_locks
from safevars.sections.section import lock_section
from safevars.sections.xla import (
    _locks_of,
    _preparations_of,
    _prepare,
    _record_xla_locks,
    record_xla_preparation,
)

__all__ = ["install"]


def _call_flat_under_locks(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``ConcreteFunction._call_flat``: an XLA function runs under its locks."""

    def call_flat(self: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        taken = graph_locks(self)
        if tfi.executing_eagerly():
            if taken:
                check_not_held(self, taken)  # its graph would wait on a lock this thread holds
                return _counted_call(taken, self, tensor_inputs, captured_inputs, original)
        else:
            current_graph_records(taken)  # the caller's graph takes them too
            tracked = [lock for lock in taken if not lock.untracked]
            if tracked and tfi.graph_runs_outside_python_calls():  # (walks the stack)
                mark_untracked(tracked)
        return _call(self, tensor_inputs, captured_inputs, original)

    call_flat.__wrapped__ = original  # type: ignore[attr-defined]
    call_flat._safevars_xla = True  # type: ignore[attr-defined]
    return call_flat


def _counted_call(
    taken: frozenset[Any],
    function: Any,
    tensor_inputs: Any,
    captured_inputs: Any,
    original: Callable[..., Any],
) -> Any:
    """An eager call of a function whose graph takes ``taken``'s mutexes, counted in
    each lock's ``graph_calls`` while it runs (eager sections take the mutex meanwhile:
    :func:`~safevars.locking.acquisition.admit_call`). On an asynchronous executor the
    call returns before its graph has run: the locks are marked ``untracked`` instead."""
    if tfi.executor_is_async():
        mark_untracked(taken)
        return _call(function, tensor_inputs, captured_inputs, original)
    me = locking._current_thread()
    token = object()
    admitted: list[Any] = []
    try:
        for lock in taken:
            admitted.append(lock)  # (before: a call interrupted in admit_call is undone)
            admit_call(lock, me, token)
        return _call(function, tensor_inputs, captured_inputs, original)
    finally:
        for lock in admitted:
            try:
                lock.graph_calls.remove(token)
            except ValueError:
                pass


def _call(
    self: Any, tensor_inputs: Any, captured_inputs: Any, original: Callable[..., Any]
) -> Any:
    """The call itself; an XLA function's under the locks it recorded."""
    locks = _locks_of(self)
    if not locks:
        return original(self, tensor_inputs, captured_inputs)
    preparations = _preparations_of(self)
    if tf.executing_eagerly():
        with hold_locks(locks, _where(self)):
            _prepare(preparations)
            return original(self, tensor_inputs, captured_inputs)
    graph = tfi.default_graph()
    # TensorFlow marks the calling graph as an XLA context while it builds the call
    # op of a compiled function; the call is nested in a bigger compiled function
    # only if the graphs around the calling one are XLA contexts too.
    if tfi.in_xla_context(getattr(graph, "outer_graph", None) or graph):
        _record_xla_locks(graph, locks)
        for key, (prepare, amount, what) in preparations.items():
            record_xla_preparation(key, prepare, amount, what)
        return original(self, tensor_inputs, captured_inputs)

    def prepared_call() -> Any:
        with tf.control_dependencies(_prepare(preparations)):
            return original(self, tensor_inputs, captured_inputs)

    return lock_section(locks, prepared_call, tensor_inputs, compiled_call=True)


_WHERE = "_safevars_where"


def _where(function: Any) -> str:
    """What holds the locks of an eager call of compiled ``function``, as
    ``held_locks()`` reports it: the function's name (the line that called safevars is
    inside TensorFlow's ``tf.function`` machinery, and finding the caller's line takes a
    walk up the stack that cost about 10 µs between two calls of a small compiled step:
    see docs/history.md, 2026-12-01). Kept on the function's graph."""
    graph = function._func_graph
    where = getattr(graph, _WHERE, None)
    if where is None:
        where = f"tf.function {graph.name!r} (XLA-compiled), called eagerly"
        setattr(graph, _WHERE, where)
    return where


def install() -> None:
    """Installs the compiled-call wrapper once (idempotent)."""
    current = tfi.ConcreteFunction.__dict__["_call_flat"]
    if not getattr(current, "_safevars_xla", False):
        tfi.ConcreteFunction._call_flat = _call_flat_under_locks(current)


install()
