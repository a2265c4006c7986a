"""SafeOptimizer under threads: concurrent calls never interleave, one lock per step."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.optimizer import SafeOptimizer
from safevars.snapshot import snapshot as safevars_snapshot
from safevars.variable import SafeVariable, wrap
from tests.support.graphs import kept_with
from tests.support.optimizer import (
    GRADS,
    INIT,
    regression_data,
    small_model,
)
from tests.support.threading_harness import run_threads


class TestConcurrentCallsNeverInterleave:
    def test_four_threads_fifty_calls_exact_value_and_iterations(self, mode):
        threads, calls = 4, 50
        g = tf.constant([1.0, -2.0, 0.5])
        shared = SafeVariable(tf.zeros([3]))
        opt = SafeOptimizer(keras.optimizers.SGD(0.01, momentum=0.9))
        step = mode(lambda: opt.apply_gradients([(g, shared)]))

        run_threads(threads, lambda index: [step() for _ in range(calls)])

        reference = tf.Variable(tf.zeros([3]))
        plain = keras.optimizers.SGD(0.01, momentum=0.9)
        plain_step = mode(lambda: plain.apply_gradients([(g, reference)]))
        for _ in range(threads * calls):
            plain_step()
        np.testing.assert_array_equal(shared.numpy(), reference.numpy())
        assert int(opt.iterations.numpy()) == threads * calls
        assert shared.version == threads * calls
        assert opt.statistics().calls == threads * calls

    def test_snapshots_never_see_half_an_update(self, mode):
        a, b = SafeVariable(tf.zeros([2])), SafeVariable(tf.zeros([2]))
        opt = SafeOptimizer(keras.optimizers.SGD(1.0))
        opt.build([a, b])
        g = tf.ones([2])
        step = mode(lambda: opt.apply_gradients([(g, a), (-g, b)]))  # keeps a + b == 0
        torn = []

        def work(index):
            if index == 0:
                for _ in range(200):
                    snap_a, snap_b = safevars_snapshot([a, b])
                    if np.any(snap_a.numpy() + snap_b.numpy() != 0.0):
                        torn.append((snap_a.numpy(), snap_b.numpy()))
                    if snap_a.version != snap_b.version:
                        torn.append((snap_a.version, snap_b.version))
            else:
                for _ in range(40):
                    step()

        run_threads(3, work)
        assert not torn, torn[:3]
        np.testing.assert_array_equal(a.numpy(), [-80.0, -80.0])
        assert a.version == b.version == 80

    def test_concurrent_first_calls_build_once(self):
        v = SafeVariable(tf.zeros([3]))
        opt = SafeOptimizer(keras.optimizers.SGD(1.0, momentum=0.5))
        run_threads(4, lambda i: opt.apply_gradients([(tf.ones([3]), v)]))
        assert len(opt.variables) == 3  # iterations, lr, one momentum
        assert int(opt.iterations.numpy()) == 4 and v.version == 4

    def test_threads_on_a_keras_model_with_adam_equal_a_serial_run(self):
        # Four threads apply the same gradients: any serial order gives the same result.
        model = small_model()
        x, y = regression_data(64)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        start = [v.numpy() for v in model.trainable_variables]
        opt = SafeOptimizer(keras.optimizers.Adam(0.01))

        run_threads(
            4,
            lambda i: [
                opt.apply_gradients(zip(grads, model.trainable_variables)) for _ in range(10)
            ],
        )

        ref = [tf.Variable(s) for s in start]
        plain = keras.optimizers.Adam(0.01)
        for _ in range(40):
            plain.apply_gradients(zip(grads, ref))
        for v, r in zip(model.trainable_variables, ref):
            np.testing.assert_array_equal(v.numpy(), r.numpy())
        assert int(opt.iterations.numpy()) == 40


class LockCountingSGD(keras.optimizers.SGD):
    """SGD that records how many safevars locks its thread holds during each update."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.held = []

    def update_step(self, gradient, variable, learning_rate):
        if tf.executing_eagerly():
            self.held.append(len(safevars.held_locks()))
        return super().update_step(gradient, variable, learning_rate)


def deep_model(layers: int) -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(layers)])


class TestOneLockPerStep:
    """One apply_gradients takes a number of mutexes that does not grow with the model."""

    @pytest.mark.parametrize("layers", [1, 30])
    def test_one_mutex_in_the_traced_step(self, layers):
        model = deep_model(layers)
        opt = SafeOptimizer(keras.optimizers.Adam(0.01))
        opt.build(model.trainable_variables)
        x = tf.constant(regression_data(16)[0])

        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(x) ** 2)
            variables = model.trainable_variables
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        graph = step.get_concrete_function().graph
        kinds = [op.type for op in graph.get_operations()]
        assert len(model.trainable_variables) == 2 * layers
        assert kinds.count("MutexLock") == kinds.count("ConsumeMutexLock") == 1
        step()
        assert all(wrap(v).version == 1 for v in model.trainable_variables)
        assert wrap(model.trainable_variables[0]).statistics().shared_by == 2 * layers + 1

    def test_one_lock_held_in_an_eager_step(self):
        model = deep_model(30)
        opt = SafeOptimizer(LockCountingSGD(learning_rate=0.01))
        grads = [tf.ones_like(v) for v in model.trainable_variables]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        assert opt.held == [1] * 60

    def test_variables_join_the_one_lock_a_traced_graph_uses(self):
        # share_lock moves the others to the lock a traced graph uses (its graphs keep
        # taking that mutex): one lock for a, b and the optimizer's state.
        a, b = SafeVariable(INIT), SafeVariable(INIT)
        kept_with(a, tf.function(lambda: a.assign_add(INIT), autograph=False))()
        opt = SafeOptimizer(keras.optimizers.SGD(0.1))
        opt.apply_gradients([(GRADS[0], a), (GRADS[0], b)])
        assert a.statistics().shared_by == b.statistics().shared_by == 3
        run_threads(
            4, lambda i: [opt.apply_gradients([(GRADS[1], a), (GRADS[1], b)]) for _ in range(10)]
        )
        assert a.version == 42 and b.version == 41
        np.testing.assert_allclose(
            b.numpy(), INIT - 0.1 * (GRADS[0] + 40 * GRADS[1]), rtol=1e-5, atol=1e-5
        )

    def test_calls_on_disjoint_variables_still_exclude_each_other(self):
        # Two variables with locks of their own (used by traced graphs before, so not
        # shared): calls updating one or the other still serialize on the optimizer's
        # state lock (iterations, slots, counters).
        a, b = SafeVariable(tf.zeros([3])), SafeVariable(tf.zeros([3]))
        both = tf.function(
            lambda: (a.assign_add(tf.zeros([3])), b.assign_add(tf.zeros([3]))), autograph=False
        )
        both()  # (kept: locks stay used by graphs, so not shared, while it lives)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        opt.build([a, b])
        assert a.statistics().shared_by == b.statistics().shared_by == 1
        g = tf.constant([1.0, 2.0, 4.0])
        run_threads(4, lambda i: [opt.apply_gradients([(g, (a, b)[i % 2])]) for _ in range(50)])
        assert int(opt.iterations.numpy()) == opt.statistics().calls == 200
        assert a.version == b.version == 101
