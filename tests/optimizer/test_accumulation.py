"""SafeOptimizer's ``accumulate_steps`` and Keras' own gradient accumulation."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import (
    InvalidArgumentError,
)
from safevars.optimizer import SafeOptimizer
from safevars.variable import SafeVariable, wrap
from tests.support.optimizer import (
    GRADS,
    INIT,
    assert_same_state,
    everything,
    regression_data,
    small_model,
)
from tests.support.threading_harness import run_threads


class TestAccumulateSteps:
    def test_k_micro_batches_equal_one_large_batch(self, mode):
        x, y = regression_data(64, seed=3)
        big, small = small_model(7), small_model(7)
        lr = keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)
        big_opt = keras.optimizers.AdamW(lr, weight_decay=0.1)
        acc_opt = SafeOptimizer(keras.optimizers.AdamW(lr, weight_decay=0.1), accumulate_steps=4)

        def big_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((big(x) - y) ** 2)
            big_opt.apply_gradients(
                zip(tape.gradient(loss, big.trainable_variables), big.trainable_variables)
            )

        def micro_step(xs, ys):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((small(xs) - ys) ** 2)
            acc_opt.apply_gradients(
                zip(tape.gradient(loss, small.trainable_variables), small.trainable_variables)
            )

        big_step, micro_step = mode(big_step), mode(micro_step)
        for _ in range(2):
            big_step()
            for i in range(4):
                micro_step(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
        for a, b in zip(big.trainable_variables, small.trainable_variables):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
        # iterations, schedule, weight decay and bias correction advanced twice, not 8x.
        assert int(acc_opt.iterations.numpy()) == 2
        stats = acc_opt.statistics()
        assert (stats.calls, stats.applied, stats.accumulated, stats.pending) == (8, 2, 8, 0)
        assert all(wrap(v).version == 2 for v in small.trainable_variables)

    def test_partial_accumulation_changes_no_variable(self):
        v = SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1), accumulate_steps=3)
        opt.apply_gradients([(GRADS[0], v)])
        opt.apply_gradients([(GRADS[1], v)])
        np.testing.assert_array_equal(v.numpy(), INIT)
        assert v.version == 0 and opt.statistics().pending == 2
        opt.apply_gradients([(GRADS[2], v)])
        expected = INIT - 0.1 * (GRADS[0] + GRADS[1] + GRADS[2]) / 3
        np.testing.assert_allclose(v.numpy(), expected, atol=1e-6)
        assert v.version == 1 and opt.statistics().pending == 0

    def test_every_call_must_give_the_same_variables(self):
        a, b = SafeVariable(INIT), SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1), accumulate_steps=2)
        opt.apply_gradients([(GRADS[0], a), (GRADS[0], b)])
        before = everything(opt, [a, b])
        with pytest.raises(InvalidArgumentError, match="same variables"):
            opt.apply_gradients([(GRADS[1], a), (None, b)])
        assert_same_state(before, everything(opt, [a, b]))

    def test_checkpoint_keeps_pending_gradients(self, tmp_path):
        # The pending gradients are safevars' bookkeeping: in safevars_state.
        v = keras.Variable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=3)
        opt.apply_gradients([(GRADS[0], v)])
        path = tf.train.Checkpoint(v=v, optimizer=opt, safevars=opt.safevars_state).save(
            os.path.join(tmp_path, "ck")
        )
        v2 = keras.Variable(np.zeros_like(INIT))
        opt2 = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=3)
        opt2.build([v2])
        tf.train.Checkpoint(v=v2, optimizer=opt2, safevars=opt2.safevars_state).restore(
            path
        ).assert_consumed()
        assert opt2.statistics().pending == 1
        for g in GRADS[1:3]:
            opt.apply_gradients([(g, v)])
            opt2.apply_gradients([(g, v2)])
        np.testing.assert_array_equal(v2.numpy(), v.numpy())
        assert opt2.statistics().pending == 0 and int(opt2.iterations.numpy()) == 1

    def test_threads_accumulating_apply_once_per_k(self):
        v = SafeVariable(tf.zeros([3]))
        opt = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=4)
        g = tf.constant([1.0, 2.0, 4.0])
        run_threads(4, lambda i: [opt.apply_gradients([(g, v)]) for _ in range(10)])
        np.testing.assert_array_equal(v.numpy(), [-10.0, -20.0, -40.0])
        assert int(opt.iterations.numpy()) == 10 and v.version == 10


class TestKerasGradientAccumulation:
    """The optimizer's own gradient_accumulation_steps: Keras' semantics, made thread-safe."""

    def test_same_as_plain_keras_including_overwrite_with_gradient(self, mode):
        def run(make_safe):
            scale = keras.Variable(INIT, name="scale")  # like float8's amax: overwritten
            scale.overwrite_with_gradient = True
            w = keras.Variable(INIT, name="w")
            sgd = keras.optimizers.SGD(0.5, momentum=0.9, gradient_accumulation_steps=3)
            opt = SafeOptimizer(sgd) if make_safe else sgd
            step = mode(lambda g: opt.apply_gradients([(g, scale), (g * 2.0, w)]))
            for g in GRADS + GRADS[:1]:
                step(tf.constant(g))
            return opt, scale, w

        opt, scale, w = run(make_safe=True)
        plain, plain_scale, plain_w = run(make_safe=False)
        for a, b in zip([scale, w, *opt.variables], [plain_scale, plain_w, *plain.variables]):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert int(opt.iterations.numpy()) == 2 and int(opt._iterations.numpy()) == 7
        assert wrap(w).version == wrap(scale).version == 2  # one per real update
        stats = opt.statistics()
        assert (stats.calls, stats.applied, stats.accumulated, stats.pending) == (7, 2, 7, 0)

    def test_threads_accumulate_exactly_once_per_call(self, mode):
        threads, calls, every = 4, 12, 4
        v = SafeVariable(tf.zeros([3]))
        opt = SafeOptimizer(keras.optimizers.SGD(1.0, gradient_accumulation_steps=every))
        opt.build([v])
        g = tf.constant([1.0, 2.0, 4.0])
        step = mode(lambda: opt.apply_gradients([(g, v)]))
        run_threads(threads, lambda i: [step() for _ in range(calls)])
        updates = threads * calls // every
        # Constant gradients: every update applies exactly the mean, whatever the order.
        np.testing.assert_array_equal(v.numpy(), -updates * g.numpy())
        assert int(opt._iterations.numpy()) == threads * calls
        assert int(opt.iterations.numpy()) == v.version == updates
        np.testing.assert_array_equal(opt._accumulated_gradients[0].numpy(), [0.0, 0.0, 0.0])
        assert opt.statistics().applied == updates
