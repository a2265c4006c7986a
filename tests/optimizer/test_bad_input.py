"""SafeOptimizer: bad input is refused and changes nothing."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
)
from safevars.optimizer import SafeOptimizer
from safevars.variable import SafeVariable
from tests.support.optimizer import (
    GRADS,
    INIT,
    assert_same_state,
    everything,
)


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
