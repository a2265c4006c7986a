"""SafeOptimizer: fidelity, same files, atomicity under threads, one lock, policies, distribution."""

from __future__ import annotations

import inspect
import itertools
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from threading_harness import run_threads

import safevars
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
    StaleGradientError,
    UnsupportedStrategyError,
)
from safevars.optimizer import OptimizerStatistics, SafeOptimizer
from safevars.snapshot import snapshot as safevars_snapshot
from safevars.variable import SafeVariable, wrap

_COLLECTIVE_KEY_BASES = itertools.count(1)


@pytest.fixture(autouse=True)
def _unique_collective_keys(monkeypatch):
    """Gives each test's MirroredStrategy its own collective group keys.

    Every MirroredStrategy built in one process numbers its collective groups from 1, and
    TensorFlow caches a collective's shape by (group, instance) key, so a second strategy
    whose first all-reduce has another shape fails ("Shape mismatch in the collective
    instance 100"). ``_collective_key_base`` is TensorFlow's knob for tests.
    """
    base = 1_000_000 + 100_000 * next(_COLLECTIVE_KEY_BASES)
    monkeypatch.setattr(tf.distribute.MirroredStrategy, "_collective_key_base", base)


RNG = np.random.default_rng(1234)
INIT = RNG.normal(size=(4, 3)).astype("float32")
GRADS = [RNG.normal(size=(4, 3)).astype("float32") for _ in range(6)]


def regression_data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    return x, (x @ w + 0.1).astype("float32")


def small_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )


def everything(opt: SafeOptimizer, variables) -> tuple:
    """Every piece of state a refused call must leave unchanged."""
    return (
        [np.array(v.numpy()) for v in variables],
        [np.array(v.numpy()) for v in opt.variables],
        [wrap(v).version for v in variables],
        opt.statistics(),
    )


def assert_same_state(before: tuple, after: tuple) -> None:
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)
    assert before[2:] == after[2:]


# --------------------------------------------------------------------------- equivalence


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw_clip_schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5),
        weight_decay=0.1,
        clipnorm=0.5,
    ),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "nadam": lambda: keras.optimizers.Nadam(0.05),  # overrides _backend_update_step
    "adam_ema": lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=4),
}


class TestSameResultsAsTheInnerOptimizer:
    @pytest.mark.parametrize("name", sorted(OPTIMIZERS))
    def test_one_thread_matches_plain_optimizer(self, mode, name):
        make = OPTIMIZERS[name]
        plain_var = tf.Variable(INIT)
        variables = [tf.Variable(INIT), keras.Variable(INIT), SafeVariable(INIT)]
        plain = make()
        safe = [SafeOptimizer(make()) for _ in variables]

        def step(g):
            plain.apply_gradients([(g, plain_var)])
            for opt, v in zip(safe, variables):
                opt.apply_gradients([(g, v)])

        step = mode(step)
        for g in GRADS:
            step(tf.constant(g))
        for opt, v in zip(safe, variables):  # bitwise: the same object does the arithmetic
            np.testing.assert_array_equal(v.numpy(), plain_var.numpy())
            assert int(opt.iterations.numpy()) == len(GRADS)
            assert wrap(v).version == len(GRADS)
            assert len(opt.variables) == len(plain.variables)
            for a, b in zip(opt.variables, plain.variables):
                np.testing.assert_array_equal(a.numpy(), b.numpy())
        assert safe[0].statistics() == OptimizerStatistics(
            calls=6,
            applied=6,
            accumulated=0,
            pending=0,
            dropped_stale=0,
            scaled_stale=0,
            skipped_nonfinite=0,
        )

    def test_sparse_gradients_match_plain_adam(self):
        table = tf.Variable(INIT)
        safe_table = SafeVariable(INIT)
        plain, safe = keras.optimizers.Adam(0.1), SafeOptimizer(keras.optimizers.Adam(0.1))
        for _ in range(3):
            g = tf.IndexedSlices(tf.ones([2, 3]), tf.constant([0, 2]), tf.constant([4, 3]))
            plain.apply_gradients([(g, table)])
            safe.apply_gradients([(g, safe_table)])
        np.testing.assert_allclose(safe_table.numpy(), table.numpy(), atol=1e-6)
        assert safe_table.version == 3

    def test_model_fit_trains_and_counts_each_step(self):
        x, y = regression_data()
        model = small_model()
        model.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        history = model.fit(x, y, epochs=3, batch_size=32, verbose=0)
        losses = history.history["loss"]
        assert losses[-1] < losses[0] * 0.7, losses
        stats = model.optimizer.statistics()
        assert stats.calls == stats.applied == 24 == int(model.optimizer.iterations.numpy())
        assert all(wrap(v).version == 24 for v in model.trainable_variables)


