"""How much of a traced training step runs under its lock: the whole step, from its reads.

A ``SafeOptimizer`` step traced in a ``tf.function`` is, by default, one critical section
from the forward pass's first read of the model's weights to the last write of the
update (``lock_span="step"``). :func:`plan` works out, once the gradients are traced and
the update is about to be, which ops of the function so far that section must wait for
and which reads it must gate:

* The section's ``MutexLock`` waits for every op traced before it that may wait for
  something outside the function or take other locks (another section's ops, a function
  call, control flow, a queue, an iterator, a collective, a Python function:
  :func:`safevars.sections.coarsening.may_wait_or_lock`): none of those runs while the lock is held,
  so the lock is never held while waiting for another thread, a peer or Python code that
  might want it (hold-and-wait).
* Every read of the step's variables traced after the last such op waits for the
  section's gate: the forward pass reads the weights inside the section, and the update
  then applies gradients of exactly the weights it updates. Reads traced earlier (before
  a call, a loop or another section) stay outside: such an op may depend on them, or be
  ordered after them by TensorFlow's automatic control dependencies (which order every
  later op after earlier ones, never the reverse), and gating them would make a cycle.
  So do reads traced later that such an op waits for all the same: those of writes that
  joined an earlier section (lock coarsening), which its release waits for.

The cost of a step is then the cost of the plain step plus taking the lock once (and the
joint version add): with the lock taken only after the last gradient
(``lock_span="update"``), the update ops cannot overlap the backward pass as they do in
the plain step, and the ``MutexLock``'s hand-off to the mutex's own thread adds to the
step's time instead of overlapping the forward pass (measured in one process: 1.246x
plain Adam with ``"update"``, 1.016x with ``"step"`` on a 52-variable model;
docs/history.md). The price is concurrency: two threads' traced steps on the same variables
no longer overlap their forward and backward passes, as compiled (XLA) steps never did.

:func:`opening` is the same rule without gating, for sections that have no reads to
span: a traced ``GradientAccumulator.add`` takes its lock at the start of its function
(``lock_span="step"`` there), so the ``MutexLock`` overlaps the gradient computation.

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
from safevars.sections.coarsening import may_wait_or_lock
from safevars.sections.gate import op_sources
from safevars.sections.tracing import _enclosing_sections

__all__ = ["READ_OPS", "Span", "opening", "plan"]

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
    if not _may_open_early(graph):
        return None
    handles = _handles_in(graph, variables)
    if not handles:
        return None
    ops = graph.get_operations()
    after, start = _blocking(ops)
    held = _waited_for(after)
    gated = tuple(
        op
        for op in ops[start:]
        if op.type in READ_OPS and op.inputs and id(op.inputs[0]) in handles and op not in held
    )
    if not gated:
        return None
    return Span(after, gated)


def opening(graph: Any) -> tuple[Any, ...] | None:
    """What a section traced next in ``graph`` may wait for instead of its inputs.

    A section waits for its inputs (the gradients, the value to write) before it takes
    its ``MutexLock``, so that computing them does not hold the lock; the ``MutexLock``
    then completes on the mutex's own thread after the last input, and its latency adds
    to the function's. Waiting only for the ops traced so far that may wait or take
    locks (:func:`safevars.sections.coarsening.may_wait_or_lock`) takes the
    lock as early as is safe: while the inputs are still being computed, so the
    ``MutexLock`` overlaps that work. The lock is then held while the inputs are
    computed (other threads' sections on it wait longer; their own computation does
    not wait).

    Returns:
      Those ops (possibly none), or None where the section must wait for its inputs:
      eagerly, under a ``tf.distribute`` strategy, inside another section or an
      XLA-compiled function.
    """
    if not _may_open_early(graph):
        return None
    return _blocking(graph.get_operations())[0]


def _may_open_early(graph: Any) -> bool:
    if tf.executing_eagerly() or tf.distribute.has_strategy():
        return False
    return not (tfi.in_xla_context(graph) or _enclosing_sections())


def _blocking(ops: Sequence[Any]) -> tuple[tuple[Any, ...], int]:
    """The ops of ``ops`` that may wait or take locks, and the index after the last."""
    after = []
    start = 0
    for index, op in enumerate(ops):
        if may_wait_or_lock(op):
            after.append(op)
            start = index + 1
    return tuple(after), start


def _waited_for(ops: Sequence[Any]) -> set[Any]:
    """Every op that one of ``ops`` waits for, directly or not.

    A section joined by later writes (lock coarsening,
    :mod:`safevars.sections.coarsening`) is released only after them: BatchNormalization's
    moving statistics, written in the forward pass of a custom step, join one section
    whose release then waits for the reads of every layer up to the last one's write,
    although those reads were traced after the release. Such a read must stay outside
    the step's section, which waits for that release (gating it was a cycle:
    MobileNetV2's custom step failed with "nodes in a cycle").
    """
    seen: set[Any] = set()
    stack = list(ops)
    while stack:
        for source in op_sources(stack.pop()):
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return seen


def _handles_in(graph: Any, variables: Sequence[Any]) -> set[int]:
    """ids of the tensors that carry ``variables``' handles inside ``graph``."""
    found = set()
    for variable in variables:
        handle = _handle(variable)
        internal = _captured(graph, handle) if handle is not None else None
        if internal is not None:
            found.add(id(internal))
    return found


def _captured(graph: Any, handle: Any) -> Any:
    """The placeholder of ``graph`` that carries the eager ``handle``, or None.

    A variable used in a ``tf.function`` is captured: its eager handle becomes a
    placeholder of the function's graph. A nested ``tf.function`` (Keras' train step
    inside its ``train_function``) captures the eager handle itself; a ``tf.cond`` branch
    or a loop body captures the enclosing graph's placeholder.
    """
    direct = tfi.captured_placeholder(graph, id(handle))
    if direct is not None:
        return direct
    outer = getattr(graph, "outer_graph", None)
    if outer is None or not hasattr(outer, "outer_graph"):
        return None
    through = _captured(outer, handle)
    return None if through is None else tfi.captured_placeholder(graph, id(through))


def _handle(variable: Any) -> Any:
    """The resource handle of a ``tf.Variable``, ``keras.Variable`` or SafeVariable."""
    handle = getattr(variable, "handle", None)
    if isinstance(handle, tf.Tensor) and handle.dtype == tf.resource:
        return handle
    return None
