"""GradientAccumulator.add_and_take: add then take as one atomic step.

The result is checked bit for bit against ``add`` then ``take`` in every mode and
layout, on the direct paths (the contribution read where it is: one reduction per piece
waiting only for its own gradient, or with one-row blocks one reduction with the
buffer's rows) and the generic one (stored, then taken); threads on
a barrier check that every contribution is taken exactly once; refusals change nothing.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.errors import (
    AccumulatorFullError,
    AccumulatorTimeoutError,
    InvalidArgumentError,
)
from tests.support.accumulator import hard_contributions, state
from tests.support.graph_walk import ancestors
from tests.support.threading_harness import run_threads

SHAPES = ([6, 5], [7])  # "blocks" (test_accumulator.layout): a direct piece and a packed one


def contributions(count: int, seed: int) -> list[list[np.ndarray]]:
    """``count`` contributions for SHAPES whose float32 sums depend on the order."""
    flat = hard_contributions(count, sum(int(np.prod(s)) for s in SHAPES), seed)
    out = []
    for c in flat:
        first = int(np.prod(SHAPES[0]))
        out.append([c[:first].reshape(SHAPES[0]), c[first:].reshape(SHAPES[1])])
    return out


def variables() -> list[tf.Variable]:
    return [tf.Variable(tf.zeros(s)) for s in SHAPES]


def compile_mode(name: str):
    if name == "eager":
        return lambda fn: fn
    return lambda fn: tf.function(fn, autograph=False, jit_compile=(name == "xla"))


def bits(result) -> list[bytes]:
    return [t.numpy().tobytes() for t in result]


@pytest.mark.usefixtures("layout")
class TestSameAsAddThenTake:
    @pytest.mark.parametrize("run", ["eager", "tf_function", "xla"])
    @pytest.mark.parametrize("max_pending", [None, 4])
    def test_same_bits_and_statistics_in_six_arrival_orders(self, run, max_pending):
        grads = contributions(4, seed=3)
        reference = GradientAccumulator(variables())
        for g in grads:
            reference.add(g)
        want = bits(reference.take())
        acc = GradientAccumulator(variables(), max_pending=max_pending)
        wrap = compile_mode(run)
        add = wrap(lambda g: acc.add(g))
        add_and_take = wrap(lambda g: acc.add_and_take(g))
        for round_, order in enumerate(itertools.islice(itertools.permutations(range(4)), 6)):
            for i in order[:3]:
                add([tf.constant(x) for x in grads[i]])
            got = add_and_take([tf.constant(x) for x in grads[order[3]]])
            assert bits(got) == want, order
            stats = acc.statistics()
            assert stats.pending == 0
            assert stats.added == stats.taken == 4 * (round_ + 1)
            assert stats.takes == round_ + 1

    def test_alone_it_returns_its_own_contribution(self, mode):
        acc = GradientAccumulator(variables(), max_pending=4)
        grads = contributions(1, seed=5)[0]
        got = mode(lambda g: acc.add_and_take(g))([tf.constant(x) for x in grads])
        for out, g in zip(got, grads):
            np.testing.assert_array_equal(out, g)


class TestDirectPath:
    # A kernel of whole 4-element rows (stored directly, no tail in the packed piece)
    # and a bias (packed).
    SHAPES = ([8, 4], [7])

    def _traced(self, monkeypatch, max_pending=4, **kwargs):
        from safevars.accumulator import state as accumulator_state

        monkeypatch.setattr(accumulator_state, "_CHUNK", 4)
        monkeypatch.setattr(accumulator_state, "_DIRECT", 8)
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros(s)) for s in self.SHAPES], max_pending=max_pending, **kwargs
        )

        @tf.function(autograph=False)
        def step(a, b):
            # Two separately computed gradients: the direct piece's reduction must not
            # wait for the packed piece's gradient.
            return acc.add_and_take([tf.sin(a) * 2.0, tf.cos(b) + 1.0])

        specs = [tf.TensorSpec(s) for s in self.SHAPES]
        return acc, step, step.get_concrete_function(*specs).graph

    def test_it_stores_nothing_and_each_piece_waits_only_for_its_gradient(self, monkeypatch):
        acc, step, graph = self._traced(monkeypatch)
        ops = graph.get_operations()
        types = [op.type for op in ops]
        assert types.count("MutexLock") == 1  # one section for the add and the take
        assert "ResourceScatterUpdate" not in types  # this contribution is not stored
        calls = [op for op in ops if op.type in ("StatefulPartitionedCall", "PartitionedCall")]
        assert len(calls) == len(acc._layout.firsts) == 2  # one compiled reduction per piece
        sin = next(op for op in ops if op.type == "Sin")
        cos = next(op for op in ops if op.type == "Cos")
        waits = [(sin in ancestors(c), cos in ancestors(c)) for c in calls]
        assert sorted(waits) == [(False, True), (True, False)]
        # And the result is the mean of what was pending and this contribution.
        shapes = self.SHAPES
        acc.add([tf.ones(shapes[0]), tf.ones(shapes[1])])
        a, b = np.full(shapes[0], 0.5, np.float32), np.full(shapes[1], 0.25, np.float32)
        kernel, bias = step(tf.constant(a), tf.constant(b))
        np.testing.assert_array_equal(kernel, (1.0 + np.sin(a) * 2.0) / 2)
        np.testing.assert_array_equal(bias, (1.0 + (np.cos(b) + 1.0)) / 2)

    def test_the_generic_path_stores_then_takes(self, monkeypatch):
        # Without max_pending, or with more than the blocks kept by reference, a pending
        # block may be in the buffer: the contribution is stored, then all are reduced.
        for limit in (None, 6):
            acc, _, graph = self._traced(monkeypatch, max_pending=limit)
            types = [op.type for op in graph.get_operations()]
            assert types.count("MutexLock") == 1
            assert "ResourceScatterUpdate" in types


class TestRowsPath:
    """One-row blocks, none kept by reference (the "one_row" layout of small models):
    with ``max_pending`` a traced ``add_and_take`` reads its contribution where the
    gradients were packed, with the buffer's rows, in one compiled call."""

    def _traced(self, max_pending=4, **kwargs):
        acc = GradientAccumulator(variables(), max_pending=max_pending, **kwargs)
        step = tf.function(lambda a, b: acc.add_and_take([a, b]), autograph=False)
        graph = step.get_concrete_function(*[tf.TensorSpec(s) for s in SHAPES]).graph
        return acc, step, graph

    def test_it_stores_nothing_and_reduces_in_one_compiled_call(self):
        acc, step, graph = self._traced()
        assert acc._references == 0 and acc._layout.chunks == 1
        types = [op.type for op in graph.get_operations()]
        assert types.count("MutexLock") == 1
        assert "ResourceScatterUpdate" not in types  # this contribution is not stored
        assert types.count("StatefulPartitionedCall") + types.count("PartitionedCall") == 1
        grads = contributions(4, seed=11)
        for g in grads[:3]:
            acc.add(g)
        before = acc._rows().numpy()
        got = step(*[tf.constant(x) for x in grads[3]])
        reference = GradientAccumulator(variables())
        for g in grads:
            reference.add(g)
        assert bits(got) == bits(reference.take())
        np.testing.assert_array_equal(acc._rows().numpy(), before)  # the buffer untouched
        assert acc.statistics().pending == 0

    def test_other_settings_store_then_take(self):
        # No max_pending (the buffer may grow), a staleness policy, or skipped
        # non-finite contributions (decided as the graph runs): stored, then taken.
        for kwargs in ({"max_pending": None}, {"max_staleness": 2}, {"nonfinite": "skip"}):
            _, _, graph = self._traced(**kwargs)
            assert "ResourceScatterUpdate" in [op.type for op in graph.get_operations()], kwargs

    def test_restored_past_max_pending_it_is_refused_and_take_reduces_all(self, tmp_path):
        # A checkpoint of an unbounded accumulator with 6 pending, restored into one with
        # max_pending=4: add_and_take is refused (nothing changes), take reduces all 6
        # (past the sorted sum of up to four).
        grads = contributions(6, seed=13)
        unbounded = GradientAccumulator(variables())
        for g in grads:
            unbounded.add(g)
        path = tf.train.Checkpoint(acc=unbounded).save(str(tmp_path / "ckpt"))
        want = bits(unbounded.take())
        acc, step, _ = self._traced()
        tf.train.Checkpoint(acc=acc).restore(path).assert_consumed()
        before = state(acc)
        extra = contributions(1, seed=14)[0]
        with pytest.raises(tf.errors.InvalidArgumentError, match="AccumulatorFullError"):
            step(*[tf.constant(x) for x in extra])
        assert state(acc) == before
        assert bits(tf.function(acc.take, autograph=False)()) == want


