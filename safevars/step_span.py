"""How much of a traced training step runs under its lock: the whole step, from its reads.

A ``SafeOptimizer`` step traced in a ``tf.function`` is, by default, one critical section
from the forward pass's first read of the model's weights to the last write of the
update (``lock_span="step"``). :func:`plan` works out, once the gradients are traced and
the update is about to be, which ops of the function so far that section must wait for
and which reads it must gate:

* The section's ``MutexLock`` waits for every op traced before it that may wait for
  something outside the function or take other locks (another section's ops, a function
  call, control flow, a queue, an iterator, a collective, a Python function:
  :data:`safevars.lock_coarsening.MAY_WAIT`): none of those runs while the lock is held,
  so the lock is never held while waiting for another thread, a peer or Python code that
  might want it (hold-and-wait).
* Every read of the step's variables traced after the last such op waits for the
  section's gate: the forward pass reads the weights inside the section, and the update
  then applies gradients of exactly the weights it updates. Reads traced earlier (before
  a call, a loop or another section that they may feed) stay outside: gating one of them
  could make a cycle through the op it feeds.

The cost of a step is then the cost of the plain step plus taking the lock once (and the
joint version add): with the lock taken only after the last gradient
(``lock_span="update"``), the update ops cannot overlap the backward pass as they do in
the plain step (measured: 1.15x vs 1.04x plain Adam on a 52-variable model, README
"Results"). The price is concurrency: two threads' traced steps on the same variables
no longer overlap their forward and backward passes, as compiled (XLA) steps never did.

:func:`plan` returns None (the lock is then taken after the last gradient, as with
``"update"``) under a ``tf.distribute`` strategy (replicas trace into one graph from
threads of their own, and the section runs in cross-replica context), inside another
section or an XLA-compiled function (whose whole call already runs under the locks),
and when no read of the step's variables can be gated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars import lock_coarsening
from safevars.sections import _enclosing_sections

__all__ = ["READ_OPS", "Span", "plan"]

# Ops that read a resource variable's value (dense reads and gathers).
READ_OPS = frozenset(("ReadVariableOp", "ResourceGather", "ResourceGatherNd"))


@dataclasses.dataclass(frozen=True)
class Span:
    """What a step's section waits for and what waits for it.

    Attributes:
      after: The ops traced so far that may wait or take locks; the ``MutexLock`` runs
        after all of them.
      gated: The reads of the step's variables that wait for the section's gate.
    """

    after: tuple[Any, ...]
    gated: tuple[Any, ...]


def plan(graph: Any, variables: Sequence[Any]) -> Span | None:
    """The span of a step over ``variables`` traced next in ``graph``, or None.

    Args:
      graph: The graph the step's section is about to be traced in.
      variables: The variables the step updates (``tf.Variable``, ``keras.Variable`` or
        SafeVariable); their reads in ``graph`` are gated.

    Returns:
      The :class:`Span`, or None when the lock should be taken after the gradients
      (see the module docstring).
    """
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return None
    if tfi.in_xla_context(graph) or _enclosing_sections():
        return None
    handles = _handles_in(graph, variables)
    if not handles:
        return None
    ops = graph.get_operations()
    start = 0
    after = []
    for index, op in enumerate(ops):
        if op.type in lock_coarsening.SECTION_OPS or op.type in lock_coarsening.MAY_WAIT:
            after.append(op)
            start = index + 1
    gated = tuple(
        op
        for op in ops[start:]
        if op.type in READ_OPS and op.inputs and id(op.inputs[0]) in handles
    )
    if not gated:
        return None
    return Span(tuple(after), gated)


def _handles_in(graph: Any, variables: Sequence[Any]) -> set[int]:
    """ids of the tensors that carry ``variables``' handles inside ``graph``.

    A variable used in a ``tf.function`` is captured: its eager handle becomes a
    placeholder of the function's graph, and of each graph nested in it (a ``tf.cond``
    branch, a loop body) in turn.
    """
    chain = []
    current = graph
    while current is not None and hasattr(current, "outer_graph"):
        chain.append(current)
        current = current.outer_graph
    found = set()
    for variable in variables:
        handle = _handle(variable)
        for nested in reversed(chain):  # outermost first
            if handle is None:
                break
            handle = tfi.captured_placeholder(nested, handle)
        if handle is not None:
            found.add(id(handle))
    return found


def _handle(variable: Any) -> Any:
    """The resource handle of a ``tf.Variable``, ``keras.Variable`` or SafeVariable."""
    handle = getattr(variable, "handle", None)
    if isinstance(handle, tf.Tensor) and handle.dtype == tf.resource:
        return handle
    return None
