"""Traced graphs die with their functions: safevars keeps no traced graph alive.

safevars records per-graph state while tracing (the open section lock coarsening may
join, dependency memos, program order, wrappers). State keyed by graph in a
``WeakKeyDictionary`` whose value holds the graph's ops keeps the graph alive for good:
one leaked ``FuncGraph`` (and every op and constant in it) per trace, which a training
job that retraces (new shapes, new Keras train functions) pays in memory forever. Each
test traces a function using one feature, drops it, collects, and checks that the graph
is gone.

Not covered: ``SafeOptimizer``. Keras' own optimizer keeps the graphs of a
``tf.function`` calling ``apply_gradients`` alive (plain ``Adam``: 3 of 3 here), so the
measurement cannot tell a safevars leak from Keras' references there.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import tensorflow as tf

import safevars


def _graphs_alive(make: Callable[[], Callable[[], Any]], traces: int = 3) -> int:
    """Traces ``make()``'s function ``traces`` times (a new function each time), runs it,
    drops it, and returns how many of the traced graphs are still alive."""
    refs = []
    for _ in range(traces):
        function = tf.function(make(), autograph=False)
        concrete = function.get_concrete_function()
        concrete()
        refs.append(weakref.ref(concrete.graph))
        del function, concrete
    gc.collect()
    return sum(ref() is not None for ref in refs)


def _writes() -> Callable[[], Any]:
    v = safevars.SafeVariable(1.0)

    def body() -> Any:
        v.assign_add(1.0, read_value=False)  # two sections on one lock: they join
        v.assign_add(2.0, read_value=False)
        return v.read_value()

    return body


def _update_and_snapshot() -> Callable[[], Any]:
    a, b = safevars.SafeVariable(1.0), safevars.SafeVariable(2.0)

    def body() -> Any:
        a.update(lambda x: x + 1.0)
        first, second = safevars.snapshot([a, b])
        return first.value + second.value

    return body


def _transaction() -> Callable[[], Any]:
    a, b = safevars.SafeVariable(1.0), safevars.SafeVariable(2.0)

    def body() -> Any:
        def move() -> None:
            a.assign_sub(1.0)
            b.assign_add(1.0)

        safevars.transaction([a, b], move)
        return a.read_value()

    return body


def _accumulator() -> Callable[[], Any]:
    v = safevars.SafeVariable(tf.zeros([3]))
    acc = safevars.GradientAccumulator([v])

    def body() -> Any:
        acc.add([tf.ones([3])])
        return acc.take()[0]

    return body


@pytest.mark.parametrize(
    "make",
    [_writes, _update_and_snapshot, _transaction, _accumulator],
    ids=["coarsened-writes", "update-and-snapshot", "transaction", "accumulator"],
)
def test_traced_graphs_are_freed(make: Callable[[], Callable[[], Any]]) -> None:
    assert _graphs_alive(make) == 0


def test_a_plain_function_is_freed_too() -> None:
    """The measurement itself: a plain tf.Variable function's graphs are freed."""
    v = tf.Variable(1.0)

    def make() -> Callable[[], Any]:
        return lambda: v.assign_add(1.0)

    assert _graphs_alive(make) == 0