@pytest.mark.usefixtures("layout")
def test_a_failed_reduction_changes_nothing():
    """A traced ``add_and_take`` whose reduction fails at run time (a fault injected
    after the compiled call: an op of the step failing, or the call itself) leaves the
    accumulator as it was, on the direct paths too, where the contribution is never
    stored: the counters change once, after the reduction. The next call then takes
    the pending contributions and its own."""
    grads = contributions(4, seed=17)
    acc = GradientAccumulator(variables(), max_pending=4)
    fail = tf.Variable(True)
    methods = ("_reduce_rows_with", "_reduce_with")
    originals = {name: getattr(acc, name) for name in methods}

    def failing(original):
        def reduce(*args):
            result = original(*args)
            flat = tf.nest.flatten(result)
            # Fails once the reduction has run, with no assertion (tf.function orders
            # assertions one after another, which would hold the add's own check back).
            size = tf.size(flat[0])
            checked = tf.reshape(flat[0], tf.where(fail, size + 1, size)[None])
            flat[0] = tf.reshape(checked, tf.shape(flat[0]))
            return tf.nest.pack_sequence_as(result, flat)

        return reduce

    for name in methods:
        setattr(acc, name, failing(originals[name]))
    step = tf.function(lambda g: acc.add_and_take(g), autograph=False)
    specs = [tf.TensorSpec(s) for s in SHAPES]
    types = [op.type for op in step.get_concrete_function(specs).graph.get_operations()]
    assert "ResourceScatterUpdate" not in types  # a direct path: nothing stored
    for g in grads[:3]:
        acc.add(g)
    before = state(acc)
    with pytest.raises(tf.errors.InvalidArgumentError, match="reshape"):
        step([tf.constant(x) for x in grads[3]])
    assert state(acc) == before
    assert acc.statistics().pending == 3
    fail.assign(False)
    reference = GradientAccumulator(variables())
    for g in grads:
        reference.add(g)
    assert bits(step([tf.constant(x) for x in grads[3]])) == bits(reference.take())
    stats = acc.statistics()
    assert (stats.pending, stats.added, stats.taken, stats.takes) == (0, 4, 4, 1)


