"""GradientAccumulator under MirroredStrategy (two logical CPUs in this process)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from tests.support.accumulator import hard_contributions


class TestMirroredStrategy:
    def make(self, strategy, **kwargs):
        with strategy.scope():
            v = tf.Variable(tf.zeros([3]))
            acc = GradientAccumulator([v], **kwargs)
        return acc

    @staticmethod
    def replica_gradient():
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        return tf.cast(rid + 1, tf.float32) * tf.constant([1.0, 10.0, 100.0])

    @pytest.mark.usefixtures("layout")
    def test_every_replica_counts_once_and_take_reduces(self, mirrored_strategy):
        acc = self.make(mirrored_strategy)

        @tf.function(autograph=False)
        def step():
            return mirrored_strategy.run(lambda: acc.add([self.replica_gradient()]))

        added = mirrored_strategy.experimental_local_results(step())
        assert {int(n) for n in added} == {2}  # every replica sees the total
        step()
        assert acc.count == 4
        np.testing.assert_array_equal(acc.take()[0], [1.5, 15.0, 150.0])
        assert acc.statistics().added == 4

    def test_take_inside_run_gives_every_replica_the_same(self, mirrored_strategy):
        acc = self.make(mirrored_strategy, reduction="sum")

        @tf.function(autograph=False)
        def step():
            def replica():
                acc.add([self.replica_gradient()])
                return tf.identity(acc.take()[0])  # one tensor per replica

            return mirrored_strategy.run(replica)

        results = mirrored_strategy.experimental_local_results(step())
        assert len(results) == 2
        for r in results:
            np.testing.assert_array_equal(r, [3.0, 30.0, 300.0])
        assert acc.statistics().taken == 2 and acc.statistics().takes == 1

    @pytest.mark.usefixtures("layout")
    def test_eager_run_and_per_replica_values(self, mirrored_strategy):
        acc = self.make(mirrored_strategy, reduction="sum")
        mirrored_strategy.run(lambda: acc.add([self.replica_gradient()]))
        per_replica = mirrored_strategy.run(self.replica_gradient)
        assert acc.add([per_replica]) == 2
        np.testing.assert_array_equal(acc.take()[0], [6.0, 60.0, 600.0])

    @pytest.mark.usefixtures("layout")
    def test_a_refused_replica_leaves_no_hole(self, mirrored_strategy):
        """nonfinite="skip" in a graph: replica 0's contribution is refused when the
        step runs, replica 1's is accepted in the same commit; the accepted one lands in
        the first free block, so take reads exactly it (and the earlier one)."""
        with mirrored_strategy.scope():
            v = tf.Variable(tf.zeros([3, 3]))
            acc = GradientAccumulator([v], nonfinite="skip", reduction="sum")
        acc.add([tf.ones([3, 3])])

        @tf.function(autograph=False)
        def step():
            def replica():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                bad = tf.fill([3, 3], np.float32(np.nan))
                return acc.add([tf.where(rid == 0, bad, 2.0 * tf.ones([3, 3]))])

            return mirrored_strategy.run(replica)

        added = mirrored_strategy.experimental_local_results(step())
        assert {int(n) for n in added} == {1}
        stats = acc.statistics()
        assert (stats.pending, stats.rejected) == (2, 1)
        np.testing.assert_array_equal(acc.take()[0], np.full([3, 3], 3.0))

    @pytest.mark.usefixtures("layout")
    def test_matches_single_device_bitwise(self, mirrored_strategy):
        grads = hard_contributions(2, 3, seed=9)
        acc = self.make(mirrored_strategy)

        @tf.function(autograph=False)
        def step():
            def replica():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                return acc.add([tf.gather(tf.constant(np.stack(grads)), rid)])

            return mirrored_strategy.run(replica)

        step()
        distributed = acc.take()[0].numpy()
        single = GradientAccumulator([tf.Variable(tf.zeros([3]))])
        single.add([tf.constant(grads[1])])
        single.add([tf.constant(grads[0])])
        assert single.take()[0].numpy().tobytes() == distributed.tobytes()
