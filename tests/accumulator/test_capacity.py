"""GradientAccumulator(max_pending=...): storage made up front, adds past it refused.

Each refusal is checked to change nothing (rows, statistics, lock), in both buffer
layouts, eagerly, in a ``tf.function`` and under XLA; concurrent adds on a barrier are
admitted exactly up to the limit; and the traced add has no growth check left.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.accumulator import GradientAccumulator
from safevars.errors import AccumulatorFullError, InvalidArgumentError
from tests.support.accumulator import state
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads

SHAPE = [10, 3]


def refused(call, *args) -> str:
    """Runs ``call``, which must be refused for want of room; returns the message."""
    with pytest.raises((AccumulatorFullError, tf.errors.InvalidArgumentError)) as info:
        call(*args)
    message = str(info.value)
    assert "AccumulatorFullError" in message or isinstance(info.value, AccumulatorFullError)
    assert "max_pending" in message
    return message


def lock_is_free(acc: GradientAccumulator) -> bool:
    """Whether another thread can take the accumulator's lock at once (an eager add)."""
    done = []
    thread = threading.Thread(target=lambda: done.append(acc.add([tf.zeros(SHAPE)])))
    thread.start()
    thread.join(timeout=scaled(30))
    return not thread.is_alive() and done == [1]


class TestConstruction:
    def test_bad_max_pending_is_refused_naming_it(self):
        v = tf.Variable(tf.zeros([2]))
        for value in (0, -1, 1.5, "4", True):
            with pytest.raises(InvalidArgumentError, match="max_pending"):
                GradientAccumulator([v], max_pending=value)
        with pytest.raises(InvalidArgumentError, match="num_required=5 is more than"):
            GradientAccumulator([v], max_pending=4, num_required=5)

    @pytest.mark.usefixtures("layout")
    def test_storage_is_made_up_front_and_never_grows(self):
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=6, reduction="sum")
        block = acc._layout.chunks * acc._layout.width * 4
        assert acc.state_bytes == 6 * block  # six blocks, no more
        rows = acc._rows_shape().numpy().tolist()
        add = tf.function(lambda g: acc.add([g]), autograph=False)
        for i in range(6):
            add(tf.fill(SHAPE, float(i)))
        assert acc._rows_shape().numpy().tolist() == rows
        # Blocks kept by reference ("blocks"): the ones past them also keep the last
        # such piece alive in the sink (state.py), one block at most.
        extra = block if acc._references else 0
        assert acc.state_bytes == 6 * block + extra
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, 15.0))

    @pytest.mark.usefixtures("layout")
    def test_a_traced_add_has_no_growth_check(self):
        # What max_pending saves: the growth check is an If kernel (a function call)
        # at every traced add; the room check is one Assert kernel.
        v = tf.Variable(tf.zeros(SHAPE))
        ops = {}
        for limit in (None, 4):
            acc = GradientAccumulator([v], max_pending=limit)
            add = tf.function(lambda g, acc=acc: acc.add([g]), autograph=False)
            graph = add.get_concrete_function(tf.TensorSpec(SHAPE)).graph
            ops[limit] = [op.type for op in graph.get_operations()]
        assert "If" in ops[None] and "Assert" not in ops[None]
        assert not {"If", "StatelessIf", "Switch"} & set(ops[4])
        assert ops[4].count("Assert") == 1


