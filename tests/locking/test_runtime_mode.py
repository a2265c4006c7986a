"""Run-time mode's two levels: versions in variables, and the mutex for eager sections.

A lock used only by XLA-compiled functions (called eagerly, which hold the lock around
the call) keeps its versions in variables but takes no TensorFlow mutex eagerly; the
first graph that takes the mutex with a ``MutexLock`` op switches eager sections to take
it too, and that switch waits for every eager holder that did not.
"""

from __future__ import annotations

import threading
import time

import tensorflow as tf

import safevars
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads


def test_a_lock_only_xla_functions_use_takes_no_mutex_eagerly():
    v = safevars.SafeVariable(0.0)
    add = tf.function(lambda: v.assign_add(1.0), jit_compile=True, autograph=False)
    add()
    assert v.statistics().runtime_mode and not v.statistics().eager_mutex
    run_threads(4, lambda _: [add() for _ in range(50)])
    with safevars.locked(v):
        v.assign_add(1.0)  # an eager write under the Python lock alone
    assert float(v.numpy()) == 202.0 and v.version == 202
    snap = safevars.snapshot(v)  # optimistic again: compiled writes move the sequence
    assert float(snap.numpy()) == 202.0 and snap.version == 202


def test_a_graph_taking_the_mutex_waits_for_an_eager_holder_without_it():
    """An eager section opened before any graph took the mutex holds only the Python
    lock; a graph traced meanwhile must not run inside that section."""
    v = safevars.SafeVariable(0.0)
    add_compiled = tf.function(lambda: v.assign_add(1.0), jit_compile=True, autograph=False)
    add_compiled()  # run-time versions, no mutex yet
    inside, traced = threading.Event(), threading.Event()
    seen: list[float] = []

    def role(index: int) -> None:
        if index == 0:
            with safevars.locked(v):
                inside.set()
                time.sleep(0.5)  # the other thread traces and runs its graph meanwhile
                seen.append(float(v.numpy()))
            return
        assert inside.wait(scaled(60))
        graph_add = tf.function(lambda: v.assign_add(10.0), autograph=False)
        graph_add()  # its trace switches the lock to take the mutex eagerly
        traced.set()

    run_threads(2, role)
    assert traced.is_set() and seen == [1.0]  # the graph's write waited for the section
    assert float(v.numpy()) == 11.0 and v.version == 2
    assert v.statistics().eager_mutex  # eager sections take the mutex now

    def mixed(index: int) -> None:  # compiled calls and eager writes, under the mutex now
        for _ in range(25):
            if index % 2:
                add_compiled()
            else:
                v.assign_add(1.0)

    run_threads(4, mixed)
    assert float(v.numpy()) == 111.0 and v.version == 102
