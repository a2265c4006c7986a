"""No hang: a thread never waits on a lock it holds itself, through a traced function.

A thread inside ``safevars.locked(v)`` (or an eager transaction) holds ``v``'s lock, and
in run-time mode its ``tf.CriticalSection`` mutex. A ``tf.function`` whose graph takes
that mutex, called there, would wait for its own caller forever. Every such call raises
``LockReentryError`` at once, before anything runs, wherever the function was traced;
calls that are sound (eager writes, XLA-compiled functions, functions that take no lock)
run. Each test runs its body in a thread with a deadline, so a hang fails the test.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import safevars
from tests.support.threading_harness import call_bounded, run_threads


def writer(v: safevars.SafeVariable, **options) -> tf.types.experimental.PolymorphicFunction:
    """A tf.function that adds 1 to ``v``, traced now, outside any lock."""

    @tf.function(**options)
    def add_one():
        v.assign_add(1.0)
        return v.read_value()

    add_one()
    return add_one


def assert_refused(body, v: safevars.SafeVariable) -> None:
    """``body`` (run inside ``locked(v)``) raises LockReentryError, promptly, and
    changes nothing; the lock is free afterwards."""
    value, version = float(v.numpy()), v.version

    def attempt():
        with safevars.locked(v):
            body()

    with pytest.raises(safevars.LockReentryError, match="would hang"):
        call_bounded(attempt)
    assert (float(v.numpy()), v.version) == (value, version)
    assert not v.statistics().locked


def test_a_function_traced_elsewhere_and_called_inside_locked_raises():
    v = safevars.SafeVariable(0.0)
    add_one = writer(v)
    assert_refused(add_one, v)
    assert float(add_one().numpy()) == 2.0  # outside the block it runs


def test_a_function_traced_inside_the_block_once_in_runtime_mode_raises():
    v = safevars.SafeVariable(0.0)
    writer(v)  # the lock is in run-time mode now

    def trace_and_call():
        writer(v)

    assert_refused(trace_and_call, v)


def test_an_eager_transaction_calling_a_traced_writer_raises():
    v = safevars.SafeVariable(0.0)
    add_one = writer(v)
    with pytest.raises(safevars.LockReentryError, match="would hang"):
        call_bounded(lambda: safevars.transaction([v], add_one))
    assert (float(v.numpy()), v.version) == (1.0, 1)


@pytest.mark.parametrize("how", ["nested_function", "cond_branch"])
def test_a_function_that_takes_the_lock_deeper_inside_raises(how):
    """The lock is taken by a function the called one calls (traced on its own before),
    or in a tf.cond branch: the called function's graph knows it takes it too."""
    v = safevars.SafeVariable(0.0)
    add_one = writer(v)

    @tf.function
    def outer():
        if how == "nested_function":
            return add_one() * 2.0
        return tf.cond(tf.constant(True), lambda: v.assign_add(1.0), lambda: v.read_value())

    outer()
    assert_refused(outer, v)


def test_sound_calls_inside_the_block_run():
    """An eager write (re-entrant), an XLA-compiled writer (its caller holds the lock
    around the call, re-entrantly) and a function that takes no lock: all run."""
    v = safevars.SafeVariable(0.0)
    compiled = writer(v, jit_compile=True)
    other = safevars.SafeVariable(0.0)
    elsewhere = writer(other)  # another variable's lock
    reads = tf.function(lambda: v.read_value() * 2.0)
    reads()

    def body():
        with safevars.locked(v):
            v.assign_add(1.0)
            compiled()
            elsewhere()
            return float(reads().numpy())

    assert call_bounded(body) == 6.0  # 1 (traced call) + 1 + 1, times two
    assert v.version == 3 and other.version == 2


def test_another_thread_holding_the_lock_is_waited_for_not_refused():
    """The check is per thread: a call in a thread that does not hold the lock waits for
    the holder, then runs."""
    v = safevars.SafeVariable(0.0)
    add_one = writer(v)
    holding = safevars.locked(v)

    def role(i):
        if i == 0:
            with holding:
                v.assign_add(10.0)
        else:
            add_one()

    run_threads(2, role)
    assert float(v.numpy()) == 12.0 and v.version == 3
