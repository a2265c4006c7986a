"""Writes inside ``tf.function(jit_compile=True)``: locked around the compiled call, exact.

XLA compiles no mutex op, so :mod:`safevars.sections` takes a compiled function's locks
around its call (eagerly, or as a section whose body is the call op inside another
``tf.function``). These tests call compiled writers from several threads, alone, nested
in a plain ``tf.function`` and against eager writers and readers, and check exact
values and versions.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads

THREADS = 4
CALLS = 25


def _compiled_writer():
    counter, vector = SafeVariable(0.0), SafeVariable(tf.zeros([3]))
    table = SafeVariable(tf.zeros([4, 2]))

    @tf.function(jit_compile=True)
    def step():
        counter.assign_add(1.0)
        vector.update(lambda x: x + tf.constant([1.0, 2.0, 3.0]))
        table.scatter_add(tf.IndexedSlices(tf.ones([2, 2]), tf.constant([0, 3])))
        return counter.read_value()

    return counter, vector, table, step


def _check(counter, vector, table, total):
    assert float(counter.numpy()) == total and counter.version == total
    np.testing.assert_array_equal(vector.numpy(), [total, 2 * total, 3 * total])
    assert vector.version == total
    np.testing.assert_array_equal(table.numpy()[[0, 3]], np.full((2, 2), total))
    assert table.version == total


def test_compiled_writes_from_four_threads_are_exact():
    counter, vector, table, step = _compiled_writer()
    step()  # traced once, before the threads (so all four run the compiled call)
    run_threads(THREADS, lambda _: [step() for _ in range(CALLS)])
    _check(counter, vector, table, THREADS * CALLS + 1)


def test_compiled_function_called_from_a_plain_tf_function():
    counter, vector, table, step = _compiled_writer()

    @tf.function
    def outer():
        step()
        return step()

    assert float(outer()) == 2.0
    run_threads(THREADS, lambda _: [outer() for _ in range(CALLS)])
    _check(counter, vector, table, 2 * (THREADS * CALLS + 1))


@pytest.mark.parametrize("eager_writer", ["update", "locked", "transaction"])
def test_compiled_calls_exclude_eager_writers(eager_writer):
    """Two threads call a compiled read-modify-write, two write eagerly with a separate
    read and write (``update``, or a read then ``assign`` inside ``locked`` or
    ``transaction``): an eager write landing inside a compiled call, or a compiled call
    between an eager read and its write, would lose an update."""
    v = SafeVariable(0.0)

    @tf.function(jit_compile=True)
    def compiled():
        v.update(lambda x: x + 1.0)

    compiled()

    def eager():
        if eager_writer == "update":
            v.update(lambda x: x + 1.0)
        elif eager_writer == "locked":
            with safevars.locked(v):
                v.assign(v.read_value() + 1.0)
        else:
            safevars.transaction([v], lambda: v.assign(v.read_value() + 1.0))

    def role(i):
        for _ in range(CALLS):
            compiled() if i % 2 == 0 else eager()

    run_threads(THREADS, role)
    total = THREADS * CALLS + 1
    assert float(v.numpy()) == total and v.version == total


def test_eager_snapshots_see_compiled_transfers_whole():
    """A compiled function moves 1 from ``a`` to ``b``; every snapshot taken meanwhile
    keeps the sum and sees both variables at the same version."""
    a, b = SafeVariable(1000.0), SafeVariable(0.0)

    @tf.function(jit_compile=True)
    def move():
        a.assign_sub(1.0)
        b.assign_add(1.0)

    move()
    stop = threading.Event()
    torn: list[tuple[float, float, int, int]] = []

    def role(i):
        if i < 2:
            try:
                for _ in range(CALLS * 2):
                    move()
            finally:
                if i == 0:
                    stop.set()
            return
        while not stop.is_set():
            sa, sb = safevars.snapshot([a, b])
            if float(sa.value) + float(sb.value) != 1000.0 or sa.version != sb.version:
                torn.append((float(sa.value), float(sb.value), sa.version, sb.version))

    run_threads(3, role)
    assert not torn, torn[:5]
    assert a.version == b.version >= CALLS * 2 + 1
    assert float(a.numpy()) + float(b.numpy()) == 1000.0


@pytest.mark.parametrize("caller", ["eager", "tf_function"])
def test_a_compiled_call_waits_for_an_eager_section(caller):
    """A thread holds ``v``'s lock between a read and a write; a compiled writer called
    meanwhile (directly, or from a plain ``tf.function``) must wait for it. The holder
    gives the writer up to 0.3 s to (wrongly) finish inside its section: a wait that
    passes proves nothing, a writer that finishes loses the holder's update."""
    v = SafeVariable(0.0)

    @tf.function(jit_compile=True)
    def compiled():
        v.assign_add(1.0)

    outer = tf.function(lambda: compiled())
    call = compiled if caller == "eager" else outer
    call()
    for _ in range(3):
        inside, finished = threading.Event(), threading.Event()

        def role(i):
            if i == 0:
                with safevars.locked(v):
                    x = v.read_value()
                    inside.set()
                    finished.wait(0.3)
                    v.assign(x + 1.0)
            else:
                assert inside.wait(scaled(60))
                call()
                finished.set()

        run_threads(2, role)
    assert float(v.numpy()) == 7.0 and v.version == 7


def test_a_lock_held_around_a_compiled_call_names_the_function():
    """``held_locks()`` and ``statistics().where`` name the compiled function an eager
    call holds the lock for (the line that called safevars is TensorFlow's own)."""
    v = SafeVariable(0.0)

    @tf.function(jit_compile=True)
    def compiled_step():
        v.assign_add(1.0)
        return v.read_value()

    compiled_step()
    seen: list[str] = []
    done = threading.Event()

    def watch():
        while not done.is_set() and not seen:
            seen.extend(h.where for h in safevars.held_locks() if v.name in h.variables)

    watcher = threading.Thread(target=watch)
    watcher.start()
    deadline = time.monotonic() + scaled(60)
    try:
        while not seen and time.monotonic() < deadline:
            compiled_step()
    finally:
        done.set()
        watcher.join(scaled(60))
    assert not watcher.is_alive()
    assert seen, "no call was seen holding the lock"
    assert seen[0] == "tf.function 'compiled_step' (XLA-compiled), called eagerly", seen
    assert v.statistics().where is None  # (released after the call)
