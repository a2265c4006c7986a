"""GradientAccumulator: the deterministic sum, the same bits whatever the order of the adds."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from tests.support.accumulator import hard_contributions
from tests.support.threading_harness import run_threads


class TestDeterminism:
    SIZE = 512
    CONTRIBUTIONS = 32
    THREADS = 8
    RUNS = 20

    def test_naive_float32_sums_of_the_data_depend_on_order(self):
        grads = hard_contributions(self.CONTRIBUTIONS, self.SIZE, seed=1)
        rng = random.Random(0)
        sums = set()
        for _ in range(self.RUNS):
            order = list(range(self.CONTRIBUTIONS))
            rng.shuffle(order)
            total = np.zeros(self.SIZE, np.float32)
            for i in order:
                total += grads[i]
            sums.add(total.tobytes())
        assert len(sums) > 1  # so the bitwise test below is meaningful

    @pytest.mark.usefixtures("layout")
    def test_eight_threads_shuffled_orders_are_bitwise_identical(self, mode):
        grads = hard_contributions(self.CONTRIBUTIONS, self.SIZE, seed=1)
        v = tf.Variable(tf.zeros([self.SIZE]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        rng = random.Random(42)
        results = set()
        for _ in range(self.RUNS):
            order = list(range(self.CONTRIBUTIONS))
            rng.shuffle(order)
            shares = [order[t :: self.THREADS] for t in range(self.THREADS)]

            def worker(index: int) -> None:
                for i in shares[index]:
                    add(tf.constant(grads[i]))

            run_threads(self.THREADS, worker)
            assert acc.count == self.CONTRIBUTIONS
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1
        result = np.frombuffer(results.pop(), np.float32)
        exact = np.mean(np.stack(grads).astype(np.float64), axis=0)
        np.testing.assert_array_max_ulp(result, exact.astype(np.float32), maxulp=1)

    def test_reproducible_sum_is_order_free_exact_enough_and_xla_proof(self):
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(11)
        p, n = 24, 64
        columns = [
            rng.standard_normal(p) * 10.0 ** rng.uniform(-30, 30, p),  # 60 decades
            np.concatenate([[3e38, -3e38], rng.standard_normal(p - 2)]),  # cancels
            np.concatenate([[1.0, -1.0], 1e-7 * rng.standard_normal(p - 2)]),
        ]
        data = rng.standard_normal((p, n)) * 10.0 ** rng.uniform(-6, 6, (p, n))
        for j, column in enumerate(columns):
            data[:, j] = column
        data = data.astype(np.float32)
        garbage = rng.standard_normal((8, n)).astype(np.float32)  # rows past the count
        count = tf.constant(p, tf.int64)
        plain = tf.function(_reproducible_sum, autograph=False)
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        reference = plain(tf.constant(np.concatenate([data, garbage])), count).numpy()
        for fn in (plain, xla):
            for _ in range(3):
                shuffled = np.concatenate([rng.permutation(data), garbage])
                out = fn(tf.constant(shuffled), count).numpy()
                assert out.tobytes() == reference.tobytes()
        for j in range(n):
            exact = sum(Fraction(float(x)) for x in data[:, j])
            biggest = max(abs(Fraction(float(x))) for x in data[:, j])
            error = abs(Fraction(float(reference[j])) - exact)
            # one float64 rounding of the result, plus remainders dropped below 2**-80
            assert error <= abs(exact) * Fraction(1, 2**52) + biggest * Fraction(1, 2**80)

    @pytest.mark.parametrize("counts", [(1, 3, 4), (5, 8, 9), (17, 2)])
    @pytest.mark.usefixtures("layout")
    def test_take_reduces_exactly_the_pending_rows(self, mode, counts):
        """Takes of 1..17 contributions (several row buckets, one XLA compile each) after
        earlier takes left garbage rows behind: exactly the pending rows count."""
        rng = np.random.default_rng(sum(counts))
        v = tf.Variable(tf.zeros([2, 5]))
        acc = GradientAccumulator([v])
        acc.add([tf.fill([2, 5], np.float32(np.nan))])  # stale rows past every later count
        for _ in range(24):
            acc.add([tf.fill([2, 5], np.float32(3e38))])
        acc.take()
        add = mode(lambda g: acc.add([g]))
        take = mode(lambda: acc.take()[0])
        for count in counts:
            # float32 multiples of 2**-13 below 2**10: float64 sums them exactly, so
            # numpy's float64 mean rounded to float32 is the exact answer.
            grads = rng.integers(-(2**23), 2**23, (count, 2, 5)) / 2.0**13
            for g in grads:
                add(tf.constant(g, tf.float32))
            expected = (grads.sum(axis=0) / count).astype(np.float32)
            assert take().numpy().tobytes() == expected.tobytes()
        assert acc.statistics().taken == 25 + sum(counts)

    def test_grouped_reduction_matches_reference_for_every_row_count(self):
        """The reduction combines rows in groups of four; any number of rows (static or
        unknown when tracing), any padding, gives the bits of a one-row-at-a-time
        reference of the same method."""
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(5)
        dynamic = tf.function(
            _reproducible_sum,
            autograph=False,
            input_signature=[tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([], tf.int64)],
        )
        for rows in (1, 2, 3, 4, 5, 7, 9, 13):
            data = rng.standard_normal((rows, 6)) * 10.0 ** rng.uniform(-25, 25, (rows, 6))
            data = data.astype(np.float32)
            for count in sorted({1, rows // 2 or 1, rows}):
                static = _reproducible_sum(tf.constant(data), tf.constant(count, tf.int64))
                unknown = dynamic(tf.constant(data), tf.constant(count, tf.int64))
                assert static.numpy().tobytes() == unknown.numpy().tobytes()
                shuffled = np.concatenate([rng.permutation(data[:count]), data[count:]])
                again = _reproducible_sum(tf.constant(shuffled), tf.constant(count, tf.int64))
                assert again.numpy().tobytes() == static.numpy().tobytes()
                for j in range(6):
                    exact = sum(Fraction(float(x)) for x in data[:count, j])
                    biggest = max(abs(Fraction(float(x))) for x in data[:count, j])
                    error = abs(Fraction(float(static[j])) - exact)
                    assert error <= abs(exact) * Fraction(1, 2**52) + biggest * Fraction(1, 2**80)

    def test_leading_rows_give_the_bits_of_the_stacked_rows(self):
        """Rows passed as ``leading`` vectors (the blocks kept by reference) and the
        rest as the grouped rows give the same bits as all of them stacked, for every
        split and count, under XLA too; an empty rest is allowed."""
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(9)
        data = rng.standard_normal((9, 6)) * 10.0 ** rng.uniform(-25, 25, (9, 6))
        data = tf.constant(data.astype(np.float32))
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        for count in (1, 3, 4, 5, 9):
            want = _reproducible_sum(data, tf.constant(count, tf.int64)).numpy().tobytes()
            for k in (1, 3, 4, 9):
                leading = [data[j] for j in range(k)]
                for fn in (_reproducible_sum, xla):
                    got = fn(data[k:], tf.constant(count, tf.int64), leading)
                    assert got.numpy().tobytes() == want, (count, k)

    @staticmethod
    def _sorted_cases() -> np.ndarray:
        """[4, n] float32 columns whose float64 sums depend on the order: random
        values over 60 decades, and hand-made cancellations, signed zeros and the
        smallest normal numbers (TensorFlow's CPU kernels flush subnormals to zero)."""
        rng = np.random.default_rng(21)
        n = 3000
        data = rng.standard_normal((4, n)) * 10.0 ** rng.uniform(-30, 30, (4, n))
        tiny = np.float32(2.0**-126)
        columns = [
            [3e38, -3e38, 1.0, 2.0**-100],
            [1.0, -1.0, 2.0**-60, 3 * 2.0**-80],
            [2.0**60, 1.0, -(2.0**60), 2.0**-60],
            [0.0, -0.0, -0.0, 0.0],
            [-0.0, -0.0, -0.0, -0.0],
            [tiny, -tiny, 3 * tiny, 1.0],
            [1e30, 1e-30, -1e30, 1e-30],
            # Found by search: the compensated (TwoSum) sum of these in some orders
            # differs in the last float64 bit (about 1 column in 250,000 of random
            # ones); the plain float64 sum of the first two does too.
            [4749230080.0, 4.195203212598031e-12, 197126356992.0, 9.026287480286625e20],
            [-255321377341440.0, -4.805750810114395e23, 246476596838400.0, 3.4188305519933238e-09],
            [
                -1.491278567300469e-08,
                1.6560610660576458e-09,
                373258293608448.0,
                -1.3151346780012688e24,
            ],
            [
                7.183176276015502e-11,
                7.052203544998062e21,
                -1.224407797373317e-10,
                -1809542807552.0,
            ],
        ]
        for j, column in enumerate(columns):
            data[:, j] = column
        return data.astype(np.float32)

    def test_sums_of_up_to_four_are_order_free_and_nearly_exact(self):
        """Up to four rows are sorted per element and summed in float64 in a fixed
        order (``_sorted_sum``): every order of them, as buffer rows or as leading rows,
        plain or under XLA, gives the same bits, within 2**-53 of the exact sum plus
        2**-51 of the largest value."""
        import itertools
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _NETWORK, _reproducible_sum

        for order in itertools.permutations(range(4)):  # the network sorts every order
            xs = list(order)
            for i, j in _NETWORK:
                xs[i], xs[j] = min(xs[i], xs[j]), max(xs[i], xs[j])
            assert xs == [0, 1, 2, 3], order
        data = self._sorted_cases()
        garbage = np.full((3, data.shape[1]), np.nan, np.float32)  # rows past the count
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        for count in (1, 2, 3, 4):
            rows = data[:count]
            results = set()
            for order in itertools.permutations(range(count)):
                shuffled = np.concatenate([rows[list(order)], garbage])
                as_rows = tf.constant(shuffled)
                c = tf.constant(count, tf.int64)
                results.add(_reproducible_sum(as_rows, c).numpy().tobytes())
                results.add(xla(as_rows, c).numpy().tobytes())
                leading = [as_rows[j] for j in range(2)]
                results.add(xla(as_rows[2:], c, leading).numpy().tobytes())
            assert len(results) == 1, count
            out = np.frombuffer(results.pop(), np.float64)
            for j in range(data.shape[1]):
                exact = sum(Fraction(float(x)) for x in rows[:, j])
                biggest = max(abs(Fraction(float(x))) for x in rows[:, j])
                error = abs(Fraction(float(out[j])) - exact)
                bound = abs(exact) * Fraction(1, 2**53) + biggest * Fraction(1, 2**51)
                assert error <= bound * (1 + Fraction(1, 2**50))

    def test_where_the_count_cannot_pass_four_only_the_sorted_sum_is_compiled(self):
        """XLA computes both branches of the count's cond (it turns it into a select):
        with a bound known when tracing (``most``: max_pending) or a static number of
        rows at most four (take compiles per power of two of the pending rows), only the
        sorted sum is compiled, with the same bits."""
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        data = self._sorted_cases()
        rows = np.concatenate([data, np.full_like(data, np.nan)])  # 8 rows: the grid may run
        n = data.shape[1]
        spec = [tf.TensorSpec([None, n], tf.float32), tf.TensorSpec([], tf.int64)]

        def compiled(most, signature=None):
            return tf.function(
                lambda r, c: _reproducible_sum(r, c, (), most),
                autograph=False,
                jit_compile=True,
                input_signature=signature,
            )

        def grid_in(fn, r) -> bool:  # the grid's roundings (tf.round) are compiled in
            ir = fn.experimental_get_compiler_ir(tf.constant(r), tf.constant(4, tf.int64))
            return "round-nearest" in ir(stage="optimized_hlo")

        unbounded, bounded, marker = compiled(None), compiled(4), compiled(None, spec)
        for count in (1, 2, 3, 4):
            c = tf.constant(count, tf.int64)
            want = _reproducible_sum(tf.constant(rows), c).numpy().tobytes()
            assert unbounded(tf.constant(rows), c).numpy().tobytes() == want
            assert bounded(tf.constant(rows), c).numpy().tobytes() == want
            assert marker(tf.constant(data), c).numpy().tobytes() == want
        assert grid_in(unbounded, rows) and grid_in(marker, rows)
        assert not grid_in(bounded, rows)
        assert not grid_in(marker, data)  # 4 rows: XLA folds the count's cond away

    def test_sums_of_up_to_four_propagate_nan_and_inf(self):
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        inf, nan = np.inf, np.nan
        columns = {
            (1.0, nan, 2.0, 3.0): nan,
            (nan, 1.0, 2.0, 3.0): nan,
            (1.0, 2.0, 3.0, nan): nan,
            (inf, 1.0, -2.0, 3.0): inf,
            (1.0, -inf, 2.0, 3.0): -inf,
            (inf, -inf, 2.0, 3.0): nan,
            (inf, inf, 2.0, 3.0): inf,
        }
        data = tf.constant(np.array(list(columns), np.float32).T)
        for fn in (_reproducible_sum, tf.function(_reproducible_sum, jit_compile=True)):
            out = fn(data, tf.constant(4, tf.int64)).numpy()
            np.testing.assert_array_equal(out, np.array(list(columns.values())))

    @pytest.mark.usefixtures("layout")
    def test_take_of_up_to_four_keeps_what_the_grid_dropped(self, mode):
        """1 + 2**-110 - 1, in every order: the sorted sum keeps the 2**-110 that the
        two-level grid drops (below its finer grid, 2**-100 here), in every layout."""
        import itertools

        v = tf.Variable(tf.zeros([16]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        want = np.float32(2.0**-110 / 3)
        for order in itertools.permutations([1.0, 2.0**-110, -1.0]):
            for value in order:
                add(tf.fill([16], np.float32(value)))
            out = acc.take()[0].numpy()
            assert out.tobytes() == np.full([16], want, np.float32).tobytes(), order

    @pytest.mark.usefixtures("layout")
    def test_four_threads_adding_four_give_the_same_bits(self, mode):
        """An accumulator taking four contributions at a time (the sorted sum) gives
        bitwise the same mean whatever order four threads add them in."""
        data = self._sorted_cases()
        v = tf.Variable(tf.zeros([data.shape[1]]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        results = set()
        for _ in range(6):
            run_threads(4, lambda i: add(tf.constant(data[i])))
            assert acc.count == 4
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1
        # math.fsum: the float64 sum correctly rounded (numpy's loses the 1e-30s).
        exact = np.array([math.fsum(map(float, c)) for c in data.T]) / 4
        np.testing.assert_array_max_ulp(
            np.frombuffer(results.pop(), np.float32), exact.astype(np.float32), maxulp=1
        )

    def test_replica_and_arrival_order_do_not_matter_for_sparse(self):
        v = tf.Variable(tf.zeros([6, 3]))
        rng = np.random.default_rng(3)
        parts = [
            tf.IndexedSlices(
                tf.constant(hard_contributions(1, 12, seed=i)[0].reshape(4, 3)),
                tf.constant(rng.integers(0, 6, 4)),
            )
            for i in range(10)
        ]
        results = set()
        for order in (range(10), reversed(range(10)), [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]):
            acc = GradientAccumulator([v])
            for i in order:
                acc.add([parts[i]])
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1
