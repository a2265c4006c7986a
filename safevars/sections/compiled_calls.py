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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.locking import hold_locks
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
        if tfi.executing_eagerly():
            check_not_held(self)  # its graph would wait on a lock this thread holds
        else:
            current_graph_records(graph_locks(self))  # the caller's graph takes them too
        locks = _locks_of(self)
        if not locks:
            return original(self, tensor_inputs, captured_inputs)
        preparations = _preparations_of(self)
        if tf.executing_eagerly():
            with hold_locks(locks):
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

    call_flat.__wrapped__ = original  # type: ignore[attr-defined]
    call_flat._safevars_xla = True  # type: ignore[attr-defined]
    return call_flat


def install() -> None:
    """Installs the compiled-call wrapper once (idempotent)."""
    current = tfi.ConcreteFunction.__dict__["_call_flat"]
    if not getattr(current, "_safevars_xla", False):
        tfi.ConcreteFunction._call_flat = _call_flat_under_locks(current)


install()