# --------------------------------------------------------------------------- fidelity


def assert_same_training(a: keras.Model, b: keras.Model) -> None:
    """Bitwise the same model weights and optimizer state (layout included)."""
    assert len(a.optimizer.variables) == len(b.optimizer.variables)
    for x, z in zip(a.weights + a.optimizer.variables, b.weights + b.optimizer.variables):
        assert x.shape == z.shape
        np.testing.assert_array_equal(np.asarray(x.numpy()), np.asarray(z.numpy()))


def compiled(optimizer, seed: int = 0, build: bool = False) -> keras.Model:
    model = small_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    if build:
        model.optimizer.build(model.trainable_variables)
    return model


def fit(model: keras.Model, epochs: int = 1) -> None:
    x, y = regression_data()
    model.fit(x, y, epochs=epochs, batch_size=32, shuffle=False, verbose=0)


class TestItIsTheOptimizer:
    """Whatever a user reads, sets or calls on the optimizer works the same once safe."""

    def test_signature_shows_the_constructor_parameters(self):
        signature = inspect.signature(SafeOptimizer)
        assert list(signature.parameters)[:2] == ["optimizer", "accumulate_steps"]
        assert signature.parameters["accumulate_steps"].default == 1
        assert signature.parameters["on_stale"].default == "drop"
        assert signature.parameters["max_staleness"].default is None

    def test_same_object_same_class_family(self):
        adam = keras.optimizers.Adam(0.01, name="my_adam")
        safe = SafeOptimizer(adam, max_staleness=2)
        assert safe is adam
        assert isinstance(safe, keras.optimizers.Adam) and isinstance(safe, SafeOptimizer)
        assert type(safe) is not keras.optimizers.Adam and type(safe).__name__ == "Adam"
        assert safe.name == "my_adam" and safe.max_staleness == 2

    def test_attributes_read_and_write_as_on_the_plain_optimizer(self):
        def make():
            return keras.optimizers.Adam(
                0.01, beta_1=0.8, epsilon=1e-4, amsgrad=True, clipnorm=0.7, weight_decay=0.01
            )

        plain, safe = compiled(make()), compiled(SafeOptimizer(make()))
        names = [
            "name",
            "clipnorm",
            "clipvalue",
            "global_clipnorm",
            "weight_decay",
            "use_ema",
            "ema_momentum",
            "loss_scale_factor",
            "gradient_accumulation_steps",
            "beta_1",
            "beta_2",
            "epsilon",
            "amsgrad",
        ]
        assert {n: getattr(safe.optimizer, n) for n in names} == {
            n: getattr(plain.optimizer, n) for n in names
        } | {"name": safe.optimizer.name}
        for model in (plain, safe):  # setters reach the arithmetic
            opt = model.optimizer
            opt.beta_1, opt.epsilon, opt.clipnorm, opt.weight_decay = 0.5, 1e-3, 0.3, 0.2
            opt.learning_rate = 0.02
        assert (safe.optimizer.beta_1, float(safe.optimizer.learning_rate)) == (
            0.5,
            np.float32(0.02),
        )
        fit(plain), fit(safe)
        assert_same_training(plain, safe)

    def test_weight_decay_exclusion_holds(self):
        def model(optimizer, exclude):
            keras.utils.set_random_seed(3)
            m = keras.Sequential(
                [
                    keras.Input((8,)),
                    keras.layers.Dense(16),
                    keras.layers.LayerNormalization(),
                    keras.layers.Dense(1),
                ]
            )
            if exclude:
                optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
            m.compile(optimizer=optimizer, loss="mse")
            fit(m)
            return m

        def adamw():
            return keras.optimizers.AdamW(0.01, weight_decay=0.5)

        plain = model(adamw(), exclude=True)
        safe = model(SafeOptimizer(adamw()), exclude=True)
        assert_same_training(plain, safe)
        decayed = model(SafeOptimizer(adamw()), exclude=False)  # the exclusion matters here
        assert not np.array_equal(decayed.layers[0].bias.numpy(), safe.layers[0].bias.numpy())

    def test_loss_scale_optimizer_turns_the_loss_scale_factor_off(self, mode):
        # LossScaleOptimizer unscales the gradients itself and sets loss_scale_factor=None
        # on the optimizer it holds; otherwise the gradients would be unscaled twice.
        def run(make_safe):
            v = tf.Variable(INIT)
            sgd = keras.optimizers.SGD(0.1, loss_scale_factor=4.0)
            inner = SafeOptimizer(sgd) if make_safe else sgd
            opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=8.0)
            assert inner.loss_scale_factor is None
            step = mode(lambda g: opt.apply_gradients([(g, v)]))
            for g in GRADS[:3]:
                step(tf.constant(g * 8.0))
            return v.numpy()

        safe = run(make_safe=True)
        np.testing.assert_array_equal(safe, run(make_safe=False))
        np.testing.assert_allclose(safe, INIT - 0.1 * sum(GRADS[:3]), atol=1e-5)

    def test_multi_optimizer_sets_the_loss_scale_factor_of_safe_sub_optimizers(self):
        def run(make_safe):
            a, b = keras.Variable(INIT, name="a"), keras.Variable(INIT, name="b")
            subs = [keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.1)]
            if make_safe:
                subs = [SafeOptimizer(s) for s in subs]
            table = keras.optimizers.OptimizerMap(default_optimizer=subs[0])
            table["b"] = subs[1]
            multi = keras.optimizers.MultiOptimizer(table, loss_scale_factor=8.0)
            assert [s.loss_scale_factor for s in subs] == [8.0, 8.0]
            for g in GRADS[:3]:
                multi.apply_gradients([(g * 8.0, a), (g * 8.0, b)])
            return a.numpy(), b.numpy(), wrap(a).version, subs[0]

        (a, b, version, sub), (pa, pb, _, _) = run(True), run(False)
        np.testing.assert_array_equal(a, pa)
        np.testing.assert_array_equal(b, pb)
        np.testing.assert_allclose(a, INIT - 0.1 * sum(GRADS[:3]), atol=1e-5)  # once
        assert version == 3 and sub.statistics().calls == 3

    def test_optimizer_specific_methods(self):
        plain, safe = (
            compiled(keras.optimizers.Muon(0.01)),
            compiled(SafeOptimizer(keras.optimizers.Muon(0.01))),
        )
        x = tf.constant(RNG.normal(size=(4, 3)).astype("float32"))
        np.testing.assert_array_equal(
            safe.optimizer.zeropower_via_newtonschulz5(x, 5),
            plain.optimizer.zeropower_via_newtonschulz5(x, 5),
        )
        kernel = safe.trainable_variables[0]
        assert safe.optimizer._should_use_adamw(kernel) == plain.optimizer._should_use_adamw(
            plain.trainable_variables[0]
        )
        fit(plain), fit(safe)
        assert_same_training(plain, safe)

    def test_keras_warning_and_error_for_missing_gradients(self, mode):
        a, b = keras.Variable(INIT), tf.Variable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1))
        step = mode(lambda g: opt.apply_gradients([(g, a), (None, b)]))
        with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
            step(tf.constant(GRADS[0]))
        np.testing.assert_array_equal(b.numpy(), INIT)
        assert (wrap(a).version, wrap(b).version) == (1, 0)
        with pytest.raises(ValueError, match="No gradients provided for any variable"):
            opt.apply_gradients([(None, a), (None, b)])
        assert opt.statistics().calls == 1


