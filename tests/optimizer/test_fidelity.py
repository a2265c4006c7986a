"""SafeOptimizer is the optimizer it makes safe: the same results, the same attributes and
calls, under mixed precision, and inside other optimizers."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.optimizer import OptimizerStatistics, SafeOptimizer
from safevars.variable import SafeVariable, wrap
from tests.support.optimizer import (
    GRADS,
    INIT,
    OPTIMIZERS,
    RNG,
    assert_same_training,
    compiled,
    fit,
    regression_data,
    small_model,
)
from tests.support.threading_harness import run_threads

NEEDS_MULTI_OPTIMIZER = pytest.mark.skipif(
    not hasattr(keras.optimizers, "MultiOptimizer"),
    reason=f"keras.optimizers.MultiOptimizer is new in Keras 3.15 (found {keras.__version__})",
)


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

    @NEEDS_MULTI_OPTIMIZER
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
        try:
            fit(plain)
        except AttributeError as error:  # Keras before 3.13: Muon reads variable.path
            pytest.skip(f"plain Keras {keras.__version__}'s Muon cannot fit here: {error}")
        fit(safe)
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

    @NEEDS_MULTI_OPTIMIZER
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
