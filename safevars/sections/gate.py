"""What the ops of a traced section wait for: its last ``MutexLock``, or a gate behind it.

Every op of a section body must run after the section's last ``MutexLock``. The body is
traced under a control dependency on it, which TensorFlow adds to every op with no data
input made in that scope (a ``Const``, a read, a write of a value made before); the
others wait for it through their inputs. Such an op is a *root* when nothing else of the
section holds it back: a write of a variable also waits for the previous write of it
(:mod:`safevars.variable.write_order`), so eight joined writes have one root, the first.

A ``MutexLock`` completes on the mutex's own thread, and TensorFlow's executor then hands
each op that completion makes ready to its thread pool as a task of its own (an async
kernel's successors are not run inline). A section with many roots (a whole optimizer
step: hundreds of update ops) therefore opens through a *gate*: one look-up of the lock's
gate variable (``VarIsInitializedOp``, which reads no value) after the ``MutexLock``,
which the roots wait for instead. Only the gate is handed over, and it releases the body
inline. Without the gate, waiting on the lock directly cost about 0.2-0.4 ms per step
(measured: a 52-variable Adam step, one core; within the noise with two). The look-up is
stateful, so Grappler does not fold it away (a ``NoOp``, ``Identity`` or ``Const`` gate
was removed: measured), and nothing else uses the variable, so automatic control
dependencies order it after no other op.

A section with at most :data:`DIRECT_ROOTS` roots waits for the ``MutexLock`` directly:
the gate is one more op and one more captured resource per call, which small sections pay
for in full. A/B in one process against the same functions traced with the gate (eight
ops per call, 2 instances each, 30 rotated rounds, 2026-11-27), in x plain
``tf.Variable``: scalar ``assign`` 1.194 -> 1.153, scalar ``assign_add`` 1.309 -> 1.265
and 1.399 -> 1.322 (two processes), ``assign`` of 1K elements 1.176 -> 1.151; ``update``
(a read, an add, a write: two roots, each handed over by the lock now) 1.274 -> 1.275
scalar and 1.268 -> 1.261 for 1K: no gain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import tensorflow as tf

from safevars.locking import SectionLock

__all__ = ["DIRECT_ROOTS", "Ungated", "narrow", "op_sources", "open_gate", "stateful"]

DIRECT_ROOTS = 2  # A section with more roots than this opens through a gate.


def open_gate(lock: SectionLock, opener: tf.Tensor) -> tf.Tensor:
    """The gate of a section whose last ``MutexLock`` is ``opener`` (on ``lock``)."""
    with tf.control_dependencies([opener]):
        return tf.raw_ops.VarIsInitializedOp(resource=lock.gate.handle)


def narrow(gate: Any, ops: Sequence[Any]) -> None:
    """Leaves ``gate``'s control edge only where the section's state needs it.

    ``ops`` were just traced into a section (in the order they were made) under a control
    dependency on ``gate`` (an op: the last ``MutexLock`` or a gate op), which TensorFlow
    adds to every op with no input made in that scope: a ``Const``, an op of the
    function's inputs, as well as the reads. Only the ops that touch state must run
    inside the section: every stateful op (a read, a write, a random op, a call) waits
    for ``gate``, directly or through an input that does. A stateless op keeps no edge
    of its own, so Grappler sees it as in the same function without safevars: a
    ``Const`` with a control input is not a plain constant to its rewrites (the
    arithmetic optimizer's ``Mul(x, 1)`` removal, then the remapper's fused kernels such
    as ``_MklSwish`` or ``_FusedConv2D`` with an activation did not apply, and the step
    computed other bits). A stateless op may then run before the lock is taken; the
    release still waits for it (the section waits for every op it created).

    A stateful op that waited for ``gate`` only through such an op (a write of a
    constant) gets the edge directly.
    """
    waiting: set[Any] = set()
    for op in ops:
        direct = gate in op.control_inputs
        if direct and not op._is_stateful:
            others = [c for c in op.control_inputs if c is not gate]
            op._remove_all_control_inputs()
            op._add_control_inputs(others)
            direct = False
        if direct or any(s in waiting for s in op_sources(op)):
            waiting.add(op)
        elif op._is_stateful:
            op._add_control_inputs([gate])
            waiting.add(op)


def stateful(ops: Iterable[Any]) -> list[Any]:
    """The ops of ``ops`` a section's release waits for: the stateful ones.

    A stateless op computes on values (a read returns a value that later writes do not
    change: TensorFlow copies a variable's buffer on write while a read of it is in use),
    so it may run after the release. A control edge from each op would mark every op
    of the body as driving a control dependency, which Grappler's arithmetic optimizer
    does not rewrite (its ``AddOpsRewrite`` stage, which turns a tree of ``Add`` into an
    ``AddN``, skips such nodes: the gradient sums of a residual block were then added in
    another order).
    """
    return [op for op in ops if op._is_stateful]


def op_sources(op: Any) -> Iterable[Any]:
    """The ops ``op`` waits for: those of its inputs, then its control inputs."""
    yield from (t.op for t in op.inputs)
    yield from op.control_inputs


class Ungated:
    """A section whose ops wait for its last ``MutexLock`` directly, while it has at most
    :data:`DIRECT_ROOTS` roots.

    Attributes:
      lock: The section's last lock (whose gate variable a gate reads).
      opener: Its ``MutexLock``.
      direct: The section's ops with ``opener`` as a control input.
      waiting: The section's ops that wait for ``opener``, directly or through an input.
    """

    def __init__(self, lock: SectionLock, opener: tf.Tensor) -> None:
        self.lock = lock
        self.opener = opener
        self.direct: list[Any] = []
        self.waiting: set[Any] = set()

    def add(self, ops: Sequence[Any]) -> tf.Tensor:
        """Takes in ``ops``, just traced into the section (in the order they were made).

        Returns:
          What the section's ops wait for from now on: ``opener``, or a new gate if more
          than :data:`DIRECT_ROOTS` ops would now be made ready by ``opener``. A root
          is an op of ``direct`` with no other input (data or control) in ``waiting``:
          an op that also waits for another op of the section is not made ready by the
          lock. (Inputs made while the body was traced that wait for nothing, such as
          the placeholders of captured variables, do not hold an op back.) With a new
          gate, every op of ``direct`` waits for it instead of ``opener``.
        """
        lock_op = self.opener.op
        for op in ops:
            if lock_op in op.control_inputs:
                self.direct.append(op)
                self.waiting.add(op)
            elif any(s in self.waiting for s in op_sources(op)):
                self.waiting.add(op)
        roots = [
            op
            for op in self.direct
            if not any(s in self.waiting for s in op_sources(op) if s is not lock_op)
        ]
        if len(roots) <= DIRECT_ROOTS:
            return self.opener
        gate = open_gate(self.lock, self.opener)
        for op in self.direct:
            others = [c for c in op.control_inputs if c is not lock_op]
            op._remove_all_control_inputs()
            op._add_control_inputs([*others, gate.op])
        return gate