# --------------------------------------------------------------------------- threads


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

    def test_variables_locked_by_a_traced_graph_keep_their_own_locks(self):
        # share_lock leaves a lock a traced graph uses alone: still correct, more mutexes.
        a, b = SafeVariable(INIT), SafeVariable(INIT)
        tf.function(lambda: a.assign_add(INIT), autograph=False)()
        opt = SafeOptimizer(keras.optimizers.SGD(0.1))
        opt.apply_gradients([(GRADS[0], a), (GRADS[0], b)])
        assert a.statistics().shared_by == 1
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
        tf.function(
            lambda: (a.assign_add(tf.zeros([3])), b.assign_add(tf.zeros([3]))), autograph=False
        )()
        opt = SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        opt.build([a, b])
        assert a.statistics().shared_by == b.statistics().shared_by == 1
        g = tf.constant([1.0, 2.0, 4.0])
        run_threads(4, lambda i: [opt.apply_gradients([(g, (a, b)[i % 2])]) for _ in range(50)])
        assert int(opt.iterations.numpy()) == opt.statistics().calls == 200
        assert a.version == b.version == 101


# --------------------------------------------------------------------------- accumulation


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


# --------------------------------------------------------------------------- saving


class TestSavingAndCheckpoints:
    def test_config_round_trip(self):
        opt = SafeOptimizer(
            keras.optimizers.Adam(0.003, name="a"),
            accumulate_steps=2,
            max_staleness=3,
            on_stale="scale",
            nonfinite="skip",
        )
        config = opt.get_config()
        assert config["beta_1"] == 0.9 and config["safevars"]["on_stale"] == "scale"
        for clone in (
            SafeOptimizer.from_config(config),
            type(opt).from_config(config),
            keras.optimizers.deserialize(keras.optimizers.serialize(opt)),
        ):
            assert clone.get_config() == config
            assert isinstance(clone, keras.optimizers.Adam)
            assert isinstance(clone, SafeOptimizer) and clone.accumulate_steps == 2
        legacy = {  # the config safevars 0.1 wrote
            "name": "safe_optimizer",
            "optimizer": keras.optimizers.serialize(keras.optimizers.Adam(0.003, name="a")),
            "accumulate_steps": 2,
            "max_staleness": 3,
            "on_stale": "scale",
            "nonfinite": "skip",
            "deterministic": True,
        }
        assert SafeOptimizer.from_config(legacy).get_config() == config

    def test_model_save_and_load_model(self, tmp_path):
        x, y = regression_data()
        model = small_model()
        model.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        model.fit(x, y, epochs=1, batch_size=64, verbose=0)
        path = os.path.join(tmp_path, "m.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert isinstance(loaded.optimizer, SafeOptimizer)
        assert loaded.optimizer.get_config() == model.optimizer.get_config()
        for a, b in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        # The counters are safevars' bookkeeping, not in the file: they start again.
        assert loaded.optimizer.statistics().calls == 0
        before = loaded.evaluate(x, y, verbose=0)
        loaded.fit(x, y, epochs=1, batch_size=64, verbose=0)
        assert loaded.evaluate(x, y, verbose=0) < before

    def test_checkpoint_restores_slots_iterations_and_counters(self, tmp_path):
        v = keras.Variable(INIT)
        opt = SafeOptimizer(keras.optimizers.Adam(0.1))
        for g in GRADS[:3]:
            opt.apply_gradients([(g, v)])
        path = tf.train.Checkpoint(v=v, optimizer=opt, safevars=opt.safevars_state).save(
            os.path.join(tmp_path, "ck")
        )
        saved = [x.numpy() for x in opt.variables]
        for g in GRADS[3:]:
            opt.apply_gradients([(g, v)])

        v2 = keras.Variable(np.zeros_like(INIT))
        opt2 = SafeOptimizer(keras.optimizers.Adam(0.1))
        opt2.build([v2])
        tf.train.Checkpoint(v=v2, optimizer=opt2, safevars=opt2.safevars_state).restore(
            path
        ).assert_consumed()
        for a, b in zip(saved, opt2.variables):
            np.testing.assert_array_equal(a, b.numpy())
        assert int(opt2.iterations.numpy()) == 3 and opt2.statistics().calls == 3
        for g in GRADS[3:]:  # Resuming gives the same result as not stopping.
            opt2.apply_gradients([(g, v2)])
        np.testing.assert_array_equal(v2.numpy(), v.numpy())


# --------------------------------------------------------------------------- state files


LAYOUT_CASES = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "sgd_momentum_ema": lambda: keras.optimizers.SGD(0.01, momentum=0.9, use_ema=True),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "keras_accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
}


