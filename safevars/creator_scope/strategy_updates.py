"""``tf.distribute.StrategyExtended.update`` of a SafeVariable: one section, one version.

Keras' optimizers write each variable through ``strategy.extended.update(var, fn)``, with
or without a strategy, and under ``MirroredStrategy`` ``fn`` writes each replica's copy
directly. On a SafeVariable the patched method runs ``fn`` as one critical section over
the variable and its slots and counts one version per variable it wrote, however many
replica copies ``fn`` touched. Inside a step that is one section already (a
:class:`~safevars.SafeOptimizer` step, a plain optimizer's step in the scope), the locks
are held and the step counts the versions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from safevars.creator_scope.slots import slots_of
from safevars.locking import Guard, hold
from safevars.sections import graph_section
from safevars.variable import _writes_to_count, writes_counted_by_caller

__all__ = ["cross_replica", "locked_update", "update_under_lock"]


def cross_replica() -> bool:
    """Whether an update runs here, not through a ``merge_call`` of the strategy."""
    return not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context()


def locked_update(guards: Sequence[Guard], call: Callable[[], Any]) -> Any:
    """Runs ``call()`` (one logical update of ``guards[0]``'s variable) as one critical
    section over ``guards`` and counts one version per variable it wrote.

    ``guards[0]`` (the updated variable, whose replica copies ``call`` may write
    directly) is counted always; each other guard if ``call`` wrote it through its
    SafeVariable. A guard that an enclosing :func:`~safevars.variable.
    writes_counted_by_caller` counts (a :class:`~safevars.SafeOptimizer` step) is left
    to it.

    Thread safety: atomic with respect to every safevars operation on the variables.

    Modes: eagerly under the locks; in a ``tf.function`` inside their mutexes, the
    versions added once every op ``call`` created has run.
    """
    guards = list(guards)

    def counts(written: set[Guard]) -> list[tuple[Guard, int]]:
        named = [guards[0], *(g for g in guards[1:] if g in written)]
        return [(g, n) for g in named if (n := _writes_to_count(g, 1))]

    if tf.executing_eagerly():
        with hold(guards):
            with writes_counted_by_caller(guards) as written:
                result = call()
            for guard, n in counts(written):
                guard.bump_eager(n)
        return result

    def body() -> Any:
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with writes_counted_by_caller(guards) as written:
            result = call()
        pending = counts(written)
        if pending:  # none inside a step that counts them itself
            with tf.control_dependencies(graph.get_operations()[first:]):
                done = tf.no_op(name="safevars_update_done")
            for guard, n in pending:
                guard.bump_graph(done, n)
        return result

    return graph_section(guards, body)


def update_under_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``tf.distribute.StrategyExtended.update`` for SafeVariables."""

    def update(
        self: Any,
        var: Any,
        fn: Callable[..., Any],
        args: Any = (),
        kwargs: Any = None,
        group: bool = True,
    ) -> Any:
        guard = getattr(var, "_self_guard", None)
        if not isinstance(guard, Guard) or not cross_replica():
            return original(self, var, fn, args, kwargs, group)
        return locked_update(
            [guard, *slots_of(guard)], lambda: original(self, var, fn, args, kwargs, group)
        )

    update.__wrapped__ = original  # type: ignore[attr-defined]
    update._safevars = True  # type: ignore[attr-defined]
    return update
