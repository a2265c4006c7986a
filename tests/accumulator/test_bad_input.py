"""GradientAccumulator: bad input is refused, names the argument and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
)
from tests.support.accumulator import as_int, state
from tests.support.graph_walk import ancestors


class TestBadInput:
    def make(self, **kwargs):
        a = tf.Variable(tf.zeros([2, 2]))
        b = tf.Variable(tf.zeros([3]))
        acc = GradientAccumulator([a, b], **kwargs)
        acc.add([tf.ones([2, 2]), tf.ones([3])])
        return acc

    @pytest.mark.usefixtures("layout")
    def test_refused_calls_change_nothing(self):
        acc = self.make()
        before = state(acc)
        ok = tf.ones([3])
        cases = [
            (InvalidArgumentError, [tf.ones([2, 2])]),
            (InvalidArgumentError, [tf.ones([2, 2]), ok, ok]),
            (ShapeMismatchError, [tf.ones([4]), ok]),
            (ShapeMismatchError, [tf.ones([2, 2]), tf.ones([2])]),
            (DTypeMismatchError, [tf.ones([2, 2], tf.int32), ok]),
            (DTypeMismatchError, [tf.ones([2, 2], tf.float64), ok]),
            (DTypeMismatchError, [[["a", "b"], ["c", "d"]], ok]),
            (ShapeMismatchError, [tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0])), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2])), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([-1])), ok]),
            (ShapeMismatchError, [tf.ones([2, 2]), tf.IndexedSlices(tf.ones([1, 2]), [0])]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), [[0]]), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), [0.5]), ok]),
        ]
        for error, gradients in cases:
            with pytest.raises(error):
                acc.add(gradients)
            assert state(acc) == before, gradients

    @pytest.mark.usefixtures("layout")
    def test_refused_calls_change_nothing_in_graph(self):
        acc = self.make()
        before = state(acc)
        add = tf.function(
            lambda i: acc.add([tf.IndexedSlices(tf.ones([1, 2]), i), tf.ones([3])]),
            autograph=False,
        )
        with pytest.raises(tf.errors.InvalidArgumentError, match="indices outside"):
            add(tf.constant([5]))
        assert state(acc) == before
        assert as_int(add(tf.constant([1]))) == 1

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_every_state_change_of_a_traced_add_waits_for_its_value_checks(self, deterministic):
        """With lock_span="step" the lock is taken before the gradients exist, so the
        section's writes (counters, growth, rows or sum) must wait for the checks
        themselves: before they did not, and a refused add changed the counters in about
        1 of 40 runs, as the executor happened to order the ops."""
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([3]))],
            deterministic=deterministic,
        )
        add = tf.function(
            lambda i: acc.add([tf.IndexedSlices(tf.ones([1, 2]), i), tf.ones([3])]),
            autograph=False,
        )
        graph = add.get_concrete_function(tf.TensorSpec([1], tf.int32)).graph
        inner = {id(outer): inner for outer, inner in graph.captures}
        handles = (inner[id(acc._state.handle)], inner[id(acc._counters.handle)])
        reads = {"ReadVariableOp", "ResourceGather", "VariableShape"}
        writes = [
            op
            for op in graph.get_operations()
            if op.type not in reads and any(t is h for t in op.inputs for h in handles)
        ]
        checks = {op for op in graph.get_operations() if op.type == "Assert"}
        assert writes and checks
        # The growth check runs as soon as the lock is taken (the next test): it may grow
        # a refused add's buffer, capacity only (test_a_refused_add_at_full_capacity_...).
        growth = [op for op in writes if op.type == "If"]
        assert len(growth) == (1 if deterministic else 0)
        for op in writes:
            if op not in growth:
                assert ancestors(op) & checks, f"{op.type} does not wait for the checks"

    @pytest.mark.parametrize("lock_span", ["step", "add"])
    def test_the_growth_check_of_a_traced_add_runs_before_the_gradients(self, lock_span):
        """With lock_span="step" the growth check (an If kernel: a function call) needs
        only the pending count and the capacity, so it runs while the function still
        computes the gradients; after the last gradient it made the 26K-parameter
        micro-step about 6% slower (A/B in one process). With "add" the lock, and the
        check, come after the gradients."""
        w = tf.Variable(tf.ones([4, 4]))
        acc = GradientAccumulator([w], lock_span=lock_span)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(x, w))
            return acc.add(tape.gradient(loss, [w]))

        fn = tf.function(step, autograph=False)
        graph = fn.get_concrete_function(tf.TensorSpec([2, 4])).graph
        (growth,) = [op for op in graph.get_operations() if op.type == "If"]
        matmuls = {op for op in graph.get_operations() if op.type == "MatMul"}
        assert matmuls
        waits = bool(ancestors(growth) & matmuls)
        assert waits == (lock_span == "add")
        x = tf.ones([2, 4])
        for _ in range(5):  # past the initial capacity of 4 contributions
            fn(x)
        np.testing.assert_array_equal(acc.take()[0], np.full([4, 4], 2.0, np.float32))

    @pytest.mark.usefixtures("layout")
    def test_a_refused_add_at_full_capacity_keeps_every_contribution(self):
        """A traced add refused at run time when the buffer is full: its growth check
        may have doubled the buffer (it does not wait for the index check), and nothing
        else changed (the rows below the pending count, the statistics); the next adds
        and the take see every contribution."""
        acc = self.make()
        add = tf.function(
            lambda i, g: acc.add([tf.IndexedSlices(tf.ones([1, 2]) * g, i), tf.ones([3]) * g]),
            autograph=False,
        )
        for g in (2.0, 3.0, 4.0):  # with make()'s 1.0: the first 4 blocks are full
            add(tf.constant([0]), tf.constant(g))
        capacity = acc.state_bytes
        before = state(acc)
        with pytest.raises(tf.errors.InvalidArgumentError, match="indices outside"):
            add(tf.constant([5]), tf.constant(5.0))
        assert state(acc) == before
        assert acc.state_bytes in (capacity, 2 * capacity)
        add(tf.constant([1]), tf.constant(6.0))
        assert acc.state_bytes == 2 * capacity
        first, second = acc.take()
        np.testing.assert_array_equal(first, np.float32([[10 / 5, 10 / 5], [7 / 5, 7 / 5]]))
        np.testing.assert_array_equal(second, np.float32([16 / 5] * 3))

    def test_numpy_and_python_gradients_are_converted(self):
        acc = self.make(reduction="sum")
        acc.add([np.ones((2, 2)), [1.0, 2.0, 3.0]])
        np.testing.assert_array_equal(acc.take()[1], [2.0, 3.0, 4.0])

    @pytest.mark.usefixtures("layout")
    def test_nonfinite_raise(self, mode):
        acc = self.make(nonfinite="raise")
        before = state(acc)
        bad = [tf.ones([2, 2]), tf.constant([1.0, np.nan, 1.0])]
        if mode.name == "eager":
            with pytest.raises(NonFiniteGradientError):
                acc.add(bad)
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match="NonFinite"):
                mode(lambda: acc.add(bad))()
        assert state(acc) == before

    @pytest.mark.usefixtures("layout")
    def test_nonfinite_skip_is_counted(self, mode):
        acc = self.make(nonfinite="skip")
        before = state(acc)
        n = mode(lambda: acc.add([tf.ones([2, 2]), tf.constant([1.0, np.inf, 1.0])]))()
        assert as_int(n) == 0
        after = state(acc)
        assert after[0] == before[0]
        assert after[1].rejected == 1 and after[1].added == before[1].added