@pytest.mark.usefixtures("layout")
class TestConcurrency:
    # Each thread adds, then adds and takes: at most 3 of its adds and 1 more are
    # pending at once, so max_pending=4 (the direct path, "blocks" in a tf.function)
    # never refuses one.
    THREADS = 3
    ROUNDS = 25

    @pytest.mark.parametrize("max_pending", [None, 4])
    def test_every_contribution_is_taken_exactly_once(self, mode, max_pending):
        """Threads started on a barrier add and add_and_take at once; the sums they take
        plus a last take are exactly what was added: none lost, none taken twice. Values
        are integers, so float32 sums are exact whatever the order."""
        acc = GradientAccumulator(variables(), reduction="sum", max_pending=max_pending)
        add = mode(lambda g: acc.add(g))
        add_and_take = mode(lambda g: acc.add_and_take(g))
        taken: list[float] = []
        guard = threading.Lock()

        def contribution(value: float) -> list[tf.Tensor]:
            return [tf.fill(SHAPES[0], value), tf.fill(SHAPES[1], -value)]

        def worker(index: int) -> None:
            for i in range(self.ROUNDS):
                value = float(index * 1000 + 2 * i + 1)
                add(contribution(value))
                result = add_and_take(contribution(value + 1))
                kernel, bias = (float(t.numpy().flat[0]) for t in result)
                assert bias == -kernel
                with guard:
                    taken.append(kernel)

        run_threads(self.THREADS, worker)
        taken.append(float(acc.take()[0].numpy().flat[0]))
        values = [t * 1000 + j + 1 for t in range(self.THREADS) for j in range(2 * self.ROUNDS)]
        assert sum(taken) == sum(values)
        stats = acc.statistics()
        assert stats.added == stats.taken == len(values) and stats.pending == 0
        assert stats.takes >= self.THREADS * self.ROUNDS


