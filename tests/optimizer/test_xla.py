"""SafeOptimizer inside XLA-compiled functions (``jit_compile=True``, Keras' GPU default).

XLA cannot compile mutex ops, so a section traced inside a compiled function records its
locks and the locks are taken around the compiled call (``safevars.sections``). These
tests check what users see: ``model.compile(jit_compile=True)`` and a custom compiled step
train, concurrent compiled steps never interleave (``iterations`` exact, the weights those
of the serial order the steps took), the ``"raise"`` policies, whose run-time
assertions XLA drops, are refused instead of silently applied, and ``accumulate_steps``
trains with either accumulation (exact or running sum). On CPU here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import InvalidArgumentError
from safevars.optimizer import SafeOptimizer
from safevars.variable import SafeVariable, wrap
from tests.support.threading_harness import run_threads

RNG = np.random.default_rng(7)
INIT = RNG.normal(size=(4, 3)).astype("float32")
GRADS = [RNG.normal(size=(4, 3)).astype("float32") for _ in range(4)]


def regression_data(n: int = 128) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")


def model(optimizer) -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )
    m.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    return m


def test_model_compile_with_jit_compile_trains():
    x, y = regression_data()
    safe, plain = (
        model(SafeOptimizer(keras.optimizers.Adam(0.01))),
        model(keras.optimizers.Adam(0.01)),
    )
    losses = safe.fit(x, y, epochs=3, batch_size=32, verbose=0).history["loss"]
    plain.fit(x, y, epochs=3, batch_size=32, verbose=0)
    assert safe.jit_compile and losses[-1] < 0.7 * losses[0], losses
    stats = safe.optimizer.statistics()
    assert stats.calls == stats.applied == int(safe.optimizer.iterations.numpy()) == 12
    assert all(wrap(v).version == 12 for v in safe.trainable_variables)
    for a, b in zip(safe.get_weights(), plain.get_weights()):  # the same arithmetic
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_custom_compiled_step_calling_apply_gradients_trains():
    x, y = (tf.constant(a) for a in regression_data())
    m = model(SafeOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)))
    opt = m.optimizer
    opt.build(m.trainable_variables)

    @tf.function(jit_compile=True)
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    losses = [float(step()) for _ in range(10)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert int(opt.iterations.numpy()) == opt.statistics().applied == 10
    assert all(wrap(v).version == 10 for v in m.trainable_variables)


def test_compiled_step_called_from_another_tf_function():
    v = SafeVariable(INIT)
    opt = SafeOptimizer(keras.optimizers.Adam(0.1))
    opt.build([v])
    compiled = tf.function(lambda g: opt.apply_gradients([(g, v)]), jit_compile=True)
    outer = tf.function(lambda g: compiled(g))
    for g in GRADS:
        outer(tf.constant(g))
    assert v.version == int(opt.iterations.numpy()) == len(GRADS)


def test_four_threads_of_compiled_steps_equal_their_serial_order():
    threads, calls = 4, 15

    def compiled_step():
        v = SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
        opt.build([v])

        @tf.function(jit_compile=True)
        def step(g):
            opt.apply_gradients([(g, v)])
            return tf.convert_to_tensor(opt.iterations)  # this step's place in the order

        return v, opt, step

    v, opt, step = compiled_step()
    grads = [tf.constant(g) for g in GRADS]
    order: list[tuple[int, int]] = []

    def work(index: int) -> None:
        for _ in range(calls):
            order.append((int(step(grads[index])), index))

    run_threads(threads, work)
    places = sorted(place for place, _ in order)
    assert places == list(range(1, threads * calls + 1))  # each step saw the state whole
    assert int(opt.iterations.numpy()) == v.version == threads * calls
    # The momentum makes the result depend on the order: replay the order the steps
    # took, one at a time, with the same compiled step on a fresh optimizer.
    replay_v, _, replay = compiled_step()
    for _, index in sorted(order):
        replay(grads[index])
    np.testing.assert_array_equal(v.numpy(), replay_v.numpy())


@pytest.mark.parametrize(
    "policy", [{"nonfinite": "raise"}, {"max_staleness": 0, "on_stale": "raise"}]
)
def test_raise_policies_are_refused_under_xla_and_change_nothing(policy):
    v = SafeVariable(INIT)
    opt = SafeOptimizer(keras.optimizers.SGD(0.1), **policy)
    opt.build([v])
    step = tf.function(
        lambda g: opt.apply_gradients([(g, v)], version=tf.constant(0, tf.int64)), jit_compile=True
    )
    with pytest.raises(InvalidArgumentError, match="XLA"):
        step(tf.constant(GRADS[0]))
    np.testing.assert_array_equal(v.numpy(), INIT)
    assert v.version == 0 and opt.statistics().calls == 0


@pytest.mark.parametrize("deterministic", [True, False])
def test_accumulate_steps_under_xla_trains_like_without(deterministic):
    """accumulate_steps=2 inside model.compile(jit_compile=True), with the exact
    accumulation or a running sum: two calls per update, nothing left pending, the
    weights of the same model compiled without XLA (XLA's own gradients may differ in the
    last bits)."""
    x, y = regression_data()
    models = [
        model(
            SafeOptimizer(
                keras.optimizers.SGD(0.05), accumulate_steps=2, deterministic=deterministic
            )
        )
        for _ in range(2)
    ]
    compiled, plain = models
    plain.compile(optimizer=plain.optimizer, loss="mse", jit_compile=False)
    for m in models:
        m.fit(x, y, epochs=2, batch_size=32, verbose=0)
    assert compiled.jit_compile and not plain.jit_compile
    stats = compiled.optimizer.statistics()
    assert stats.calls == 8 and int(compiled.optimizer.iterations.numpy()) == 4
    accumulator = compiled.optimizer.safevars_state.accumulator
    assert accumulator.statistics().taken == 8 and accumulator.count == 0
    for a, b in zip(compiled.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_deterministic_accumulation_in_a_compiled_step_takes_the_eager_mean():
    """A custom compiled step with accumulate_steps=4: after four calls the variable
    moved by the mean of the four gradients, as the same optimizer used eagerly."""
    results = []
    for jit in (True, False):
        v = SafeVariable(INIT)
        opt = SafeOptimizer(keras.optimizers.SGD(0.1), accumulate_steps=4)
        opt.build([v])
        step = lambda g, opt=opt, v=v: opt.apply_gradients([(g, v)])  # noqa: E731
        if jit:
            step = tf.function(step, jit_compile=True)
        for g in GRADS:
            step(tf.constant(g))
        assert int(opt.iterations.numpy()) == 1 and v.version == 1
        results.append(v.numpy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results[1], INIT - 0.1 * np.mean(GRADS, axis=0), rtol=1e-6)