class TestSameStateSameFiles:
    """A safe optimizer's variables and files are those of the plain optimizer."""

    @pytest.mark.parametrize("case", sorted(LAYOUT_CASES))
    @pytest.mark.parametrize("accumulate_steps", [1, 3])
    def test_variables_are_laid_out_as_the_plain_optimizers(self, case, accumulate_steps):
        if case == "keras_accumulation" and accumulate_steps > 1:
            pytest.skip("one kind of accumulation at a time (tested as refused)")
        plain = compiled(LAYOUT_CASES[case](), build=True)
        safe = compiled(
            SafeOptimizer(LAYOUT_CASES[case](), accumulate_steps=accumulate_steps), build=True
        )

        def layout(model):  # the slot's kind, shape and dtype, in order
            return [
                (re.sub(r"_\d+$", "", v.name).rsplit("_", 1)[-1], v.shape, v.dtype)
                for v in model.optimizer.variables
            ]

        assert layout(safe) == layout(plain)
        own = safe.optimizer.safevars_state.trainable_variables + tuple(
            safe.optimizer.safevars_state.non_trainable_variables
        )
        assert own and not {id(v) for v in own} & {id(v) for v in safe.optimizer.variables}

    def test_set_weights_between_plain_and_safe(self):
        plain = compiled(keras.optimizers.Adam(0.01))
        fit(plain)
        safe = compiled(SafeOptimizer(keras.optimizers.Adam(0.01)), build=True)
        safe.set_weights(plain.get_weights())
        safe.optimizer.set_weights([v.numpy() for v in plain.optimizer.variables])
        back = compiled(keras.optimizers.Adam(0.01), build=True)
        back.set_weights(plain.get_weights())
        back.optimizer.set_weights([v.numpy() for v in safe.optimizer.variables])
        assert int(safe.optimizer.iterations.numpy()) == 8
        for model in (plain, safe, back):
            fit(model)
        assert_same_training(plain, safe)
        assert_same_training(plain, back)

    def test_keras_files_plain_to_safe_and_back_continue_bitwise(self, tmp_path):
        plain = compiled(keras.optimizers.Adam(0.01))
        fit(plain)
        plain_file = str(tmp_path / "plain.keras")
        plain.save(plain_file)
        # A model compiled with a safe optimizer loads the plain file ...
        safe = compiled(SafeOptimizer(keras.optimizers.Adam(0.01)), seed=9, build=True)
        safe.load_weights(plain_file)
        # ... and a loaded plain model is upgraded by making its optimizer safe.
        upgraded = keras.models.load_model(plain_file)
        assert SafeOptimizer(upgraded.optimizer, max_staleness=4) is upgraded.optimizer
        safe_file = str(tmp_path / "safe.keras")
        safe.save(safe_file)
        # The reverse: a plain model loads the safe file (its variables, not its config).
        back = compiled(keras.optimizers.Adam(0.01), seed=9, build=True)
        back.load_weights(safe_file)
        reloaded = keras.models.load_model(safe_file)
        assert isinstance(reloaded.optimizer, SafeOptimizer)
        assert isinstance(reloaded.optimizer, keras.optimizers.Adam)
        assert int(upgraded.optimizer.iterations.numpy()) == 8
        models = (plain, safe, upgraded, back, reloaded)
        for model in models:
            fit(model)
        for model in models[1:]:
            assert_same_training(plain, model)
        assert upgraded.optimizer.statistics().calls == 8
        assert all(wrap(v).version == 8 for v in upgraded.trainable_variables)

    def test_made_safe_after_training_started_then_recompiled(self):
        # A train function traced before holds the plain update: compile again (the
        # optimizer keeps its state) so the next fit traces the safe one.
        model = compiled(keras.optimizers.Adam(0.01))
        fit(model)
        reference = compiled(keras.optimizers.Adam(0.01))
        fit(reference, epochs=2)
        model.compile(optimizer=SafeOptimizer(model.optimizer), loss="mse")
        fit(model)
        assert_same_training(reference, model)
        assert model.optimizer.statistics().calls == 8
        assert all(wrap(v).version == 8 for v in model.trainable_variables)

    @pytest.mark.parametrize("direction", ["plain_to_safe", "safe_to_plain"])
    def test_tf_checkpoints_both_ways_continue_bitwise(self, tmp_path, direction):
        def make(safe):
            optimizer = keras.optimizers.Adam(0.01)
            return compiled(SafeOptimizer(optimizer) if safe else optimizer, build=True)

        first = make(safe=direction == "safe_to_plain")
        fit(first)
        path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
            str(tmp_path / "ck")
        )
        second = make(safe=direction == "plain_to_safe")
        tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(
            path
        ).assert_consumed()
        assert isinstance(second.optimizer, SafeOptimizer) == (direction == "plain_to_safe")
        fit(first), fit(second)
        assert_same_training(first, second)


