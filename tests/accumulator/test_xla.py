"""GradientAccumulator inside XLA-compiled functions (``jit_compile=True``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.errors import (
    InvalidArgumentError,
)
from tests.support.accumulator import hard_contributions, state
from tests.support.threading_harness import run_threads


class TestXla:
    """Inside ``tf.function(jit_compile=True)`` (Keras' default on a GPU). XLA compiles no
    mutex (the lock is taken around the compiled call), no change of a variable's shape,
    no gathered handle and no assertion: the deterministic buffer grows before the
    compiled call, for every add the function makes (``sections.record_xla_preparation``),
    a block kept by reference is picked by a ``tf.switch_case``, ``take`` reduces every
    block of the buffer, masked by the pending count, and a ``take`` that would need an
    assertion is refused."""

    def test_a_running_sum_adds_and_takes_under_xla(self):
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([3]))], deterministic=False, num_required=2, reduction="sum"
        )
        step = tf.function(lambda g: acc.take_if_ready() + (acc.add([g]),), jit_compile=True)
        got = [step(tf.fill([3], float(i))) for i in range(5)]
        assert [bool(r[0]) for r in got] == [False, False, True, False, True]
        np.testing.assert_array_equal(got[2][1][0], [1.0, 1.0, 1.0])  # 0 + 1
        np.testing.assert_array_equal(got[4][1][0], [5.0, 5.0, 5.0])  # 2 + 3
        assert acc.count == 1 and acc.statistics().added == 5

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_take_with_num_required_is_refused_under_xla(self, deterministic):
        """XLA drops the run-time check that num_required are pending ("Ignoring
        Assert operator"): a compiled take() went ahead with 1 of 3. Refused when
        traced, naming take_if_ready; nothing changes."""
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([3]))], deterministic=deterministic, num_required=3
        )
        acc.add([tf.ones([3])])
        before = state(acc)
        with pytest.raises(InvalidArgumentError, match="take_if_ready"):
            tf.function(lambda: acc.take()[0], jit_compile=True)()
        assert state(acc) == before
        ready = tf.function(lambda: acc.take_if_ready()[0], jit_compile=True)()
        assert not bool(ready) and acc.count == 1

    @pytest.mark.parametrize("nested", [False, True])
    def test_deterministic_adds_in_a_compiled_loop_are_refused(self, nested):
        """A loop inside the compiled function adds a number of times known only when it
        runs, so the buffer cannot grow for it first (measured before the check: 6 adds
        in two calls of a 3-iteration loop, pending 6, and a sum of 4 of them, XLA
        dropping the writes past the buffer). Refused when traced, directly or through
        a compiled function called in the loop; nothing changes."""
        v = tf.Variable(tf.zeros([5]))
        acc = GradientAccumulator([v], reduction="sum")
        acc.add([tf.ones([5])])
        before = state(acc)
        add = tf.function(lambda g: acc.add([g]), jit_compile=True)

        def body(i):
            g = tf.fill([5], tf.cast(i, tf.float32))
            with tf.control_dependencies([add(g) if nested else acc.add([g])]):
                return i + 1

        loop = tf.function(lambda: tf.while_loop(lambda i: i < 3, body, [0]), jit_compile=True)
        with pytest.raises(InvalidArgumentError, match="inside a loop.*XLA"):
            loop()
        assert state(acc) == before

    @staticmethod
    def pair() -> tuple[list[tf.Variable], GradientAccumulator, GradientAccumulator]:
        variables = [tf.Variable(tf.zeros([3, 7])), tf.Variable(tf.zeros([5]))]
        return variables, GradientAccumulator(variables), GradientAccumulator(variables)

    @staticmethod
    def assert_same_bits(got, want):
        for a, b in zip(got, want):
            assert a.numpy().tobytes() == b.numpy().tobytes()

    @pytest.mark.usefixtures("layout")
    def test_deterministic_adds_and_takes_give_the_eager_bits(self):
        """Compiled adds and takes of 1..9 contributions (the buffer growing past its 4
        blocks, and with "blocks" past the 4 kept by reference) take bitwise what an
        eager accumulator given the same contributions takes."""
        _, compiled, eager = self.pair()
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        take = tf.function(lambda: compiled.take(), jit_compile=True)
        rng = np.random.default_rng(4)
        for count in (1, 3, 4, 6, 9, 2, 5):
            for _ in range(count):
                g = hard_contributions(1, 21, seed=int(rng.integers(1 << 30)))[0]
                h = hard_contributions(1, 5, seed=int(rng.integers(1 << 30)))[0]
                add(tf.constant(g.reshape(3, 7)), tf.constant(h))
                eager.add([tf.constant(g.reshape(3, 7)), tf.constant(h)])
            assert compiled.count == count
            self.assert_same_bits(take(), eager.take())
        assert compiled.statistics() == eager.statistics()

    @pytest.mark.usefixtures("layout")
    @pytest.mark.parametrize("kind", ["skipped_nan", "float16", "sparse"])
    def test_compiled_adds_of_every_kind_give_the_eager_bits(self, kind):
        """Contributions refused at run time (NaN with nonfinite="skip": the accepted
        ones are written first), float16 variables and sparse gradients: compiled adds
        of six, past the 4 blocks, take bitwise what an eager accumulator takes, with
        the same statistics."""
        rng = np.random.default_rng(3)
        dense = tf.Variable(tf.zeros([4, 5], tf.float16 if kind == "float16" else tf.float32))
        table, bias = tf.Variable(tf.zeros([10, 5])), tf.Variable(tf.zeros([3]))
        variables = [table, bias] if kind == "sparse" else [dense, bias]
        options = {"nonfinite": "skip"} if kind == "skipped_nan" else {}
        compiled, eager = (GradientAccumulator(variables, **options) for _ in range(2))
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        for k in range(6):
            if kind == "sparse":
                values = rng.standard_normal((3, 5)).astype(np.float32)
                first = tf.IndexedSlices(
                    tf.constant(values), tf.constant(rng.integers(0, 10, 3)), tf.constant([10, 5])
                )
            else:
                values = rng.standard_normal((4, 5)).astype(np.float32)
                if kind == "skipped_nan" and k in (1, 4):
                    values[0, 0] = np.nan
                first = tf.cast(tf.constant(values), dense.dtype)
            second = tf.constant(rng.standard_normal(3).astype(np.float32))
            add(first, second)
            eager.add([first, second])
        assert compiled.statistics() == eager.statistics()
        assert compiled.statistics().rejected == (2 if kind == "skipped_nan" else 0)
        self.assert_same_bits(tf.function(compiled.take, jit_compile=True)(), eager.take())

    @pytest.mark.usefixtures("layout")
    def test_several_adds_in_one_compiled_call_find_room(self):
        """Six adds in one compiled function (more than the 4 blocks there are): the
        call grows the buffer first, under the lock, for all six."""
        _, compiled, eager = self.pair()
        grads = [hard_contributions(2, 21 + 5, seed=i) for i in range(2)]
        parts = [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads[0]]
        parts += [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads[1]]

        @tf.function(jit_compile=True)
        def six_adds_then_take():
            for k in range(6):
                compiled.add(list(parts[k % 4]))
            return compiled.take()

        for k in range(6):
            eager.add(list(parts[k % 4]))
        self.assert_same_bits(six_adds_then_take(), eager.take())
        assert compiled.statistics().taken == 6

    def test_a_compiled_call_inside_a_traced_function_prepares_there(self):
        """Keras' shape: an outer ``tf.function`` (not compiled) calls the compiled step.
        The growth runs in the outer function's section, before the call."""
        _, compiled, eager = self.pair()
        inner = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        outer = tf.function(lambda g, h: [inner(g, h), inner(h[0] + g, h)])
        rng = np.random.default_rng(8)
        for _ in range(3):  # 6 pending: past the 4 blocks
            g = tf.constant(rng.standard_normal((3, 7)).astype(np.float32))
            h = tf.constant(rng.standard_normal(5).astype(np.float32))
            outer(g, h)
            eager.add([g, h])
            eager.add([h[0] + g, h])
        assert compiled.count == 6
        self.assert_same_bits(compiled.take(), eager.take())

    @pytest.mark.usefixtures("layout")
    def test_threads_calling_a_compiled_add_give_the_same_bits(self):
        """Four threads each add one of four contributions through one compiled
        function, six times over: the same bits every time (the sorted sum of four)."""
        variables, compiled, _ = self.pair()
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        take = tf.function(lambda: compiled.take(), jit_compile=True)
        grads = [hard_contributions(1, 26, seed=20 + i)[0] for i in range(4)]
        parts = [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads]
        add(*parts[0])
        compiled.take()
        results = set()
        for _ in range(6):
            run_threads(4, lambda i: add(*parts[i]))
            assert compiled.count == 4
            results.add(b"".join(t.numpy().tobytes() for t in take()))
        assert len(results) == 1
        assert compiled.statistics().added == 25 and compiled.statistics().taken == 25
