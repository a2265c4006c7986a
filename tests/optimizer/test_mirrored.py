"""SafeOptimizer under MirroredStrategy (two logical CPUs in this process)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import (
    InvalidArgumentError,
    UnsupportedStrategyError,
)
from safevars.optimizer import SafeOptimizer
from safevars.variable import wrap
from tests.support.optimizer import (
    INIT,
    regression_data,
    small_model,
)


class TestMirroredStrategy:
    def test_strategy_run_in_tf_function_trains(self, mirrored_strategy):
        strategy = mirrored_strategy
        x, y = regression_data(64, seed=5)
        with strategy.scope():
            model = small_model(3)
            opt = SafeOptimizer(keras.optimizers.Adam(0.02))
            opt.build(model.trainable_variables)
        dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
        )

        @tf.function
        def train_step(batch):
            def replica_step(xs, ys):
                with tf.GradientTape() as tape:
                    per_example = tf.reduce_mean((model(xs) - ys) ** 2, axis=-1)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=32)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            losses = strategy.run(replica_step, args=batch)
            return strategy.reduce("SUM", losses, axis=None)

        batches = iter(dataset)
        losses = [float(train_step(next(batches))) for _ in range(20)]
        assert losses[-1] < losses[0] * 0.7, losses
        assert int(opt.iterations.numpy()) == 20
        stats = opt.statistics()
        assert stats.calls == stats.applied == 20  # once per step, not once per replica
        for v in model.trainable_variables:
            replicas = strategy.experimental_local_results(v.value)
            assert len(replicas) == 2
            np.testing.assert_array_equal(replicas[0].numpy(), replicas[1].numpy())
            assert wrap(v).version == 20

    def test_model_fit_under_mirrored_strategy(self, mirrored_strategy):
        x, y = regression_data()
        with mirrored_strategy.scope():
            model = small_model()
            model.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        losses = model.fit(x, y, epochs=2, batch_size=32, verbose=0).history["loss"]
        assert losses[-1] < losses[0], losses
        assert model.optimizer.statistics().calls == 16

    def test_unbuilt_optimizer_inside_strategy_run_is_refused(self, mirrored_strategy):
        with mirrored_strategy.scope():
            v = keras.Variable(INIT)
            opt = SafeOptimizer(keras.optimizers.SGD())
        step = tf.function(
            lambda: mirrored_strategy.run(lambda: opt.apply_gradients([(tf.ones([4, 3]), v)])),
            autograph=False,
        )
        with pytest.raises(InvalidArgumentError, match="Build the optimizer before"):
            step()

    def test_accumulation_inside_strategy_run(self, mirrored_strategy):
        with mirrored_strategy.scope():
            v = keras.Variable(tf.zeros([3]))
            opt = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=2)
            opt.build([v])

        @tf.function(autograph=False)
        def step(g):
            mirrored_strategy.run(lambda: opt.apply_gradients([(tf.identity(g), v)]))

        step(tf.constant([1.0, 2.0, 3.0]))
        assert opt.statistics().pending == 1 and int(opt.iterations.numpy()) == 0
        step(tf.constant([3.0, 2.0, 1.0]))
        # Each step sums the two replicas' gradients (as Keras does); the mean of 2 steps.
        for replica in mirrored_strategy.experimental_local_results(v.value):
            np.testing.assert_array_equal(replica.numpy(), [-4.0, -4.0, -4.0])
        assert int(opt.iterations.numpy()) == 1 and wrap(v).version == 1

    def test_loss_scale_optimizer_inside_is_refused_under_a_strategy(self, mirrored_strategy):
        with mirrored_strategy.scope():
            v = keras.Variable(INIT)
            opt = SafeOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
            opt.build([v])
        with pytest.raises(UnsupportedStrategyError, match="other way round"):
            mirrored_strategy.run(
                tf.function(lambda: opt.apply_gradients([(tf.ones([4, 3]), v)]), autograph=False)
            )
