"""One ``tf.function`` per variant (:mod:`benchmarks.tf_functions`): functions built from
one ``def`` and each traced once set off no retracing warning; a real retrace does."""

from __future__ import annotations

import logging

import pytest
import tensorflow as tf

from benchmarks.tf_functions import variant_function


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