# --------------------------------------------------------------------------- mixed precision


class TestMixedPrecision:
    @pytest.fixture
    def mixed_policy(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        yield
        keras.mixed_precision.set_global_policy("float32")

    def test_mixed_float16_model_trains_through_loss_scale_optimizer(self, mixed_policy):
        x, y = regression_data()
        model = small_model()
        model.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
        # model.compile wraps it: LossScaleOptimizer(SafeOptimizer(Adam)).
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        safe = model.optimizer.inner_optimizer
        assert isinstance(safe, SafeOptimizer)
        losses = model.fit(x, y, epochs=3, batch_size=32, verbose=0).history["loss"]
        assert losses[-1] < losses[0] * 0.7, losses
        stats = safe.statistics()
        assert stats.calls == stats.applied == int(model.optimizer.iterations.numpy())
        assert 20 <= stats.calls <= 24  # the loss scaler may skip a few overflowing steps

    def test_loss_scale_optimizer_skips_nonfinite_before_the_section(self, mode):
        v = SafeVariable(INIT)
        safe = SafeOptimizer(keras.optimizers.SGD(0.1))
        opt = keras.optimizers.LossScaleOptimizer(safe, initial_scale=4.0)
        step = mode(lambda g: opt.apply_gradients([(g, v)]))
        step(tf.constant(np.full_like(INIT, np.inf)))
        assert v.version == 0 and safe.statistics().calls == 0
        np.testing.assert_array_equal(v.numpy(), INIT)
        step(tf.constant(GRADS[0] * 2.0))  # scale is now 2: unscaled gradient GRADS[0]
        np.testing.assert_allclose(v.numpy(), INIT - 0.1 * GRADS[0], atol=1e-6)
        assert v.version == 1 and safe.statistics().calls == 1

    def test_safe_optimizer_around_loss_scale_optimizer_in_a_custom_loop(self):
        v = SafeVariable(INIT)
        opt = SafeOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
        )
        assert float(opt.scale_loss(tf.constant(1.0))) == 8.0
        opt.apply_gradients([(tf.constant(GRADS[0] * 8.0), v)])
        np.testing.assert_allclose(v.numpy(), INIT - 0.1 * GRADS[0], atol=1e-6)
        assert v.version == 1


