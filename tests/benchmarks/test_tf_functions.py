"""One ``tf.function`` per variant (:mod:`benchmarks.tf_functions`): functions built from
one ``def`` and each traced once set off no retracing warning; a real retrace does. The
``tf.CriticalSection`` reference step trains as the plain one and loses no update."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

from benchmarks.tf_functions import critical_section_step, training_step, variant_function
from tests.support.threading_harness import run_threads


def build(make) -> list:
    """Six functions from one ``def``, each closing over a variable of its own."""
    functions = []
    for i in range(6):
        variable = tf.Variable(float(i))

        def read(v=variable):
            return v.read_value() + 1.0

        functions.append(make(read))
    return functions


def retracing_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "triggered tf.function retracing" in r.getMessage()
    ]


@pytest.fixture
def caplog_tf(caplog):
    caplog.set_level(logging.WARNING, logger="tensorflow")
    logger = logging.getLogger("tensorflow")
    propagate, logger.propagate = logger.propagate, True  # caplog listens at the root
    yield caplog
    logger.propagate = propagate


def test_plain_tf_functions_from_one_def_warn(caplog_tf):
    """The false alarm :func:`variant_function` avoids (this test shows it exists)."""
    for function in build(lambda f: tf.function(f, autograph=False)):
        function()
    assert retracing_warnings(caplog_tf)


def test_variant_functions_from_one_def_do_not_warn(caplog_tf):
    functions = build(lambda f: variant_function(f, autograph=False))
    for function in functions:
        assert float(function()) >= 1.0
    assert retracing_warnings(caplog_tf) == []
    assert [f.experimental_get_tracing_count() for f in functions] == [1] * 6


def test_a_variant_function_that_really_retraces_still_warns(caplog_tf):
    @variant_function(autograph=False)
    def double(x):
        return x * 2

    for n in range(1, 8):  # a new shape every call: a new trace every call
        double(tf.zeros([n]))
    assert retracing_warnings(caplog_tf)


# ------------------------------------------------- the tf.CriticalSection reference step


def _trainer(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)]
    )
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(seed)
    x = tf.constant(rng.normal(size=(32, 16)).astype("float32"))
    y = tf.reduce_sum(x, axis=1, keepdims=True)
    return model, optimizer, x, y


@pytest.mark.parametrize("span", ["step", "update"])
def test_the_critical_section_step_trains_as_the_plain_step(span):
    """The ``threads`` and ``scope`` families' ``tf.CriticalSection`` reference computes
    the step :func:`training_step` computes, under the lock."""
    plain_model, plain_opt, x, y = _trainer()
    model, optimizer, _, _ = _trainer()
    plain, locked = (
        training_step(plain_model, plain_opt, x, y),
        critical_section_step(model, optimizer, x, y, span),
    )
    for _ in range(3):
        assert float(locked()) == pytest.approx(float(plain()), rel=1e-6)
    for a, b in zip(model.weights, plain_model.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert int(optimizer.iterations) == 3


@pytest.mark.parametrize("span", ["step", "update"])
def test_the_critical_section_step_loses_no_update_under_threads(span):
    """The reference is a real lock: Keras counts ``iterations`` with a read then a write,
    and 4 threads stepping at once lose none of them (the reference lost 3-21 of 32-64
    when ``execute``'s function returned the loss without waiting for the update)."""
    model, optimizer, x, y = _trainer()
    step = critical_section_step(model, optimizer, x, y, span)
    step()
    threads, steps = 4, 40
    run_threads(threads, lambda _: [step() for _ in range(steps)])
    assert int(optimizer.iterations) == 1 + threads * steps
