"""Keras' own update inside the section, and the versions it adds.

The optimizer's own ``apply`` (``super().apply``: Adam's, SGD's, ...) does the
arithmetic, bitwise as the plain optimizer. Around it:

* Keras' ``gradient_accumulation_steps=k`` (its running sum, in the optimizer's
  variables): whether this call is the one that updates is decided from ``iterations``
  before Keras' update runs, so the counters and versions agree with what Keras did.
* Under ``tf.distribute``, Keras' merge calls are made direct (the section already runs
  in cross-replica context; see ``strategies.py``).
* Each written variable's version goes up by exactly 1 per call (Keras' several writes
  are counted by the caller), unless an enclosing SafeOptimizer's section counts them.
  A call that writes every model variable counts them with one add on their joint
  counter (:mod:`safevars.locking.joint_versions`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars.locking import Guard, bump_eager_together, bump_graph_together
from safevars.optimizer.decisions import one, zero
from safevars.optimizer.locked_step import _nesting
from safevars.optimizer.runtime import OptimizerPart
from safevars.optimizer.strategies import direct_merge_calls
from safevars.variable import writes_counted_by_caller


class KerasUpdatePart(OptimizerPart):
    """SafeOptimizer's part that runs Keras' update and counts the versions."""

    def _safevars_keras_update(
        self,
        grads: list[Any],
        variables: list[Any],
        guards: list[Guard],
        strategy: tf.distribute.Strategy | None,
    ) -> tuple[Any, Any]:
        """Keras' own update, then 1 more on each written variable's version.

        Returns (applied, accumulated): (1, 0), or with Keras'
        ``gradient_accumulation_steps`` (1 on the calls that update, 1).
        """
        eager = tf.executing_eagerly()
        every = self.gradient_accumulation_steps
        update: Any = 1
        if every:
            if eager:
                update = int((int(self._iterations.numpy()) + 1) % every == 0)
            else:
                following = tf.cast(tf.convert_to_tensor(self._iterations), tf.int64) + 1
                update = tf.cast(tf.equal(following % every, 0), tf.int64)
        graph: Any = None if eager else tf.compat.v1.get_default_graph()
        existing: Any = None if eager else set(graph.get_operations())
        reads = [] if eager or not every else [update]
        slots = [s for g in guards for s in self._safevars.slots.get(g, ())]
        with (
            direct_merge_calls(strategy),
            tf.control_dependencies(reads),
            writes_counted_by_caller(guards + slots) as written,
        ):
            super().apply(grads, variables)
        guards = guards + [s for s in slots if s in written]
        result = (update, one()) if every else (one(), zero())
        if getattr(_nesting, "depth", 0) > 1:
            return result  # The enclosing SafeOptimizer's section counts the versions.
        if eager:
            if update:
                bump_eager_together(guards, 1)
            return result
        created = [op for op in graph.get_operations() if op not in existing]
        with tf.control_dependencies(created):
            written = tf.no_op(name="safevars_update_done")
        bump_graph_together(guards, written, update)
        return result