# --------------------------------------------------------------------------- nesting


class TestSafeOptimizersInsideOthers:
    """Safe optimizers held by a LossScaleOptimizer or MultiOptimizer that is safe too."""

    def test_loss_scale_optimizer_around_a_safe_one_made_safe(self, mode):
        def run(make_safe):
            v = tf.Variable(INIT)
            inner = keras.optimizers.SGD(0.1, momentum=0.5)
            inner = SafeOptimizer(inner) if make_safe else inner
            outer = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
            outer = SafeOptimizer(outer) if make_safe else outer
            step = mode(lambda g: outer.apply_gradients([(g, v)]))
            for g in GRADS[:4]:
                step(tf.constant(g * 4.0))
            return v, inner, outer

        v, inner, outer = run(make_safe=True)
        np.testing.assert_array_equal(v.numpy(), run(make_safe=False)[0].numpy())
        assert wrap(v).version == 4  # once per call, not once per safe optimizer
        assert outer.statistics().calls == inner.statistics().calls == 4

    def test_multi_optimizer_of_safe_optimizers_made_safe_under_threads(self):
        a, b = keras.Variable(tf.zeros([3]), name="a"), keras.Variable(tf.zeros([3]), name="b")
        first, second = (SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)) for _ in range(2))
        table = keras.optimizers.OptimizerMap(default_optimizer=first)
        table["b"] = second
        multi = SafeOptimizer(keras.optimizers.MultiOptimizer(table))
        multi.build([a, b])
        g = tf.constant([1.0, 2.0, 4.0])
        run_threads(4, lambda i: [multi.apply_gradients([(g, a), (g, b)]) for _ in range(10)])
        reference = tf.Variable(tf.zeros([3]))
        plain = keras.optimizers.SGD(0.1, momentum=0.9)
        for _ in range(40):
            plain.apply_gradients([(g, reference)])
        np.testing.assert_array_equal(a.numpy(), reference.numpy())
        np.testing.assert_array_equal(b.numpy(), reference.numpy())
        assert wrap(a).version == wrap(b).version == 40
        assert int(multi.iterations.numpy()) == 40
        assert first.statistics().calls == second.statistics().calls == 40


# --------------------------------------------------------------------------- staleness


