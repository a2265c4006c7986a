"""Walking a traced graph backwards, for structural tests of what waits for what."""

from __future__ import annotations

import tensorflow as tf


def ancestors(op: tf.Operation) -> set[tf.Operation]:
    """Every op ``op`` depends on, through data and control edges."""
    seen: set[tf.Operation] = set()
    stack = [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen
