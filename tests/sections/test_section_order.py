"""Sections traced one after another in a graph take their locks one after another, as
they would eagerly: a section takes its first lock only once the section before it in
the same graph has released its own.

Without that order a graph held the locks of its second section while its first waited
for a lock (TensorFlow's automatic control dependencies make the second release wait for
the first): ``c.update(f)`` then ``transaction([a, b], g)`` held ``a`` and ``b`` while
waiting for ``c``, and deadlocked against anyone taking ``c`` then ``a`` in the global
order. It was found as a hang of an exactly-once checkpoint (whose fence takes every
lock in order) while parameter-server steps ran, about one run in eight. The first
section of a ``tf.cond`` branch or a ``tf.while_loop`` body waits for the section before
the ``If`` or ``While`` op too.
"""

from __future__ import annotations

import threading
import time

import pytest
import tensorflow as tf

import safevars
from tests.support.deadlines import scaled
from tests.support.graph_walk import ancestors
from tests.support.threading_harness import call_bounded

WHERE = ("graph", "cond", "while_loop")  # where the second section is traced


def _variables_and_step(where: str = "graph"):
    c, a, b = (safevars.SafeVariable(x) for x in (0.0, 100.0, 0.0))  # global order c, a, b

    def move():
        a.assign_sub(1.0)
        b.assign_add(1.0)

    def second() -> tf.Tensor:
        safevars.transaction([a, b], move)
        return tf.constant(0)

    @tf.function(autograph=False)
    def step():
        c.update(lambda x: x + 1.0)
        if where == "graph":
            second()
        elif where == "cond":
            tf.cond(tf.constant(True), second, lambda: tf.constant(0))
        else:
            tf.while_loop(lambda i: i < 1, lambda i: (i + 1 + second(),), (tf.constant(0),))

    return c, a, b, step


def test_the_second_section_of_a_graph_takes_its_locks_after_the_first_releases():
    c, a, b, step = _variables_and_step()
    graph = step.get_concrete_function().graph
    ops = graph.get_operations()
    locks = [op for op in ops if op.type == "MutexLock"]
    releases = [op for op in ops if op.type == "ConsumeMutexLock"]
    assert len(locks) == 3 and len(releases) == 3, [op.type for op in ops]
    first_release = releases[0]
    assert locks[0] in ancestors(first_release)  # the update's own section
    for lock in locks[1:]:  # the transaction's two locks
        assert first_release in ancestors(lock), lock.name


@pytest.mark.parametrize("op_type", ["If", "While"])
def test_a_branch_s_first_section_waits_for_the_release_before_its_cond_or_loop(op_type):
    """The branch's sections are in a graph of their own: the ``If`` or ``While`` op that
    runs it waits for the release of the section traced before it (a control capture)."""
    c, a, b, step = _variables_and_step("cond" if op_type == "If" else "while_loop")
    ops = step.get_concrete_function().graph.get_operations()
    (release,) = [op for op in ops if op.type == "ConsumeMutexLock"]
    (branch,) = [op for op in ops if op.type in (op_type, f"Stateless{op_type}")]
    assert release in ancestors(branch)


@pytest.mark.parametrize("where", WHERE)
def test_a_graph_never_holds_a_later_section_s_locks_while_it_waits_for_an_earlier_one(where):
    """One thread holds ``c`` eagerly while the graph runs, then takes ``a`` (the global
    order): it must get it, so the graph's transaction has not taken ``a`` while its
    update waited for ``c``. (Without the edge, the plain graph deadlocks; a branch's
    release is not chained to the section before the branch, so a cond or loop did not,
    but the order checked above keeps them in program order too.)"""
    c, a, b, step = _variables_and_step(where)
    step()  # traced and run: run-time mode, eager sections take the mutexes too
    assert all(v.statistics().eager_mutex for v in (c, a, b))
    runner = threading.Thread(target=step, name="graph step", daemon=True)

    def holder() -> None:
        with safevars.locked(c):
            runner.start()
            time.sleep(scaled(0.5))  # the graph starts and waits for c
            with safevars.locked(a):  # c, then a: the global order
                pass

    call_bounded(holder, 60)
    runner.join(scaled(60))
    assert not runner.is_alive(), "the graph step never finished"
    assert [float(v.numpy()) for v in (c, a, b)] == [2.0, 98.0, 2.0]
    assert [v.version for v in (c, a, b)] == [2, 2, 2]


def test_replicas_traced_into_one_graph_are_not_ordered_after_one_another(mirrored_strategy):
    """``strategy.run`` traces each replica's function into the step's graph from a thread
    of its own: a replica's sections keep their order, and no replica waits for another's
    releases (an order between replicas is not the program's, and could wait for a
    collective the other replica only reaches later)."""
    c, a, b, _ = _variables_and_step()

    def replica() -> None:
        c.update(lambda x: x + 1.0)
        safevars.transaction([a, b], lambda: (a.assign_sub(1.0), b.assign_add(1.0)))

    @tf.function(autograph=False)
    def step():
        mirrored_strategy.run(replica)

    ops = step.get_concrete_function().graph.get_operations()
    replicas = mirrored_strategy.num_replicas_in_sync
    assert replicas >= 2

    def of(op):
        return int(op.name.split("/")[0].split("_")[1]) if op.name.startswith("replica_") else 0

    locks = [op for op in ops if op.type == "MutexLock"]
    releases = [op for op in ops if op.type == "ConsumeMutexLock"]
    assert len(locks) == len(releases) == 3 * replicas
    for lock in locks:  # (TensorFlow orders the uses of one mutex across replicas itself)
        waited = {of(op) for op in lock.control_inputs if op.type == "ConsumeMutexLock"}
        assert waited <= {of(lock)}, (lock.name, waited)
    for index in range(replicas):  # each replica's transaction after its own update
        (first,) = [op for op in releases if of(op) == index and "safevars_update" in op.name]
        mine = [op for op in locks if of(op) == index and "safevars_update" not in op.name]
        assert mine and all(first in ancestors(lock) for lock in mine)
    step()
    assert [float(v.numpy()) for v in (c, a, b)] == [replicas, 100.0 - replicas, replicas]