@pytest.mark.usefixtures("layout")
class TestRefusal:
    @pytest.mark.parametrize("deterministic", [True, False])
    def test_an_add_past_max_pending_changes_nothing(self, mode, deterministic):
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=3, deterministic=deterministic)
        add = mode(lambda g: acc.add([g]))
        for i in range(3):
            assert int(add(tf.fill(SHAPE, float(i + 1)))) == 1
        before = state(acc)
        message = refused(add, tf.fill(SHAPE, 100.0))
        assert "3" in message
        assert state(acc) == before
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, 2.0))  # (1+2+3)/3
        assert lock_is_free(acc)  # the refusal released it; that add makes 1 pending
        assert acc.statistics().added == 4 and acc.count == 1

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_an_xla_call_that_may_not_fit_is_refused_before_it_runs(self, deterministic):
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=3, deterministic=deterministic)

        @tf.function(autograph=False, jit_compile=True)
        def add_two(a, b):
            acc.add([a])
            return acc.add([b])

        add_two(tf.fill(SHAPE, 1.0), tf.fill(SHAPE, 2.0))
        before = state(acc)
        # Two more may not fit beside the two pending (XLA drops run-time assertions:
        # the call is refused for what it may add, before it runs).
        refused(add_two, tf.fill(SHAPE, 5.0), tf.fill(SHAPE, 6.0))
        assert state(acc) == before
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, 1.5))
        add_two(tf.fill(SHAPE, 3.0), tf.fill(SHAPE, 4.0))  # room again
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, 3.5))

    def test_a_contribution_refused_at_run_time_fits_a_full_accumulator(self, mode):
        # A stale contribution dropped when the graph runs adds nothing: it is not
        # refused for room, and its rows go to a spare block nothing reads.
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=2, max_staleness=0, reduction="sum")
        add = mode(lambda g, version: acc.add([g], version=version))
        add(tf.fill(SHAPE, 1.0), 0)
        add(tf.fill(SHAPE, 2.0), 0)
        acc.take()  # version 1 now
        add(tf.fill(SHAPE, 3.0), 1)
        add(tf.fill(SHAPE, 4.0), 1)
        assert int(add(tf.fill(SHAPE, 50.0), 0)) == 0  # stale: dropped, full or not
        stats = acc.statistics()
        assert stats.pending == 2 and stats.dropped_stale == 1
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, 7.0))

    def test_concurrent_adds_are_admitted_exactly_up_to_the_limit(self, mode):
        threads, limit = 8, 5
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=limit, reduction="sum")
        add = mode(lambda g: acc.add([g]))
        add(tf.zeros(SHAPE))  # traced before the threads start
        acc.reset()
        admitted, refusals = [], []
        guard = threading.Lock()

        def worker(index: int) -> None:
            try:
                add(tf.fill(SHAPE, float(2**index)))
            except (AccumulatorFullError, tf.errors.InvalidArgumentError) as e:
                assert "AccumulatorFullError" in str(e) or isinstance(e, AccumulatorFullError)
                with guard:
                    refusals.append(index)
            else:
                with guard:
                    admitted.append(index)

        run_threads(threads, worker)
        assert len(admitted) == limit and len(refusals) == threads - limit
        stats = acc.statistics()
        assert stats.pending == limit and stats.added == limit + 1  # + the traced one
        # Exactly the admitted ones are in the sum: distinct powers of two identify them.
        want = float(sum(2**i for i in admitted))
        np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, want))


@pytest.mark.usefixtures("layout")
def test_a_checkpoint_with_fewer_rows_restores_into_the_full_storage(tmp_path):
    v = tf.Variable(tf.zeros(SHAPE))
    source = GradientAccumulator([v], reduction="sum")
    source.add([tf.fill(SHAPE, 1.0)])
    path = tf.train.Checkpoint(acc=source).save(str(tmp_path / "ckpt"))
    target = GradientAccumulator([v], reduction="sum", max_pending=8)
    size = target.state_bytes
    tf.train.Checkpoint(acc=target).restore(path).assert_consumed()
    assert target.count == 1 and target.state_bytes >= size
    add = tf.function(lambda g: target.add([g]), autograph=False)
    for i in range(7):  # every block of the storage is there to write
        add(tf.fill(SHAPE, 2.0**i))
    refused(add, tf.fill(SHAPE, 1.0))
    np.testing.assert_array_equal(target.take()[0], np.full(SHAPE, 128.0))


def test_the_error_is_exported():
    assert safevars.AccumulatorFullError is AccumulatorFullError
    assert issubclass(AccumulatorFullError, safevars.SafeVarsError)


@pytest.mark.usefixtures("layout")
@pytest.mark.parametrize("limit", [3, 5])  # "blocks": 3 all by reference; 5 past them
def test_replicas_refused_at_run_time_fit_a_full_accumulator(mirrored_strategy, limit):
    """Every replica's contribution refused when the graph runs (non-finite, skipped),
    with max_pending already reached: no failure, nothing added, their rows all go to
    the one spare block (or the sink, for blocks kept by reference)."""
    with mirrored_strategy.scope():
        v = tf.Variable(tf.zeros(SHAPE))
        acc = GradientAccumulator([v], max_pending=limit, nonfinite="skip", reduction="sum")
    for i in range(limit):
        acc.add([tf.fill(SHAPE, float(i + 1))])

    @tf.function(autograph=False)
    def step(value):
        return mirrored_strategy.run(lambda: acc.add([tf.fill(SHAPE, value)]))

    replicas = mirrored_strategy.num_replicas_in_sync
    assert replicas >= 2
    added = mirrored_strategy.experimental_local_results(step(tf.constant(np.nan)))
    assert added and all(int(a) == 0 for a in added)  # none accepted
    stats = acc.statistics()
    assert stats.pending == limit and stats.rejected == replicas
    total = limit * (limit + 1) / 2
    np.testing.assert_array_equal(acc.take()[0], np.full(SHAPE, total))