@pytest.mark.usefixtures("layout")
class TestRefusals:
    def test_num_required_refuses_before_anything_changes(self, mode):
        acc = GradientAccumulator(variables(), num_required=3)
        add = mode(lambda g: acc.add(g))
        add_and_take = mode(lambda g: acc.add_and_take(g))
        grads = contributions(3, seed=7)
        add([tf.constant(x) for x in grads[0]])
        before = state(acc)
        errors = (AccumulatorTimeoutError, tf.errors.InvalidArgumentError)
        with pytest.raises(errors, match="num_required"):
            add_and_take([tf.constant(x) for x in grads[1]])
        assert state(acc) == before
        add([tf.constant(x) for x in grads[1]])
        got = add_and_take([tf.constant(x) for x in grads[2]])
        reference = GradientAccumulator(variables())
        for g in grads:
            reference.add(g)
        assert bits(got) == bits(reference.take())

    def test_num_required_is_refused_under_xla(self):
        acc = GradientAccumulator(variables(), num_required=2)
        xla = tf.function(lambda g: acc.add_and_take(g), autograph=False, jit_compile=True)
        with pytest.raises(InvalidArgumentError, match="take_if_ready"):
            xla([tf.ones(SHAPES[0]), tf.ones(SHAPES[1])])
        assert acc.statistics().added == 0

    def test_a_full_accumulator_refuses_it_and_changes_nothing(self, mode):
        acc = GradientAccumulator(variables(), max_pending=2)
        add = mode(lambda g: acc.add(g))
        add_and_take = mode(lambda g: acc.add_and_take(g))
        grads = contributions(3, seed=9)
        for g in grads[:2]:
            add([tf.constant(x) for x in g])
        before = state(acc)
        with pytest.raises((AccumulatorFullError, tf.errors.InvalidArgumentError)) as info:
            add_and_take([tf.constant(x) for x in grads[2]])
        assert "AccumulatorFullError" in str(info.value) or info.type is AccumulatorFullError
        assert state(acc) == before

    def test_a_stale_contribution_is_dropped_and_the_rest_taken(self, mode):
        acc = GradientAccumulator(variables(), max_staleness=0, reduction="sum")
        add_and_take = mode(lambda g, v: acc.add_and_take(g, version=v))
        acc.add([tf.ones(SHAPES[0]), tf.ones(SHAPES[1])], version=0)
        kernel, _ = add_and_take([tf.fill(SHAPES[0], 5.0), tf.ones(SHAPES[1])], 0)
        np.testing.assert_array_equal(kernel, np.full(SHAPES[0], 6.0))  # version 1 now
        kernel, _ = add_and_take([tf.fill(SHAPES[0], 50.0), tf.ones(SHAPES[1])], 0)
        np.testing.assert_array_equal(kernel, np.zeros(SHAPES[0]))  # stale: dropped
        assert acc.statistics().dropped_stale == 1


def test_replicas_add_and_all_get_the_same_result(mirrored_strategy):
    with mirrored_strategy.scope():
        acc = GradientAccumulator(variables(), max_pending=8)
    replicas = mirrored_strategy.num_replicas_in_sync
    acc.add([tf.fill(SHAPES[0], 10.0), tf.fill(SHAPES[1], 10.0)])

    @tf.function(autograph=False)
    def step():
        def replica():
            rid = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
            return acc.add_and_take([tf.fill(SHAPES[0], rid), tf.fill(SHAPES[1], rid)])

        return mirrored_strategy.run(replica)

    kernel, _ = step()
    want = (10.0 + sum(range(replicas))) / (replicas + 1)
    for value in mirrored_strategy.experimental_local_results(kernel):
        np.testing.assert_allclose(value, np.full(SHAPES[0], want), rtol=1e-6)
    stats = acc.statistics()
    assert stats.pending == 0 and stats.taken == replicas + 1 and stats.takes == 1
