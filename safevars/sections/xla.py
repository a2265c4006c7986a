"""What an XLA-compiled function records while it is traced: its locks and preparations.

XLA cannot compile mutex ops. A section traced inside a ``jit_compile=True`` function
therefore takes no lock itself: it records its locks on the function's graph (and on
every graph around it that is part of the same compiled function), and the locks are
taken around the compiled call (:mod:`safevars.sections.compiled_calls`). What XLA
cannot do inside (change a variable's shape: a ``GradientAccumulator`` growing its
buffer) is recorded the same way (:func:`record_xla_preparation`) and done under those
locks just before the call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.locking import SectionLock

__all__ = ["record_xla_preparation"]

_XLA_LOCKS = "_safevars_xla_locks"  # FuncGraph attribute: locks its compiled call needs.
# FuncGraph attribute: what its compiled call prepares under those locks before it runs,
# {key: [prepare, amount, what]} (see record_xla_preparation).
_XLA_PREPARATIONS = "_safevars_xla_preparations"


def _check_xla_strategy() -> None:
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() is False:
        strategy = tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            raise UnsupportedStrategyError(
                "A safevars write inside an XLA-compiled (jit_compile=True) function that "
                f"runs per replica of {type(strategy).__name__} is not supported: the lock "
                "is taken around the compiled call, and replicas waiting for each other "
                "inside it would deadlock. Use jit_compile=False under multi-replica "
                "strategies (Keras picks XLA only on a single device by default)."
            )


def _xla_graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every graph around it that is part of the same compiled function."""
    while graph is not None and tfi.in_xla_context(graph):
        yield graph
        outer = getattr(graph, "outer_graph", None)
        # TensorFlow marks a calling graph as an XLA context only while it builds the
        # call op of a compiled function; the calling graph is part of the compiled
        # function only if the graphs around it are XLA contexts too. (Recording on the
        # caller would make the caller take the locks around its own call, and then its
        # section around the compiled call would wait for them: measured, it hung.)
        if outer is None or getattr(outer, "outer_graph", None) is None:
            break
        if not tfi.in_xla_context(outer.outer_graph):
            break
        graph = outer


def _record_xla_locks(graph: Any, locks: Sequence[SectionLock]) -> None:
    """Notes ``locks`` on every graph from ``graph`` out to the compiled function's."""
    for g in _xla_graphs(graph):
        recorded = getattr(g, _XLA_LOCKS, None)
        if recorded is None:
            recorded = set()
            setattr(g, _XLA_LOCKS, recorded)
        recorded.update(locks)


def record_xla_preparation(
    key: Any, prepare: Callable[[int], Any], amount: int, what: str
) -> None:
    """Inside an XLA-compiled function being traced: ``prepare(total)`` is to run before
    every call of it, under the locks the call takes, with ``total`` the sum of the
    ``amount`` recorded for ``key`` (by this function and the compiled functions it
    calls).

    For state that XLA cannot change the shape of: a ``GradientAccumulator``'s row
    buffer grows there, before the compiled ``add`` that needs the rows. ``prepare``
    runs eagerly when the compiled function is called eagerly, and in the calling
    graph's section (its ops are returned; the call waits for them) otherwise.

    Raises:
      InvalidArgumentError: ``what`` (the call being traced) is inside a
        ``tf.while_loop`` of the compiled function: it runs a number of times known
        only when the loop does, so nothing can be prepared for it (XLA would drop the
        writes that do not fit). Nothing is recorded.
    """
    graphs = list(_xla_graphs(tfi.default_graph()))
    if any(tfi.is_loop_body(g) for g in graphs):
        raise InvalidArgumentError(
            f"{what} inside a loop (tf.while_loop, an AutoGraph loop, tf.map_fn) of an "
            "XLA-compiled function (jit_compile=True) is not supported: XLA cannot grow "
            "its storage during the call, and how many times the loop runs is known only "
            "when it does. Call the compiled function from the loop instead of looping "
            "inside it, or compile without XLA (jit_compile=False), or use "
            "deterministic=False."
        )
    for g in graphs:
        recorded = getattr(g, _XLA_PREPARATIONS, None)
        if recorded is None:
            recorded = {}
            setattr(g, _XLA_PREPARATIONS, recorded)
        entry = recorded.setdefault(key, [prepare, 0, what])
        entry[1] += amount


def _preparations_of(function: Any) -> dict[Any, list[Any]]:
    graph = getattr(function, "_func_graph", None)
    return getattr(graph, _XLA_PREPARATIONS, None) or {}


def _prepare(preparations: dict[Any, list[Any]]) -> list[Any]:
    """Runs the preparations of a compiled call (locks held); their ops in a graph."""
    ops = []
    for prepare, total, _ in preparations.values():
        done = prepare(total)
        if done is not None and not tf.executing_eagerly():
            ops.append(done)
    return ops


def _locks_of(function: Any) -> list[SectionLock]:
    graph = getattr(function, "_func_graph", None)
    locks = getattr(graph, _XLA_LOCKS, None)
    return sorted(locks, key=lambda lock: lock.order) if locks else []
