"""SafeOptimizer's staleness policies (``max_staleness``, ``on_stale``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import (
    InvalidArgumentError,
    StaleGradientError,
)
from safevars.optimizer import SafeOptimizer
from safevars.variable import SafeVariable
from tests.support.optimizer import (
    GRADS,
    INIT,
    assert_same_state,
    everything,
)


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