class TestStaleness:
    def make(self, on_stale):
        v = SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(1.0), max_staleness=1, on_stale=on_stale)
        opt.apply_gradients([(GRADS[0], v)])
        opt.apply_gradients([(GRADS[0], v)])  # iterations 2, v.version 2
        return v, opt

    @pytest.mark.parametrize("as_snapshot", [False, True])
    def test_drop_counts_and_changes_nothing(self, mode, as_snapshot):
        v, opt = self.make("drop")
        old = v.snapshot() if as_snapshot else 0  # two updates ago: too stale

        def step(g):
            version = [old] if as_snapshot else old
            opt.apply_gradients([(g, v)], version=version)

        if as_snapshot:
            v.assign(INIT)  # version 3: the snapshot (version 2) is 1 behind: fresh enough
            mode(step)(tf.constant(GRADS[1]))
            assert v.version == 4 and opt.statistics().dropped_stale == 0
            old = v.snapshot()
            opt.apply_gradients([(GRADS[2], v)])
            opt.apply_gradients([(GRADS[2], v)])  # snapshot now 2 updates behind
        before = everything(opt, [v])
        mode(step)(tf.constant(GRADS[1]))
        after = everything(opt, [v])
        assert_same_state(before[:3], after[:3])
        assert after[3].dropped_stale == before[3].dropped_stale + 1
        assert after[3].calls == before[3].calls + 1

    def test_raise_refuses_and_changes_nothing(self):
        v, opt = self.make("raise")
        before = everything(opt, [v])
        with pytest.raises(StaleGradientError, match="2 updates stale"):
            opt.apply_gradients([(GRADS[1], v)], version=0)
        assert_same_state(before, everything(opt, [v]))
        opt.apply_gradients([(GRADS[1], v)], version=1)  # one behind: allowed
        assert v.version == 3

    def test_raise_in_a_graph_fails_at_run_time_and_changes_nothing(self):
        v, opt = self.make("raise")
        step = tf.function(
            lambda version: opt.apply_gradients([(GRADS[1], v)], version=version), autograph=False
        )
        before = everything(opt, [v])
        with pytest.raises(tf.errors.InvalidArgumentError, match="StaleGradientError"):
            step(tf.constant(0, tf.int64))
        assert_same_state(before, everything(opt, [v]))
        step(tf.constant(2, tf.int64))
        assert v.version == 3

    def test_scale_divides_by_staleness_plus_one(self, mode):
        v, opt = self.make("scale")
        start = v.numpy()
        mode(lambda g: opt.apply_gradients([(g, v)], version=0))(tf.constant(GRADS[1]))
        np.testing.assert_allclose(v.numpy(), start - GRADS[1] / 3.0, atol=1e-6)
        assert opt.statistics().scaled_stale == 1

    def test_drop_with_accumulation_in_a_graph(self, mode):
        v = SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=2, max_staleness=0)
        step = mode(lambda g, version: opt.apply_gradients([(g, v)], version=version))
        step(tf.constant(GRADS[0]), tf.constant(0, tf.int64))
        step(tf.constant(GRADS[1]), tf.constant(0, tf.int64))  # one real update
        step(tf.constant(GRADS[2]), tf.constant(0, tf.int64))  # stale: dropped
        np.testing.assert_allclose(v.numpy(), INIT - (GRADS[0] + GRADS[1]) / 2, atol=1e-6)
        stats = opt.statistics()
        assert (
            stats.calls,
            stats.applied,
            stats.accumulated,
            stats.dropped_stale,
            stats.pending,
        ) == (3, 1, 2, 1, 0)

    def test_version_from_the_future_or_malformed_is_refused(self):
        v, opt = self.make("drop")
        before = everything(opt, [v])
        with pytest.raises(InvalidArgumentError, match="ahead"):
            opt.apply_gradients([(GRADS[1], v)], version=5)
        with pytest.raises(InvalidArgumentError, match="version lists 2 entries"):
            opt.apply_gradients([(GRADS[1], v)], version=[0, 1])
        with pytest.raises(InvalidArgumentError, match="version"):
            opt.apply_gradients([(GRADS[1], v)], version="old")
        assert_same_state(before, everything(opt, [v]))


# --------------------------------------------------------------------------- bad input


