"""GradientAccumulator: stale contributions (``max_staleness``, ``on_stale``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.errors import (
    InvalidArgumentError,
    StaleGradientError,
)
from safevars.variable import SafeVariable
from tests.support.accumulator import as_int, state


class TestStaleness:
    def test_drop_against_the_accumulator_version(self, mode):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], max_staleness=1, reduction="sum")
        add = mode(lambda g, ver: acc.add([g], version=ver))
        one = tf.constant([1.0])
        assert acc.version == 0
        assert as_int(add(one, tf.constant(0))) == 1
        acc.take()
        assert acc.version == 1
        assert as_int(add(one, tf.constant(0))) == 1  # one version behind: fine
        acc.take()
        before = state(acc)
        assert as_int(add(one, tf.constant(0))) == 0  # two behind: dropped
        after = state(acc)
        assert after[0] == before[0]
        assert after[1].dropped_stale == 1 and after[1].added == before[1].added

    def test_raise_changes_nothing(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], max_staleness=0, on_stale="raise")
        acc.add([tf.constant([1.0])])
        acc.take()
        acc.add([tf.constant([5.0])], version=1)
        before = state(acc)
        with pytest.raises(StaleGradientError):
            acc.add([tf.constant([1.0])], version=0)
        with pytest.raises(ValueError):
            acc.add([tf.constant([1.0])], version=0)
        assert state(acc) == before
        graph_add = tf.function(lambda ver: acc.add([tf.constant([1.0])], version=ver))
        with pytest.raises(tf.errors.InvalidArgumentError, match="StaleGradientError"):
            graph_add(tf.constant(0))
        assert state(acc) == before
        assert as_int(graph_add(tf.constant(1))) == 1  # the lock was released
        np.testing.assert_array_equal(acc.take()[0], [3.0])

    def test_scale_by_one_over_staleness_plus_one(self, mode):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v], max_staleness=0, on_stale="scale", reduction="sum")
        for _ in range(3):
            acc.add([tf.zeros([2])])
            acc.take()
        assert acc.version == 3
        add = mode(lambda g, ver: acc.add([g], version=ver))
        add(tf.constant([8.0, 4.0]), tf.constant(3))  # fresh: as is
        add(tf.constant([8.0, 4.0]), tf.constant(2))  # 1 behind: / 2
        add(tf.constant([8.0, 4.0]), tf.constant(0))  # 3 behind: / 4
        assert acc.statistics().scaled == 2
        np.testing.assert_array_equal(acc.take()[0], [14.0, 7.0])

    @pytest.mark.parametrize("deterministic", [True, False])
    @pytest.mark.usefixtures("layout")
    def test_scale_divides_by_staleness_plus_one_exactly(self, mode, deterministic):
        v = tf.Variable(tf.zeros([3]))
        acc = GradientAccumulator(
            [v], max_staleness=0, on_stale="scale", reduction="sum", deterministic=deterministic
        )
        for _ in range(2):
            acc.add([tf.zeros([3])])
            acc.take()
        values = np.array([5.0, 7.0, 1.0], np.float32)
        mode(lambda g: acc.add([g], version=0))(tf.constant(values))  # 2 behind: / 3
        # A division, rounded once: 5 * (1 / 3) and 7 * (1 / 3) differ in the last bit.
        assert acc.take()[0].numpy().tobytes() == (values / np.float32(3)).tobytes()

    def test_a_version_from_the_future_is_not_stale(self, mode):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], max_staleness=0, on_stale="raise")
        add = mode(lambda ver: acc.add([tf.ones([1])], version=ver))
        assert as_int(add(tf.constant(5))) == 1  # the lag is clamped at 0
        assert acc.statistics().added == 1

    def test_refusal_on_a_parameter_server_comes_back_as_stale_gradient_error(self):
        # State on a parameter server: eager calls run as tf.functions (_run_remote) and
        # the staleness assertion fails inside; here in-process, marked remote.
        v = SafeVariable(tf.zeros([2]))
        acc = GradientAccumulator([v], max_staleness=0, on_stale="raise")
        acc._remote = True
        assert acc.add([tf.ones([2])], version=0) == 1
        v.assign_add([1.0, 1.0])
        before = state(acc)
        with pytest.raises(StaleGradientError) as raised:
            acc.add([tf.ones([2])], version=0)
        assert str(raised.value) == (
            "The gradients are 1 updates stale, more than max_staleness=0; nothing was "
            "accumulated. Recompute them from the current parameters, or pass on_stale=drop "
            "or on_stale=scale (checked on the parameter server; nothing of the call took "
            "effect)."
        )
        assert state(acc) == before
        assert acc.add([tf.ones([2])], version=1) == 1

    def test_scale_float_accumulator(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator(
            [v], max_staleness=0, on_stale="scale", reduction="sum", deterministic=False
        )
        acc.add([tf.zeros([1])])
        acc.take()
        acc.add([tf.constant([6.0])], version=0)
        acc.add([tf.constant([6.0])], version=1)
        np.testing.assert_array_equal(acc.take()[0], [9.0])

    def test_safe_variable_versions_and_snapshots(self, mode):
        a = SafeVariable(tf.zeros([2]))
        b = SafeVariable(tf.zeros([]))
        acc = GradientAccumulator([a, b], max_staleness=0)
        snaps = [a.snapshot(), b.snapshot()]
        a.assign_add([1.0, 1.0])  # a moves on: gradients from snaps are 1 behind
        assert acc.version == 1
        add = mode(lambda: acc.add([tf.ones([2]), tf.constant(1.0)], version=snaps))
        assert as_int(add()) == 0
        fresh = [a.snapshot(), b.snapshot()]
        assert acc.add([tf.ones([2]), tf.constant(1.0)], version=fresh) == 1
        assert acc.add([tf.ones([2]), tf.constant(1.0)], version=[1, 0]) == 1
        assert acc.add([tf.ones([2]), tf.constant(1.0)], version=0) == 0  # vs max = 1
        stats = acc.statistics()
        assert stats.added == 2 and stats.dropped_stale == 2

    def test_malformed_versions(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], max_staleness=0)
        before = state(acc)
        for bad in (-1, 1.5, True, "3", [[0]]):
            with pytest.raises(InvalidArgumentError):
                acc.add([tf.ones([1])], version=bad)
        with pytest.raises(InvalidArgumentError, match="SafeVariables"):
            acc.add([tf.ones([1])], version=[0])
        assert state(acc) == before
