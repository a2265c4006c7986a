"""GradientAccumulator: add, then take (``add_and_take`` is ``test_add_and_take.py``); Keras
micro-batches, threads adding and taking, ``num_required``, mixed precision, checkpoints."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import AccumulatorStatistics, GradientAccumulator
from safevars.errors import (
    AccumulatorTimeoutError,
)
from tests.support.accumulator import as_int, hard_contributions
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads


class TestAddTake:
    @pytest.mark.usefixtures("layout")
    def test_mean_of_dense_sparse_and_none(self, mode):
        a = tf.Variable(tf.zeros([3, 2]))
        b = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator({"a": a, "b": b})
        sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([2, 2]))

        def step():
            n = acc.add({"a": tf.ones([3, 2]), "b": tf.constant([2.0, 4.0])})
            n += acc.add({"a": sparse, "b": None})
            return n, acc.take()

        n, out = mode(step)()
        assert as_int(n) == 2
        np.testing.assert_array_equal(out["a"], [[0.5, 0.5], [0.5, 0.5], [2.5, 3.5]])
        np.testing.assert_array_equal(out["b"], [1.0, 2.0])
        assert acc.statistics() == AccumulatorStatistics(0, 2, 0, 0, 0, 2, 1, 0)

    def test_sum_reduction_and_empty_take(self, mode):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v], reduction="sum")

        def step():
            empty = acc.take()
            acc.add([tf.constant([1.0, 2.0])])
            acc.add([tf.constant([3.0, 4.0])])
            return empty, acc.take()

        empty, out = mode(step)()
        np.testing.assert_array_equal(empty[0], [0.0, 0.0])
        np.testing.assert_array_equal(out[0], [4.0, 6.0])
        assert acc.statistics().takes == 1  # the empty take took nothing

    def test_count_and_reset(self, mode):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v])

        def step():
            acc.add([tf.ones([2])])
            acc.add([tf.ones([2])])
            before = acc.count
            with tf.control_dependencies([before]):
                acc.reset()
            return before

        assert as_int(mode(step)()) == 2
        assert acc.count == 0
        stats = acc.statistics()
        assert (stats.added, stats.discarded, stats.pending) == (2, 2, 0)
        np.testing.assert_array_equal(acc.take()[0], [0.0, 0.0])

    def test_nonfinite_propagates_by_default(self, mode):
        v = tf.Variable(tf.zeros([4]))
        acc = GradientAccumulator([v], reduction="sum")

        def step():
            acc.add([tf.constant([np.inf, np.inf, np.nan, 1.0])])
            acc.add([tf.constant([1.0, -np.inf, 1.0, 3e38])])
            acc.add([tf.constant([1.0, 1.0, 1.0, 3e38])])
            return acc.take()

        out = mode(step)()[0].numpy()
        assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2])
        assert out[3] == np.inf  # 6e38 overflows float32 only at the end

    def test_mean_of_large_values_does_not_overflow(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v])
        acc.add([tf.constant([3e38])])
        acc.add([tf.constant([3e38])])
        np.testing.assert_array_equal(acc.take()[0], np.float32([3e38]))


class TestKerasMicroBatches:
    def test_k_micro_batches_equal_the_full_batch_gradient(self, mode):
        import keras

        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
        x = tf.random.uniform([32, 5], 0, 50, tf.int32, seed=1)
        y = tf.random.uniform([32], 0, 3, tf.int32, seed=2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = model.trainable_variables

        def gradients(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return tape.gradient(loss, variables)

        full = gradients(x, y)
        assert isinstance(full[0], tf.IndexedSlices)  # the sparse path is exercised
        acc = GradientAccumulator(variables, num_required=4)

        def accumulate():
            for i in range(4):
                acc.add(gradients(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]))
            return acc.take()

        accumulated = mode(accumulate)()
        for got, want in zip(accumulated, full):
            want = tf.convert_to_tensor(want)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


class TestConcurrency:
    ADDERS = 4
    TAKERS = 2
    ADDS = 150

    def test_total_taken_equals_total_added(self, mode):
        v = tf.Variable(tf.zeros([3]))
        acc = GradientAccumulator([v], reduction="sum")
        add = mode(lambda g: acc.add([g]))
        # One eager and one graph taker, so graph adds race an eager read-and-reset.
        takers = [acc.take, tf.function(lambda: acc.take(), autograph=False)]
        taken: list[np.ndarray] = []
        finished = []
        guard = threading.Lock()

        def worker(index: int) -> None:
            if index < self.ADDERS:
                for i in range(self.ADDS):
                    value = float(index * 1000 + i)
                    add(tf.constant([value, 1.0, -value]))
                with guard:
                    finished.append(index)
                return
            take = takers[index % 2]
            while True:
                with guard:
                    done = len(finished) == self.ADDERS
                out = take()[0].numpy()
                with guard:
                    taken.append(out)
                if done:
                    return

        run_threads(self.ADDERS + self.TAKERS, worker)
        taken.append(acc.take()[0].numpy())
        total = np.sum(np.stack(taken).astype(np.float64), axis=0)
        expected = sum(t * 1000 + i for t in range(self.ADDERS) for i in range(self.ADDS))
        n = self.ADDERS * self.ADDS
        np.testing.assert_array_equal(total, [expected, n, -expected])
        stats = acc.statistics()
        assert stats.added == stats.taken == n and stats.pending == 0

    def test_graph_and_eager_adds_exclude_each_other(self):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v], reduction="sum", deterministic=False)
        graph_add = tf.function(lambda g: acc.add([g]), autograph=False)

        def eager_add(g: tf.Tensor) -> int:
            return acc.add([g])

        def worker(index: int) -> None:
            add = graph_add if index % 2 else eager_add
            for _ in range(50):
                add(tf.constant([1.0, 2.0]))

        run_threads(4, worker)
        np.testing.assert_array_equal(acc.take()[0], [200.0, 400.0])
        assert acc.statistics().taken == 200


class TestNumRequired:
    def test_take_times_out_and_keeps_contributions(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=3, reduction="sum")
        acc.add([tf.constant([1.0])])
        with pytest.raises(AccumulatorTimeoutError):
            acc.take(timeout=0.05)
        with pytest.raises(TimeoutError):  # the builtin a caller would catch
            acc.take(timeout=0)
        assert acc.count == 1
        acc.add([tf.constant([2.0])])
        acc.add([tf.constant([3.0])])
        np.testing.assert_array_equal(acc.take(timeout=0)[0], [6.0])

    def test_blocked_take_wakes_when_enough_arrived(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=4, reduction="sum")
        result = []
        taker = threading.Thread(target=lambda: result.append(acc.take(timeout=scaled(60))))
        taker.start()
        for i in range(4):
            acc.add([tf.constant([float(i)])])
        taker.join(scaled(60))
        assert not taker.is_alive()
        np.testing.assert_array_equal(result[0][0], [6.0])

    def test_graph_take_with_too_few_fails_and_keeps(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=2)
        acc.add([tf.constant([1.0])])
        take = tf.function(lambda: acc.take(), autograph=False)
        with pytest.raises(tf.errors.InvalidArgumentError, match="AccumulatorTimeoutError"):
            take()
        assert acc.count == 1
        acc.add([tf.constant([3.0])])
        np.testing.assert_array_equal(take()[0], [2.0])

    def test_take_if_ready(self, mode):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=2)
        take = mode(lambda: acc.take_if_ready())
        acc.add([tf.constant([1.0])])
        ready, grads = take()
        assert not bool(ready) and acc.count == 1
        acc.add([tf.constant([3.0])])
        ready, grads = take()
        assert bool(ready) and acc.count == 0
        np.testing.assert_array_equal(grads[0], [2.0])


class TestMixedPrecision:
    @pytest.mark.parametrize(
        "dtype, big", [(tf.float16, 2048.0), (tf.bfloat16, 256.0)], ids=["f16", "bf16"]
    )
    @pytest.mark.usefixtures("layout")
    def test_half_precision_accumulates_in_float32(self, mode, dtype, big):
        v = tf.Variable(tf.zeros([2], dtype))
        acc = GradientAccumulator([v], reduction="sum")
        grads = [tf.constant([big, 0.5], dtype)] + [tf.constant([1.0, 0.25], dtype)] * 2
        naive = grads[0]
        for g in grads[1:]:
            naive = naive + g
        assert float(naive[0]) == big  # the narrow sum loses both 1s

        def step():
            for g in grads:
                acc.add([g])
            return acc.take()

        out = mode(step)()[0]
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.numpy().astype(np.float32), [big + 2.0, 1.0])

    def test_float32_variable_takes_half_gradients(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], reduction="sum")
        acc.add([tf.constant([1.5], tf.float16)])
        acc.add([tf.constant([2.5], tf.bfloat16)])
        out = acc.take()[0]
        assert out.dtype == tf.float32
        np.testing.assert_array_equal(out, [4.0])


class TestCheckpoint:
    @pytest.mark.parametrize("deterministic", [True, False])
    @pytest.mark.usefixtures("layout")
    def test_resume_gives_the_same_result(self, tmp_path, deterministic):
        v = tf.Variable(tf.zeros([64]))
        grads = [tf.constant(g) for g in hard_contributions(6, 64, seed=5)]
        acc = GradientAccumulator([v], deterministic=deterministic)
        for g in grads[:3]:
            acc.add([g])
        path = tf.train.Checkpoint(acc=acc).save(str(tmp_path / "ckpt"))
        for g in grads[3:]:
            acc.add([g])
        stats = acc.statistics()
        uninterrupted = acc.take()[0].numpy()

        resumed = GradientAccumulator([v], deterministic=deterministic)
        tf.train.Checkpoint(acc=resumed).restore(path).assert_consumed()
        assert resumed.count == 3
        for g in grads[3:]:
            resumed.add([g])
        assert resumed.statistics() == stats
        assert resumed.take()[0].numpy().tobytes() == uninterrupted.tobytes()