class TestBadInputChangesNothing:
    def setup_method(self):
        self.a = SafeVariable(INIT)
        self.b = keras.Variable(np.ones(3, "float32"))
        self.opt = SafeOptimizer(keras.optimizers.Adam(0.1))
        self.opt.apply_gradients([(GRADS[0], self.a), (np.ones(3, "float32"), self.b)])

    @pytest.mark.parametrize(
        "case, error, match",
        [
            (
                "unknown",
                InvalidArgumentError,
                r"grads_and_vars\[1\]: Unknown variable .* built with",
            ),
            ("shape", ShapeMismatchError, r"grads_and_vars\[0\].*shape \[3, 4\]"),
            ("dtype", DTypeMismatchError, r"grads_and_vars\[1\].*int32"),
            ("twice", InvalidArgumentError, r"listed twice"),
            ("none", InvalidArgumentError, r"No gradient"),
            ("not_a_variable", InvalidArgumentError, r"grads_and_vars\[1\] must be a variable"),
            ("not_a_pair", InvalidArgumentError, r"grads_and_vars\[0\] must be a"),
        ],
    )
    def test_refused(self, case, error, match):
        a, b = self.a, self.b
        pairs = {
            "unknown": [(GRADS[1], a), (GRADS[1], tf.Variable(INIT))],
            "shape": [(np.ones((3, 4), "float32"), a)],
            "dtype": [(GRADS[1], a), (np.ones(3, "int32"), b)],
            "twice": [(GRADS[1], a), (GRADS[2], a)],
            "none": [(None, a), (None, b)],
            "not_a_variable": [(GRADS[1], a), (GRADS[1], INIT)],
            "not_a_pair": [GRADS[1]],
        }[case]
        before = everything(self.opt, [a, b])
        with pytest.raises(error, match=match):
            self.opt.apply_gradients(pairs)
        assert_same_state(before, everything(self.opt, [a, b]))

    def test_refused_while_tracing(self):
        step = tf.function(
            lambda: self.opt.apply_gradients([(tf.ones([3, 4]), self.a)]), autograph=False
        )
        with pytest.raises(ShapeMismatchError):
            step()

    @pytest.mark.parametrize("policy", ["skip", "raise"])
    def test_nonfinite_policy(self, mode, policy):
        opt = SafeOptimizer(keras.optimizers.Adam(0.1), nonfinite=policy)
        v = SafeVariable(INIT)
        opt.apply_gradients([(GRADS[0], v)])
        bad = GRADS[1].copy()
        bad[1, 2] = np.nan
        step = mode(lambda g: opt.apply_gradients([(g, v)]))
        before = everything(opt, [v])
        if policy == "skip":
            step(tf.constant(bad))
            after = everything(opt, [v])
            assert_same_state(before[:3], after[:3])
            assert after[3].skipped_nonfinite == 1 and after[3].applied == 1
        else:
            expected = (
                NonFiniteGradientError
                if mode.name == "eager"
                else (tf.errors.InvalidArgumentError)
            )
            with pytest.raises(expected, match="NaN or Inf"):
                step(tf.constant(bad))
            assert_same_state(before, everything(opt, [v]))
        step(tf.constant(GRADS[2]))
        assert v.version == 2

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"accumulate_steps": 0}, "accumulate_steps"),
            ({"max_staleness": -1}, "max_staleness"),
            ({"on_stale": "ignore"}, "on_stale"),
            ({"nonfinite": "zero"}, "nonfinite"),
            ({"clipnorm": 1.0}, "clipnorm"),
            ({"learning_rate": 0.1}, "learning_rate"),
            ({"deterministic": 1}, "deterministic"),
        ],
    )
    def test_constructor_arguments(self, kwargs, match):
        with pytest.raises(InvalidArgumentError, match=match):
            SafeOptimizer(keras.optimizers.SGD(), **kwargs)

    def test_constructor_refuses_unusable_optimizers_and_changes_nothing(self):
        with pytest.raises(InvalidArgumentError, match="keras.optimizers.Optimizer"):
            SafeOptimizer(object())
        with pytest.raises(InvalidArgumentError, match="already safe"):
            SafeOptimizer(SafeOptimizer(keras.optimizers.SGD()))
        twice = keras.optimizers.SGD(gradient_accumulation_steps=2)
        with pytest.raises(InvalidArgumentError, match="accumulate twice"):
            SafeOptimizer(twice, accumulate_steps=2)
        assert type(twice) is keras.optimizers.SGD  # a refused call changes nothing
        assert not hasattr(twice, "_safevars")
        built = keras.optimizers.SGD()
        built.build([tf.Variable(1.0)])
        with pytest.raises(InvalidArgumentError, match="already built on other variables"):
            SafeOptimizer(built).build([tf.Variable(2.0)])
        assert isinstance(SafeOptimizer("adam"), keras.optimizers.Adam)


# --------------------------------------------------------------------------- distribution


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


def test_serialized_names_are_stable():
    """What .keras files, configs and pickles record must not move with the code."""
    opt = SafeOptimizer(keras.optimizers.Adam(0.01), max_staleness=3)
    saved = keras.saving.serialize_keras_object(opt)
    assert (saved["module"], saved["class_name"], saved["registered_name"]) == (
        "safevars.optimizer",
        "Adam",
        "safevars>SafeOptimizer",
    )
    assert saved["config"]["safevars"]["optimizer"] == {
        "class_name": "Adam",
        "module": "keras.optimizers",
        "registered_name": None,
    }
    assert type(opt).__module__ == SafeOptimizer.__module__ == "safevars.optimizer"
    assert type(opt).__qualname__ == "SafeOptimizer[Adam]"
