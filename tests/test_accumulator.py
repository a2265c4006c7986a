"""GradientAccumulator: determinism, atomicity, staleness, sparse, mixed precision,
checkpoints, bad input and MirroredStrategy."""

from __future__ import annotations

import inspect
import math
import random
import threading

import numpy as np
import pytest
import tensorflow as tf
from graph_walk import ancestors
from threading_harness import run_threads

from safevars.accumulator import AccumulatorStatistics, GradientAccumulator
from safevars.accumulator import state as accumulator_state
from safevars.errors import (
    AccumulatorTimeoutError,
    DTypeMismatchError,
    InvalidArgumentError,
    NonFiniteGradientError,
    ShapeMismatchError,
    StaleGradientError,
)
from safevars.variable import SafeVariable


def state(acc: GradientAccumulator) -> tuple:
    """Everything a refused call must leave unchanged: the live state and statistics.

    Deterministic accumulators only read the blocks (one per contribution) below the
    pending count.
    """
    stats = acc.statistics()
    live = acc._rows().numpy() if acc.deterministic else acc._state.numpy()
    if acc.deterministic:
        layout = acc._layout
        live = live.reshape(-1, layout.chunks * layout.width)[: stats.pending]
    return (live.tobytes(), stats)


def as_int(x) -> int:
    return int(x.numpy()) if isinstance(x, tf.Tensor) else int(x)


def hard_contributions(count: int, size: int, seed: int) -> list[np.ndarray]:
    """float32 gradients spanning 12 decades, so float32 sums depend on the order."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(size) * 10.0 ** rng.uniform(-6, 6, size)).astype(np.float32)
        for _ in range(count)
    ]


@pytest.fixture(params=["one_row", "blocks"])
def layout(request, monkeypatch):
    """Runs a test with both deterministic buffer layouts: small models store each
    contribution as one row; models with gradients of at least ``_DIRECT`` elements
    store blocks of ``_CHUNK``-element rows, large gradients straight from the tensor
    (see ``_Layout``). "blocks" shrinks both constants so that the tests' small
    variables take that path: direct rows, a partial last row (tail) and padding."""
    if request.param == "blocks":
        monkeypatch.setattr(accumulator_state, "_CHUNK", 4)
        monkeypatch.setattr(accumulator_state, "_DIRECT", 8)
    return request.param


# ---------------------------------------------------------------------- construction


class TestConstruction:
    def test_signature_shows_the_constructor_parameters(self):
        signature = inspect.signature(GradientAccumulator)
        assert list(signature.parameters)[:2] == ["variables", "reduction"]
        assert signature.parameters["reduction"].default == "mean"
        assert signature.parameters["max_pending"].default is None
        assert signature.parameters["name"].default == "gradient_accumulator"

    def test_bad_arguments_are_refused(self):
        v = tf.Variable(tf.zeros([2]))
        for kwargs in (
            {"reduction": "max"},
            {"on_stale": "ignore"},
            {"nonfinite": "zero"},
            {"num_required": 0},
            {"num_required": 1.5},
            {"max_staleness": -1},
            {"max_staleness": True},
            {"deterministic": "yes"},
        ):
            with pytest.raises(InvalidArgumentError):
                GradientAccumulator([v], **kwargs)
        with pytest.raises(InvalidArgumentError):
            GradientAccumulator([])
        with pytest.raises(InvalidArgumentError):
            GradientAccumulator([tf.zeros([2])])
        with pytest.raises(DTypeMismatchError):
            GradientAccumulator([tf.Variable([1, 2])])
        with pytest.raises(InvalidArgumentError):  # also a ValueError for old handlers
            GradientAccumulator([v], reduction="max")

    def test_float64_needs_deterministic_false(self):
        v = tf.Variable(tf.zeros([2], tf.float64))
        with pytest.raises(DTypeMismatchError, match="deterministic=False"):
            GradientAccumulator([v])
        acc = GradientAccumulator([v], deterministic=False)
        acc.add([tf.constant([1.0, 2.0], tf.float64)])
        out = acc.take()[0]
        assert out.dtype == tf.float64
        np.testing.assert_array_equal(out, [1.0, 2.0])

    def test_memory_cost_is_reported_and_the_buffer_grows(self):
        v = tf.Variable(tf.zeros([10, 3]))
        assert GradientAccumulator([v], deterministic=False).state_bytes == 30 * 4
        assert GradientAccumulator([v], num_required=6).state_bytes == 6 * 30 * 4
        acc = GradientAccumulator([v], reduction="sum")
        assert acc.state_bytes == 4 * 30 * 4  # four float32 rows to start with
        for i in range(9):
            acc.add([tf.fill([10, 3], float(i))])
        assert acc.state_bytes == 16 * 30 * 4  # doubled twice, rows kept
        np.testing.assert_array_equal(acc.take()[0], np.full([10, 3], 36.0))

    def test_buffer_grows_in_a_function_through_one_if_kernel(self):
        # The growth check of a traced add stays one If op at run time (not lowered
        # to Switch/Merge, whose untaken branch the executor visits at every add).
        v = tf.Variable(tf.zeros([10, 3]))
        acc = GradientAccumulator([v], reduction="sum")

        @tf.function(autograph=False)
        def add(x):
            return acc.add([x])

        for i in range(9):
            assert as_int(add(tf.fill([10, 3], float(i)))) == 1
        assert acc.state_bytes == 16 * 30 * 4  # doubled twice, rows kept
        np.testing.assert_array_equal(acc.take()[0], np.full([10, 3], 36.0))
        graph = add.get_concrete_function(tf.TensorSpec([10, 3])).graph
        conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
        assert len(conds) == 1
        assert conds[0].get_attr("_lower_using_switch_merge") is False

    def test_state_is_not_mirrored_under_strategy_scope(self, mirrored_strategy):
        with mirrored_strategy.scope():
            v = tf.Variable(tf.zeros([2]))
            acc = GradientAccumulator([v])
        assert not isinstance(acc._state, tf.distribute.DistributedValues)
        assert isinstance(v, tf.distribute.DistributedValues)


class TestBlockLayout:
    """Deterministic accumulators with gradients of at least ``_DIRECT`` elements store
    them straight into rows of their own (no concatenated copy); see ``_Layout``."""

    SHAPES = ([256, 256], [300], [257, 256], [5, 2])  # direct, packed, direct + tail

    def test_layout_places_every_element_once(self):
        chunk = accumulator_state._CHUNK
        for shapes in (self.SHAPES, [[256, 1024], [1024], [1024, 1024], [1024], [1024, 10]]):
            acc = GradientAccumulator([tf.Variable(tf.zeros(s)) for s in shapes])
            layout = acc._layout
            assert layout.width == chunk
            cells = np.zeros(layout.chunks * layout.width, np.int64)
            for slot, segments in zip(acc._slots, layout.segments):
                assert sum(length for _, length in segments) == slot.size
                for start, length in segments:
                    cells[start : start + length] += 1
            assert set(cells.tolist()) <= {0, 1}
            padding = int((cells == 0).sum())
            assert padding < chunk  # only the packed rows' end
            assert np.all(cells[: cells.size - padding] == 1)
        small = GradientAccumulator([tf.Variable(tf.zeros([5, 7])), tf.Variable(tf.zeros([3]))])
        assert (small._layout.chunks, small._layout.width) == (1, 38)  # one row, no padding

    @staticmethod
    def _pre_block_checkpoint(path, rows):
        """A checkpoint as safevars 0.1 wrote it: one row per pending contribution."""

        class Old(tf.Module):  # the accumulator's tracked names
            def __init__(self):
                super().__init__()
                buffer = np.zeros([4, rows.shape[1]], np.float32)
                buffer[: len(rows)] = rows
                self._state = tf.Variable(buffer)
                pending = len(rows)
                self._counters = tf.Variable(np.array([pending, pending, 0, 0, 0, 0, 0, 0]))

        return tf.train.Checkpoint(acc=Old()).write(path)

    def test_a_checkpoint_of_the_row_layout_restores_its_pending_contributions(self, tmp_path):
        rng = np.random.default_rng(0)
        kernel = rng.normal(size=[257, 256]).astype(np.float32)  # direct rows + a tail
        bias = rng.normal(size=[3]).astype(np.float32)
        later = [kernel * 2.0, bias - 1.0]
        path = self._pre_block_checkpoint(
            str(tmp_path / "old"), np.concatenate([kernel.ravel(), bias])[None]
        )
        variables = [tf.Variable(tf.zeros([257, 256])), tf.Variable(tf.zeros([3]))]
        acc = GradientAccumulator(variables)
        assert acc._layout.chunks > 1  # the layouts differ
        tf.train.Checkpoint(acc=acc).read(path).assert_consumed()
        assert acc.count == 1
        acc.add(later)
        expected = GradientAccumulator(variables)
        expected.add([kernel, bias])
        expected.add(later)
        for got, want in zip(acc.take(), expected.take()):
            np.testing.assert_array_equal(got.numpy(), want.numpy())

    def test_a_graph_mode_restore_converts_when_the_shape_is_known_at_run_time(self):
        variables = [tf.Variable(tf.zeros([256, 256])), tf.Variable(tf.zeros([5]))]
        acc = GradientAccumulator(variables)
        block = acc._rows()
        row = np.arange(256 * 256 + 5, dtype=np.float32)[None]
        key = "VARIABLE_VALUE"

        @tf.function(input_signature=[tf.TensorSpec(None, tf.float32)], autograph=False)
        def restore(rows):
            acc._state._restore_from_tensors({key: rows})

        restore(row)  # old layout: converted
        converted = acc._rows().numpy()
        kernel_rows = 256 * 256 // acc._layout.width
        np.testing.assert_array_equal(converted[:kernel_rows].ravel(), row[0, : 256 * 256])
        np.testing.assert_array_equal(converted[kernel_rows, :5], row[0, 256 * 256 :])
        restore(block)  # the block layout: as it is
        np.testing.assert_array_equal(acc._rows().numpy(), block.numpy())

    def test_the_first_blocks_are_kept_by_reference_and_the_rest_buffered(self, mode):
        """The first max(num_required, 4) pending contributions are held by the
        reference variables (the buffer stays empty); the fifth grows the buffer by one
        block; after a take the references are reused. Every take is the exact mean."""
        rng = np.random.default_rng(7)
        variables = [tf.Variable(tf.zeros([256, 256])), tf.Variable(tf.zeros([5]))]
        acc = GradientAccumulator(variables)
        assert acc._references == 4
        add = mode(lambda g, h: acc.add([g, h]))
        for round_, count in enumerate((4, 6, 3)):
            # Multiples of 2**-13 below 2**10: float64 sums them exactly.
            grads = [rng.integers(-(2**23), 2**23, (count, *v.shape)) / 2.0**13 for v in variables]
            for i in range(count):
                add(tf.constant(grads[0][i], tf.float32), tf.constant(grads[1][i], tf.float32))
                buffered = int(acc._rows_shape()[0])
                if round_ == 0:
                    assert buffered == 0  # nothing copied into the buffer yet
            if round_ == 1:
                assert buffered == 2 * acc._layout.chunks  # blocks 4 and 5
                # The references, the two buffered blocks and, in a graph, the sink's
                # reference to block 5 (eagerly the sink is not used).
                block = acc._layout.chunks * acc._layout.width * 4
                sink = 0 if mode.name == "eager" else block
                assert acc.state_bytes == 4 * block + 2 * block + sink
            for got, g in zip(acc.take(), grads):
                want = (g.sum(axis=0) / count).astype(np.float32)
                assert got.numpy().tobytes() == want.tobytes()

    def test_a_take_joined_to_an_add_waits_for_its_reference_writes(self):
        """A traced add and take on the same accumulator: the take's reduction reads
        the reference variables after the add's call that writes them (automatic
        control dependencies see that call's variables; an AssignVariableOp on a
        gathered handle alone they do not see: under ParameterServerStrategy a take
        then read blocks before the add wrote them)."""
        variables = [tf.Variable(tf.zeros([256, 256])), tf.Variable(tf.zeros([5]))]
        acc = GradientAccumulator(variables)

        def step(g, h):
            acc.add([g, h])
            return acc.take()

        fn = tf.function(step, autograph=False)
        graph = fn.get_concrete_function(tf.TensorSpec([256, 256]), tf.TensorSpec([5])).graph
        calls = [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"]
        name = lambda op: op.get_attr("f").name  # noqa: E731
        writes = [op for op in calls if "write" in name(op)]
        (reduce,) = [op for op in calls if "reduce_math" in name(op)]
        assert len(writes) == 2  # the 1M-element piece and the packed one
        assert all(w in ancestors(reduce) for w in writes)
        g, h = np.full([256, 256], 3.0, np.float32), np.arange(5, dtype=np.float32)
        got = fn(tf.constant(g), tf.constant(h))
        np.testing.assert_array_equal(got[0], g)
        np.testing.assert_array_equal(got[1], h)

    def test_replicas_fill_the_references_then_the_buffer(self, mirrored_strategy):
        """Two replicas add in one commit (blocks pending and pending + 1): three steps
        put 4 contributions in the reference blocks and 2 in the buffer; the take is
        the exact mean of all 6."""
        with mirrored_strategy.scope():
            variables = [tf.Variable(tf.zeros([256, 256])), tf.Variable(tf.zeros([5]))]
            acc = GradientAccumulator(variables)

        @tf.function(autograph=False)
        def step(i):
            def replica():
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                scale = tf.cast(2 * i + rid + 1, tf.float32)
                return acc.add([scale * tf.ones([256, 256]), scale * tf.range(5.0)])

            return mirrored_strategy.run(replica)

        for i in range(3):
            step(tf.constant(i))
            assert int(acc._rows_shape()[0]) == (0 if i < 2 else 2 * acc._layout.chunks)
        kernel, bias = acc.take()
        np.testing.assert_array_equal(kernel, np.full([256, 256], 3.5, np.float32))
        np.testing.assert_array_equal(bias, 3.5 * np.arange(5, dtype=np.float32))

    def test_a_checkpoint_keeps_referenced_and_buffered_blocks(self, tmp_path):
        """Six pending contributions (four by reference, two buffered) saved, restored
        into a new accumulator (and into one with room for eight by reference): the
        same bits are taken; the checkpoint holds the row layout."""
        rng = np.random.default_rng(8)
        shapes = ([256, 256], [5])
        grads = [
            [
                (rng.standard_normal(s) * 10.0 ** rng.uniform(-6, 6, s)).astype(np.float32)
                for s in shapes
            ]
            for _ in range(6)
        ]

        def make(**kwargs):
            return GradientAccumulator([tf.Variable(tf.zeros(s)) for s in shapes], **kwargs)

        acc = make()
        for g in grads:
            acc.add(g)
        saved = acc._rows().numpy()
        path = tf.train.Checkpoint(acc=acc).write(str(tmp_path / "ckpt"))
        want = [t.numpy().tobytes() for t in acc.take()]
        for kwargs in ({}, {"num_required": 6}):
            other = make(**kwargs)
            tf.train.Checkpoint(acc=other).read(path).assert_consumed()
            assert other.count == 6
            assert other._rows().numpy()[: saved.shape[0]].tobytes() == saved.tobytes()
            assert [t.numpy().tobytes() for t in other.take()] == want

    def test_memory_cost_with_large_gradients(self):
        v = tf.Variable(tf.zeros([256, 1024]))
        b = tf.Variable(tf.zeros([10]))
        acc = GradientAccumulator([v, b])
        # 256 direct rows and one packed row of 1024 elements, per contribution
        assert acc.state_bytes == 4 * (256 + 1) * 1024 * 4
        assert acc.state_bytes < 4 * (v.shape.num_elements() + 10 + 1024) * 4

    def test_same_bits_as_one_row_per_contribution(self, mode, monkeypatch):
        rng = np.random.default_rng(4)
        grads = [
            [
                (rng.standard_normal(s) * 10.0 ** rng.uniform(-8, 8, s)).astype(np.float32)
                for s in self.SHAPES
            ]
            for _ in range(5)
        ]
        exact = [np.mean(np.stack([g[i] for g in grads]).astype(np.float64), 0) for i in range(4)]
        results = []
        for direct in (accumulator_state._DIRECT, 10**9):  # blocks, then one row
            monkeypatch.setattr(accumulator_state, "_DIRECT", direct)
            acc = GradientAccumulator([tf.Variable(tf.zeros(s)) for s in self.SHAPES])
            assert (acc._layout.chunks > 1) == (direct < 10**9)
            add = mode(lambda g, acc=acc: acc.add(g))
            for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
                for i in order:
                    add([tf.constant(x) for x in grads[i]])
                out = [t.numpy() for t in acc.take()]
                for got, want in zip(out, exact):
                    np.testing.assert_array_max_ulp(got, want.astype(np.float32), maxulp=1)
                results.append(b"".join(t.tobytes() for t in out))
        assert len(set(results)) == 1


# ---------------------------------------------------------------------- add / take


class TestAddTake:
    @pytest.mark.usefixtures("layout")
    def test_mean_of_dense_sparse_and_none(self, mode):
        a = tf.Variable(tf.zeros([3, 2]))
        b = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator({"a": a, "b": b})
        sparse = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([2, 2]))

        def step():
            n = acc.add({"a": tf.ones([3, 2]), "b": tf.constant([2.0, 4.0])})
            n += acc.add({"a": sparse, "b": None})
            return n, acc.take()

        n, out = mode(step)()
        assert as_int(n) == 2
        np.testing.assert_array_equal(out["a"], [[0.5, 0.5], [0.5, 0.5], [2.5, 3.5]])
        np.testing.assert_array_equal(out["b"], [1.0, 2.0])
        assert acc.statistics() == AccumulatorStatistics(0, 2, 0, 0, 0, 2, 1, 0)

    def test_sum_reduction_and_empty_take(self, mode):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v], reduction="sum")

        def step():
            empty = acc.take()
            acc.add([tf.constant([1.0, 2.0])])
            acc.add([tf.constant([3.0, 4.0])])
            return empty, acc.take()

        empty, out = mode(step)()
        np.testing.assert_array_equal(empty[0], [0.0, 0.0])
        np.testing.assert_array_equal(out[0], [4.0, 6.0])
        assert acc.statistics().takes == 1  # the empty take took nothing

    def test_count_and_reset(self, mode):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v])

        def step():
            acc.add([tf.ones([2])])
            acc.add([tf.ones([2])])
            before = acc.count
            with tf.control_dependencies([before]):
                acc.reset()
            return before

        assert as_int(mode(step)()) == 2
        assert acc.count == 0
        stats = acc.statistics()
        assert (stats.added, stats.discarded, stats.pending) == (2, 2, 0)
        np.testing.assert_array_equal(acc.take()[0], [0.0, 0.0])

    def test_nonfinite_propagates_by_default(self, mode):
        v = tf.Variable(tf.zeros([4]))
        acc = GradientAccumulator([v], reduction="sum")

        def step():
            acc.add([tf.constant([np.inf, np.inf, np.nan, 1.0])])
            acc.add([tf.constant([1.0, -np.inf, 1.0, 3e38])])
            acc.add([tf.constant([1.0, 1.0, 1.0, 3e38])])
            return acc.take()

        out = mode(step)()[0].numpy()
        assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2])
        assert out[3] == np.inf  # 6e38 overflows float32 only at the end

    def test_mean_of_large_values_does_not_overflow(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v])
        acc.add([tf.constant([3e38])])
        acc.add([tf.constant([3e38])])
        np.testing.assert_array_equal(acc.take()[0], np.float32([3e38]))


# ---------------------------------------------------------------------- determinism


class TestDeterminism:
    SIZE = 512
    CONTRIBUTIONS = 32
    THREADS = 8
    RUNS = 20

    def test_naive_float32_sums_of_the_data_depend_on_order(self):
        grads = hard_contributions(self.CONTRIBUTIONS, self.SIZE, seed=1)
        rng = random.Random(0)
        sums = set()
        for _ in range(self.RUNS):
            order = list(range(self.CONTRIBUTIONS))
            rng.shuffle(order)
            total = np.zeros(self.SIZE, np.float32)
            for i in order:
                total += grads[i]
            sums.add(total.tobytes())
        assert len(sums) > 1  # so the bitwise test below is meaningful

    @pytest.mark.usefixtures("layout")
    def test_eight_threads_shuffled_orders_are_bitwise_identical(self, mode):
        grads = hard_contributions(self.CONTRIBUTIONS, self.SIZE, seed=1)
        v = tf.Variable(tf.zeros([self.SIZE]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        rng = random.Random(42)
        results = set()
        for _ in range(self.RUNS):
            order = list(range(self.CONTRIBUTIONS))
            rng.shuffle(order)
            shares = [order[t :: self.THREADS] for t in range(self.THREADS)]

            def worker(index: int) -> None:
                for i in shares[index]:
                    add(tf.constant(grads[i]))

            run_threads(self.THREADS, worker)
            assert acc.count == self.CONTRIBUTIONS
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1
        result = np.frombuffer(results.pop(), np.float32)
        exact = np.mean(np.stack(grads).astype(np.float64), axis=0)
        np.testing.assert_array_max_ulp(result, exact.astype(np.float32), maxulp=1)

    def test_reproducible_sum_is_order_free_exact_enough_and_xla_proof(self):
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(11)
        p, n = 24, 64
        columns = [
            rng.standard_normal(p) * 10.0 ** rng.uniform(-30, 30, p),  # 60 decades
            np.concatenate([[3e38, -3e38], rng.standard_normal(p - 2)]),  # cancels
            np.concatenate([[1.0, -1.0], 1e-7 * rng.standard_normal(p - 2)]),
        ]
        data = rng.standard_normal((p, n)) * 10.0 ** rng.uniform(-6, 6, (p, n))
        for j, column in enumerate(columns):
            data[:, j] = column
        data = data.astype(np.float32)
        garbage = rng.standard_normal((8, n)).astype(np.float32)  # rows past the count
        count = tf.constant(p, tf.int64)
        plain = tf.function(_reproducible_sum, autograph=False)
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        reference = plain(tf.constant(np.concatenate([data, garbage])), count).numpy()
        for fn in (plain, xla):
            for _ in range(3):
                shuffled = np.concatenate([rng.permutation(data), garbage])
                out = fn(tf.constant(shuffled), count).numpy()
                assert out.tobytes() == reference.tobytes()
        for j in range(n):
            exact = sum(Fraction(float(x)) for x in data[:, j])
            biggest = max(abs(Fraction(float(x))) for x in data[:, j])
            error = abs(Fraction(float(reference[j])) - exact)
            # one float64 rounding of the result, plus remainders dropped below 2**-80
            assert error <= abs(exact) * Fraction(1, 2**52) + biggest * Fraction(1, 2**80)

    @pytest.mark.parametrize("counts", [(1, 3, 4), (5, 8, 9), (17, 2)])
    @pytest.mark.usefixtures("layout")
    def test_take_reduces_exactly_the_pending_rows(self, mode, counts):
        """Takes of 1..17 contributions (several row buckets, one XLA compile each) after
        earlier takes left garbage rows behind: exactly the pending rows count."""
        rng = np.random.default_rng(sum(counts))
        v = tf.Variable(tf.zeros([2, 5]))
        acc = GradientAccumulator([v])
        acc.add([tf.fill([2, 5], np.float32(np.nan))])  # stale rows past every later count
        for _ in range(24):
            acc.add([tf.fill([2, 5], np.float32(3e38))])
        acc.take()
        add = mode(lambda g: acc.add([g]))
        take = mode(lambda: acc.take()[0])
        for count in counts:
            # float32 multiples of 2**-13 below 2**10: float64 sums them exactly, so
            # numpy's float64 mean rounded to float32 is the exact answer.
            grads = rng.integers(-(2**23), 2**23, (count, 2, 5)) / 2.0**13
            for g in grads:
                add(tf.constant(g, tf.float32))
            expected = (grads.sum(axis=0) / count).astype(np.float32)
            assert take().numpy().tobytes() == expected.tobytes()
        assert acc.statistics().taken == 25 + sum(counts)

    def test_grouped_reduction_matches_reference_for_every_row_count(self):
        """The reduction combines rows in groups of four; any number of rows (static or
        unknown when tracing), any padding, gives the bits of a one-row-at-a-time
        reference of the same method."""
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(5)
        dynamic = tf.function(
            _reproducible_sum,
            autograph=False,
            input_signature=[tf.TensorSpec([None, 6], tf.float32), tf.TensorSpec([], tf.int64)],
        )
        for rows in (1, 2, 3, 4, 5, 7, 9, 13):
            data = rng.standard_normal((rows, 6)) * 10.0 ** rng.uniform(-25, 25, (rows, 6))
            data = data.astype(np.float32)
            for count in sorted({1, rows // 2 or 1, rows}):
                static = _reproducible_sum(tf.constant(data), tf.constant(count, tf.int64))
                unknown = dynamic(tf.constant(data), tf.constant(count, tf.int64))
                assert static.numpy().tobytes() == unknown.numpy().tobytes()
                shuffled = np.concatenate([rng.permutation(data[:count]), data[count:]])
                again = _reproducible_sum(tf.constant(shuffled), tf.constant(count, tf.int64))
                assert again.numpy().tobytes() == static.numpy().tobytes()
                for j in range(6):
                    exact = sum(Fraction(float(x)) for x in data[:count, j])
                    biggest = max(abs(Fraction(float(x))) for x in data[:count, j])
                    error = abs(Fraction(float(static[j])) - exact)
                    assert error <= abs(exact) * Fraction(1, 2**52) + biggest * Fraction(1, 2**80)

    def test_leading_rows_give_the_bits_of_the_stacked_rows(self):
        """Rows passed as ``leading`` vectors (the blocks kept by reference) and the
        rest as the grouped rows give the same bits as all of them stacked, for every
        split and count, under XLA too; an empty rest is allowed."""
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        rng = np.random.default_rng(9)
        data = rng.standard_normal((9, 6)) * 10.0 ** rng.uniform(-25, 25, (9, 6))
        data = tf.constant(data.astype(np.float32))
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        for count in (1, 3, 4, 5, 9):
            want = _reproducible_sum(data, tf.constant(count, tf.int64)).numpy().tobytes()
            for k in (1, 3, 4, 9):
                leading = [data[j] for j in range(k)]
                for fn in (_reproducible_sum, xla):
                    got = fn(data[k:], tf.constant(count, tf.int64), leading)
                    assert got.numpy().tobytes() == want, (count, k)

    @staticmethod
    def _sorted_cases() -> np.ndarray:
        """[4, n] float32 columns whose float64 sums depend on the order: random
        values over 60 decades, and hand-made cancellations, signed zeros and the
        smallest normal numbers (TensorFlow's CPU kernels flush subnormals to zero)."""
        rng = np.random.default_rng(21)
        n = 3000
        data = rng.standard_normal((4, n)) * 10.0 ** rng.uniform(-30, 30, (4, n))
        tiny = np.float32(2.0**-126)
        columns = [
            [3e38, -3e38, 1.0, 2.0**-100],
            [1.0, -1.0, 2.0**-60, 3 * 2.0**-80],
            [2.0**60, 1.0, -(2.0**60), 2.0**-60],
            [0.0, -0.0, -0.0, 0.0],
            [-0.0, -0.0, -0.0, -0.0],
            [tiny, -tiny, 3 * tiny, 1.0],
            [1e30, 1e-30, -1e30, 1e-30],
            # Found by search: the compensated (TwoSum) sum of these in some orders
            # differs in the last float64 bit (about 1 column in 250,000 of random
            # ones); the plain float64 sum of the first two does too.
            [4749230080.0, 4.195203212598031e-12, 197126356992.0, 9.026287480286625e20],
            [-255321377341440.0, -4.805750810114395e23, 246476596838400.0, 3.4188305519933238e-09],
            [
                -1.491278567300469e-08,
                1.6560610660576458e-09,
                373258293608448.0,
                -1.3151346780012688e24,
            ],
            [
                7.183176276015502e-11,
                7.052203544998062e21,
                -1.224407797373317e-10,
                -1809542807552.0,
            ],
        ]
        for j, column in enumerate(columns):
            data[:, j] = column
        return data.astype(np.float32)

    def test_sums_of_up_to_four_are_order_free_and_nearly_exact(self):
        """Up to four rows are sorted per element and summed in float64 in a fixed
        order (``_sorted_sum``): every order of them, as buffer rows or as leading rows,
        plain or under XLA, gives the same bits, within 2**-53 of the exact sum plus
        2**-51 of the largest value."""
        import itertools
        from fractions import Fraction

        from safevars.accumulator.reproducible_sum import _NETWORK, _reproducible_sum

        for order in itertools.permutations(range(4)):  # the network sorts every order
            xs = list(order)
            for i, j in _NETWORK:
                xs[i], xs[j] = min(xs[i], xs[j]), max(xs[i], xs[j])
            assert xs == [0, 1, 2, 3], order
        data = self._sorted_cases()
        garbage = np.full((3, data.shape[1]), np.nan, np.float32)  # rows past the count
        xla = tf.function(_reproducible_sum, autograph=False, jit_compile=True)
        for count in (1, 2, 3, 4):
            rows = data[:count]
            results = set()
            for order in itertools.permutations(range(count)):
                shuffled = np.concatenate([rows[list(order)], garbage])
                as_rows = tf.constant(shuffled)
                c = tf.constant(count, tf.int64)
                results.add(_reproducible_sum(as_rows, c).numpy().tobytes())
                results.add(xla(as_rows, c).numpy().tobytes())
                leading = [as_rows[j] for j in range(2)]
                results.add(xla(as_rows[2:], c, leading).numpy().tobytes())
            assert len(results) == 1, count
            out = np.frombuffer(results.pop(), np.float64)
            for j in range(data.shape[1]):
                exact = sum(Fraction(float(x)) for x in rows[:, j])
                biggest = max(abs(Fraction(float(x))) for x in rows[:, j])
                error = abs(Fraction(float(out[j])) - exact)
                bound = abs(exact) * Fraction(1, 2**53) + biggest * Fraction(1, 2**51)
                assert error <= bound * (1 + Fraction(1, 2**50))

    def test_where_the_count_cannot_pass_four_only_the_sorted_sum_is_compiled(self):
        """XLA computes both branches of the count's cond (it turns it into a select):
        with a bound known when tracing (``most``: max_pending) or a static number of
        rows at most four (take compiles per power of two of the pending rows), only the
        sorted sum is compiled, with the same bits."""
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        data = self._sorted_cases()
        rows = np.concatenate([data, np.full_like(data, np.nan)])  # 8 rows: the grid may run
        n = data.shape[1]
        spec = [tf.TensorSpec([None, n], tf.float32), tf.TensorSpec([], tf.int64)]

        def compiled(most, signature=None):
            return tf.function(
                lambda r, c: _reproducible_sum(r, c, (), most),
                autograph=False,
                jit_compile=True,
                input_signature=signature,
            )

        def grid_in(fn, r) -> bool:  # the grid's roundings (tf.round) are compiled in
            ir = fn.experimental_get_compiler_ir(tf.constant(r), tf.constant(4, tf.int64))
            return "round-nearest" in ir(stage="optimized_hlo")

        unbounded, bounded, marker = compiled(None), compiled(4), compiled(None, spec)
        for count in (1, 2, 3, 4):
            c = tf.constant(count, tf.int64)
            want = _reproducible_sum(tf.constant(rows), c).numpy().tobytes()
            assert unbounded(tf.constant(rows), c).numpy().tobytes() == want
            assert bounded(tf.constant(rows), c).numpy().tobytes() == want
            assert marker(tf.constant(data), c).numpy().tobytes() == want
        assert grid_in(unbounded, rows) and grid_in(marker, rows)
        assert not grid_in(bounded, rows)
        assert not grid_in(marker, data)  # 4 rows: XLA folds the count's cond away

    def test_sums_of_up_to_four_propagate_nan_and_inf(self):
        from safevars.accumulator.reproducible_sum import _reproducible_sum

        inf, nan = np.inf, np.nan
        columns = {
            (1.0, nan, 2.0, 3.0): nan,
            (nan, 1.0, 2.0, 3.0): nan,
            (1.0, 2.0, 3.0, nan): nan,
            (inf, 1.0, -2.0, 3.0): inf,
            (1.0, -inf, 2.0, 3.0): -inf,
            (inf, -inf, 2.0, 3.0): nan,
            (inf, inf, 2.0, 3.0): inf,
        }
        data = tf.constant(np.array(list(columns), np.float32).T)
        for fn in (_reproducible_sum, tf.function(_reproducible_sum, jit_compile=True)):
            out = fn(data, tf.constant(4, tf.int64)).numpy()
            np.testing.assert_array_equal(out, np.array(list(columns.values())))

    @pytest.mark.usefixtures("layout")
    def test_take_of_up_to_four_keeps_what_the_grid_dropped(self, mode):
        """1 + 2**-110 - 1, in every order: the sorted sum keeps the 2**-110 that the
        two-level grid drops (below its finer grid, 2**-100 here), in every layout."""
        import itertools

        v = tf.Variable(tf.zeros([16]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        want = np.float32(2.0**-110 / 3)
        for order in itertools.permutations([1.0, 2.0**-110, -1.0]):
            for value in order:
                add(tf.fill([16], np.float32(value)))
            out = acc.take()[0].numpy()
            assert out.tobytes() == np.full([16], want, np.float32).tobytes(), order

    @pytest.mark.usefixtures("layout")
    def test_four_threads_adding_four_give_the_same_bits(self, mode):
        """An accumulator taking four contributions at a time (the sorted sum) gives
        bitwise the same mean whatever order four threads add them in."""
        data = self._sorted_cases()
        v = tf.Variable(tf.zeros([data.shape[1]]))
        acc = GradientAccumulator([v])
        add = mode(lambda g: acc.add([g]))
        results = set()
        for _ in range(6):
            run_threads(4, lambda i: add(tf.constant(data[i])))
            assert acc.count == 4
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1
        # math.fsum: the float64 sum correctly rounded (numpy's loses the 1e-30s).
        exact = np.array([math.fsum(map(float, c)) for c in data.T]) / 4
        np.testing.assert_array_max_ulp(
            np.frombuffer(results.pop(), np.float32), exact.astype(np.float32), maxulp=1
        )

    def test_replica_and_arrival_order_do_not_matter_for_sparse(self):
        v = tf.Variable(tf.zeros([6, 3]))
        rng = np.random.default_rng(3)
        parts = [
            tf.IndexedSlices(
                tf.constant(hard_contributions(1, 12, seed=i)[0].reshape(4, 3)),
                tf.constant(rng.integers(0, 6, 4)),
            )
            for i in range(10)
        ]
        results = set()
        for order in (range(10), reversed(range(10)), [3, 1, 4, 0, 5, 9, 2, 6, 8, 7]):
            acc = GradientAccumulator([v])
            for i in order:
                acc.add([parts[i]])
            results.add(acc.take()[0].numpy().tobytes())
        assert len(results) == 1


# ---------------------------------------------------------------------- Keras model


class TestKerasMicroBatches:
    def test_k_micro_batches_equal_the_full_batch_gradient(self, mode):
        import keras

        keras.utils.set_random_seed(7)
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
        x = tf.random.uniform([32, 5], 0, 50, tf.int32, seed=1)
        y = tf.random.uniform([32], 0, 3, tf.int32, seed=2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        variables = model.trainable_variables

        def gradients(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return tape.gradient(loss, variables)

        full = gradients(x, y)
        assert isinstance(full[0], tf.IndexedSlices)  # the sparse path is exercised
        acc = GradientAccumulator(variables, num_required=4)

        def accumulate():
            for i in range(4):
                acc.add(gradients(x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]))
            return acc.take()

        accumulated = mode(accumulate)()
        for got, want in zip(accumulated, full):
            want = tf.convert_to_tensor(want)
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- concurrency


class TestConcurrency:
    ADDERS = 4
    TAKERS = 2
    ADDS = 150

    def test_total_taken_equals_total_added(self, mode):
        v = tf.Variable(tf.zeros([3]))
        acc = GradientAccumulator([v], reduction="sum")
        add = mode(lambda g: acc.add([g]))
        # One eager and one graph taker, so graph adds race an eager read-and-reset.
        takers = [acc.take, tf.function(lambda: acc.take(), autograph=False)]
        taken: list[np.ndarray] = []
        finished = []
        guard = threading.Lock()

        def worker(index: int) -> None:
            if index < self.ADDERS:
                for i in range(self.ADDS):
                    value = float(index * 1000 + i)
                    add(tf.constant([value, 1.0, -value]))
                with guard:
                    finished.append(index)
                return
            take = takers[index % 2]
            while True:
                with guard:
                    done = len(finished) == self.ADDERS
                out = take()[0].numpy()
                with guard:
                    taken.append(out)
                if done:
                    return

        run_threads(self.ADDERS + self.TAKERS, worker)
        taken.append(acc.take()[0].numpy())
        total = np.sum(np.stack(taken).astype(np.float64), axis=0)
        expected = sum(t * 1000 + i for t in range(self.ADDERS) for i in range(self.ADDS))
        n = self.ADDERS * self.ADDS
        np.testing.assert_array_equal(total, [expected, n, -expected])
        stats = acc.statistics()
        assert stats.added == stats.taken == n and stats.pending == 0

    def test_graph_and_eager_adds_exclude_each_other(self):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v], reduction="sum", deterministic=False)
        graph_add = tf.function(lambda g: acc.add([g]), autograph=False)

        def eager_add(g: tf.Tensor) -> int:
            return acc.add([g])

        def worker(index: int) -> None:
            add = graph_add if index % 2 else eager_add
            for _ in range(50):
                add(tf.constant([1.0, 2.0]))

        run_threads(4, worker)
        np.testing.assert_array_equal(acc.take()[0], [200.0, 400.0])
        assert acc.statistics().taken == 200


class TestNumRequired:
    def test_take_times_out_and_keeps_contributions(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=3, reduction="sum")
        acc.add([tf.constant([1.0])])
        with pytest.raises(AccumulatorTimeoutError):
            acc.take(timeout=0.05)
        with pytest.raises(TimeoutError):  # the builtin a caller would catch
            acc.take(timeout=0)
        assert acc.count == 1
        acc.add([tf.constant([2.0])])
        acc.add([tf.constant([3.0])])
        np.testing.assert_array_equal(acc.take(timeout=0)[0], [6.0])

    def test_blocked_take_wakes_when_enough_arrived(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=4, reduction="sum")
        result = []
        taker = threading.Thread(target=lambda: result.append(acc.take(timeout=60)))
        taker.start()
        for i in range(4):
            acc.add([tf.constant([float(i)])])
        taker.join(60)
        assert not taker.is_alive()
        np.testing.assert_array_equal(result[0][0], [6.0])

    def test_graph_take_with_too_few_fails_and_keeps(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=2)
        acc.add([tf.constant([1.0])])
        take = tf.function(lambda: acc.take(), autograph=False)
        with pytest.raises(tf.errors.InvalidArgumentError, match="AccumulatorTimeoutError"):
            take()
        assert acc.count == 1
        acc.add([tf.constant([3.0])])
        np.testing.assert_array_equal(take()[0], [2.0])

    def test_take_if_ready(self, mode):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], num_required=2)
        take = mode(lambda: acc.take_if_ready())
        acc.add([tf.constant([1.0])])
        ready, grads = take()
        assert not bool(ready) and acc.count == 1
        acc.add([tf.constant([3.0])])
        ready, grads = take()
        assert bool(ready) and acc.count == 0
        np.testing.assert_array_equal(grads[0], [2.0])


# ---------------------------------------------------------------------- staleness


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


# ---------------------------------------------------------------------- dtypes


class TestMixedPrecision:
    @pytest.mark.parametrize(
        "dtype, big", [(tf.float16, 2048.0), (tf.bfloat16, 256.0)], ids=["f16", "bf16"]
    )
    @pytest.mark.usefixtures("layout")
    def test_half_precision_accumulates_in_float32(self, mode, dtype, big):
        v = tf.Variable(tf.zeros([2], dtype))
        acc = GradientAccumulator([v], reduction="sum")
        grads = [tf.constant([big, 0.5], dtype)] + [tf.constant([1.0, 0.25], dtype)] * 2
        naive = grads[0]
        for g in grads[1:]:
            naive = naive + g
        assert float(naive[0]) == big  # the narrow sum loses both 1s

        def step():
            for g in grads:
                acc.add([g])
            return acc.take()

        out = mode(step)()[0]
        assert out.dtype == dtype
        np.testing.assert_array_equal(out.numpy().astype(np.float32), [big + 2.0, 1.0])

    def test_float32_variable_takes_half_gradients(self):
        v = tf.Variable(tf.zeros([1]))
        acc = GradientAccumulator([v], reduction="sum")
        acc.add([tf.constant([1.5], tf.float16)])
        acc.add([tf.constant([2.5], tf.bfloat16)])
        out = acc.take()[0]
        assert out.dtype == tf.float32
        np.testing.assert_array_equal(out, [4.0])


# ---------------------------------------------------------------------- checkpoints


class TestCheckpoint:
    @pytest.mark.parametrize("deterministic", [True, False])
    @pytest.mark.usefixtures("layout")
    def test_resume_gives_the_same_result(self, tmp_path, deterministic):
        v = tf.Variable(tf.zeros([64]))
        grads = [tf.constant(g) for g in hard_contributions(6, 64, seed=5)]
        acc = GradientAccumulator([v], deterministic=deterministic)
        for g in grads[:3]:
            acc.add([g])
        path = tf.train.Checkpoint(acc=acc).save(str(tmp_path / "ckpt"))
        for g in grads[3:]:
            acc.add([g])
        stats = acc.statistics()
        uninterrupted = acc.take()[0].numpy()

        resumed = GradientAccumulator([v], deterministic=deterministic)
        tf.train.Checkpoint(acc=resumed).restore(path).assert_consumed()
        assert resumed.count == 3
        for g in grads[3:]:
            resumed.add([g])
        assert resumed.statistics() == stats
        assert resumed.take()[0].numpy().tobytes() == uninterrupted.tobytes()


# ---------------------------------------------------------------------- bad input


class TestBadInput:
    def make(self, **kwargs):
        a = tf.Variable(tf.zeros([2, 2]))
        b = tf.Variable(tf.zeros([3]))
        acc = GradientAccumulator([a, b], **kwargs)
        acc.add([tf.ones([2, 2]), tf.ones([3])])
        return acc

    @pytest.mark.usefixtures("layout")
    def test_refused_calls_change_nothing(self):
        acc = self.make()
        before = state(acc)
        ok = tf.ones([3])
        cases = [
            (InvalidArgumentError, [tf.ones([2, 2])]),
            (InvalidArgumentError, [tf.ones([2, 2]), ok, ok]),
            (ShapeMismatchError, [tf.ones([4]), ok]),
            (ShapeMismatchError, [tf.ones([2, 2]), tf.ones([2])]),
            (DTypeMismatchError, [tf.ones([2, 2], tf.int32), ok]),
            (DTypeMismatchError, [tf.ones([2, 2], tf.float64), ok]),
            (DTypeMismatchError, [[["a", "b"], ["c", "d"]], ok]),
            (ShapeMismatchError, [tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0])), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2])), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), tf.constant([-1])), ok]),
            (ShapeMismatchError, [tf.ones([2, 2]), tf.IndexedSlices(tf.ones([1, 2]), [0])]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), [[0]]), ok]),
            (InvalidArgumentError, [tf.IndexedSlices(tf.ones([1, 2]), [0.5]), ok]),
        ]
        for error, gradients in cases:
            with pytest.raises(error):
                acc.add(gradients)
            assert state(acc) == before, gradients

    @pytest.mark.usefixtures("layout")
    def test_refused_calls_change_nothing_in_graph(self):
        acc = self.make()
        before = state(acc)
        add = tf.function(
            lambda i: acc.add([tf.IndexedSlices(tf.ones([1, 2]), i), tf.ones([3])]),
            autograph=False,
        )
        with pytest.raises(tf.errors.InvalidArgumentError, match="indices outside"):
            add(tf.constant([5]))
        assert state(acc) == before
        assert as_int(add(tf.constant([1]))) == 1

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_every_state_change_of_a_traced_add_waits_for_its_value_checks(self, deterministic):
        """With lock_span="step" the lock is taken before the gradients exist, so the
        section's writes (counters, growth, rows or sum) must wait for the checks
        themselves: before they did not, and a refused add changed the counters in about
        1 of 40 runs, as the executor happened to order the ops."""
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([3]))],
            deterministic=deterministic,
        )
        add = tf.function(
            lambda i: acc.add([tf.IndexedSlices(tf.ones([1, 2]), i), tf.ones([3])]),
            autograph=False,
        )
        graph = add.get_concrete_function(tf.TensorSpec([1], tf.int32)).graph
        inner = {id(outer): inner for outer, inner in graph.captures}
        handles = (inner[id(acc._state.handle)], inner[id(acc._counters.handle)])
        reads = {"ReadVariableOp", "ResourceGather", "VariableShape"}
        writes = [
            op
            for op in graph.get_operations()
            if op.type not in reads and any(t is h for t in op.inputs for h in handles)
        ]
        checks = {op for op in graph.get_operations() if op.type == "Assert"}
        assert writes and checks
        # The growth check runs as soon as the lock is taken (the next test): it may grow
        # a refused add's buffer, capacity only (test_a_refused_add_at_full_capacity_...).
        growth = [op for op in writes if op.type == "If"]
        assert len(growth) == (1 if deterministic else 0)
        for op in writes:
            if op not in growth:
                assert ancestors(op) & checks, f"{op.type} does not wait for the checks"

    @pytest.mark.parametrize("lock_span", ["step", "add"])
    def test_the_growth_check_of_a_traced_add_runs_before_the_gradients(self, lock_span):
        """With lock_span="step" the growth check (an If kernel: a function call) needs
        only the pending count and the capacity, so it runs while the function still
        computes the gradients; after the last gradient it made the 26K-parameter
        micro-step about 6% slower (A/B in one process). With "add" the lock, and the
        check, come after the gradients."""
        w = tf.Variable(tf.ones([4, 4]))
        acc = GradientAccumulator([w], lock_span=lock_span)

        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(x, w))
            return acc.add(tape.gradient(loss, [w]))

        fn = tf.function(step, autograph=False)
        graph = fn.get_concrete_function(tf.TensorSpec([2, 4])).graph
        (growth,) = [op for op in graph.get_operations() if op.type == "If"]
        matmuls = {op for op in graph.get_operations() if op.type == "MatMul"}
        assert matmuls
        waits = bool(ancestors(growth) & matmuls)
        assert waits == (lock_span == "add")
        x = tf.ones([2, 4])
        for _ in range(5):  # past the initial capacity of 4 contributions
            fn(x)
        np.testing.assert_array_equal(acc.take()[0], np.full([4, 4], 2.0, np.float32))

    @pytest.mark.usefixtures("layout")
    def test_a_refused_add_at_full_capacity_keeps_every_contribution(self):
        """A traced add refused at run time when the buffer is full: its growth check
        may have doubled the buffer (it does not wait for the index check), and nothing
        else changed (the rows below the pending count, the statistics); the next adds
        and the take see every contribution."""
        acc = self.make()
        add = tf.function(
            lambda i, g: acc.add([tf.IndexedSlices(tf.ones([1, 2]) * g, i), tf.ones([3]) * g]),
            autograph=False,
        )
        for g in (2.0, 3.0, 4.0):  # with make()'s 1.0: the first 4 blocks are full
            add(tf.constant([0]), tf.constant(g))
        capacity = acc.state_bytes
        before = state(acc)
        with pytest.raises(tf.errors.InvalidArgumentError, match="indices outside"):
            add(tf.constant([5]), tf.constant(5.0))
        assert state(acc) == before
        assert acc.state_bytes in (capacity, 2 * capacity)
        add(tf.constant([1]), tf.constant(6.0))
        assert acc.state_bytes == 2 * capacity
        first, second = acc.take()
        np.testing.assert_array_equal(first, np.float32([[10 / 5, 10 / 5], [7 / 5, 7 / 5]]))
        np.testing.assert_array_equal(second, np.float32([16 / 5] * 3))

    def test_numpy_and_python_gradients_are_converted(self):
        acc = self.make(reduction="sum")
        acc.add([np.ones((2, 2)), [1.0, 2.0, 3.0]])
        np.testing.assert_array_equal(acc.take()[1], [2.0, 3.0, 4.0])

    @pytest.mark.usefixtures("layout")
    def test_nonfinite_raise(self, mode):
        acc = self.make(nonfinite="raise")
        before = state(acc)
        bad = [tf.ones([2, 2]), tf.constant([1.0, np.nan, 1.0])]
        if mode.name == "eager":
            with pytest.raises(NonFiniteGradientError):
                acc.add(bad)
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match="NonFinite"):
                mode(lambda: acc.add(bad))()
        assert state(acc) == before

    @pytest.mark.usefixtures("layout")
    def test_nonfinite_skip_is_counted(self, mode):
        acc = self.make(nonfinite="skip")
        before = state(acc)
        n = mode(lambda: acc.add([tf.ones([2, 2]), tf.constant([1.0, np.inf, 1.0])]))()
        assert as_int(n) == 0
        after = state(acc)
        assert after[0] == before[0]
        assert after[1].rejected == 1 and after[1].added == before[1].added


# ---------------------------------------------------------------------- distribute


class TestXla:
    """Inside ``tf.function(jit_compile=True)`` (Keras' default on a GPU). XLA compiles no
    mutex (the lock is taken around the compiled call), no change of a variable's shape,
    no gathered handle and no assertion: the deterministic buffer grows before the
    compiled call, for every add the function makes (``sections.record_xla_preparation``),
    a block kept by reference is picked by a ``tf.switch_case``, ``take`` reduces every
    block of the buffer, masked by the pending count, and a ``take`` that would need an
    assertion is refused."""

    def test_a_running_sum_adds_and_takes_under_xla(self):
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([3]))], deterministic=False, num_required=2, reduction="sum"
        )
        step = tf.function(lambda g: acc.take_if_ready() + (acc.add([g]),), jit_compile=True)
        got = [step(tf.fill([3], float(i))) for i in range(5)]
        assert [bool(r[0]) for r in got] == [False, False, True, False, True]
        np.testing.assert_array_equal(got[2][1][0], [1.0, 1.0, 1.0])  # 0 + 1
        np.testing.assert_array_equal(got[4][1][0], [5.0, 5.0, 5.0])  # 2 + 3
        assert acc.count == 1 and acc.statistics().added == 5

    @pytest.mark.parametrize("deterministic", [True, False])
    def test_take_with_num_required_is_refused_under_xla(self, deterministic):
        """XLA drops the run-time check that num_required are pending ("Ignoring
        Assert operator"): a compiled take() went ahead with 1 of 3. Refused when
        traced, naming take_if_ready; nothing changes."""
        acc = GradientAccumulator(
            [tf.Variable(tf.zeros([3]))], deterministic=deterministic, num_required=3
        )
        acc.add([tf.ones([3])])
        before = state(acc)
        with pytest.raises(InvalidArgumentError, match="take_if_ready"):
            tf.function(lambda: acc.take()[0], jit_compile=True)()
        assert state(acc) == before
        ready = tf.function(lambda: acc.take_if_ready()[0], jit_compile=True)()
        assert not bool(ready) and acc.count == 1

    @pytest.mark.parametrize("nested", [False, True])
    def test_deterministic_adds_in_a_compiled_loop_are_refused(self, nested):
        """A loop inside the compiled function adds a number of times known only when it
        runs, so the buffer cannot grow for it first (measured before the check: 6 adds
        in two calls of a 3-iteration loop, pending 6, and a sum of 4 of them, XLA
        dropping the writes past the buffer). Refused when traced, directly or through
        a compiled function called in the loop; nothing changes."""
        v = tf.Variable(tf.zeros([5]))
        acc = GradientAccumulator([v], reduction="sum")
        acc.add([tf.ones([5])])
        before = state(acc)
        add = tf.function(lambda g: acc.add([g]), jit_compile=True)

        def body(i):
            g = tf.fill([5], tf.cast(i, tf.float32))
            with tf.control_dependencies([add(g) if nested else acc.add([g])]):
                return i + 1

        loop = tf.function(lambda: tf.while_loop(lambda i: i < 3, body, [0]), jit_compile=True)
        with pytest.raises(InvalidArgumentError, match="inside a loop.*XLA"):
            loop()
        assert state(acc) == before

    @staticmethod
    def pair() -> tuple[list[tf.Variable], GradientAccumulator, GradientAccumulator]:
        variables = [tf.Variable(tf.zeros([3, 7])), tf.Variable(tf.zeros([5]))]
        return variables, GradientAccumulator(variables), GradientAccumulator(variables)

    @staticmethod
    def assert_same_bits(got, want):
        for a, b in zip(got, want):
            assert a.numpy().tobytes() == b.numpy().tobytes()

    @pytest.mark.usefixtures("layout")
    def test_deterministic_adds_and_takes_give_the_eager_bits(self):
        """Compiled adds and takes of 1..9 contributions (the buffer growing past its 4
        blocks, and with "blocks" past the 4 kept by reference) take bitwise what an
        eager accumulator given the same contributions takes."""
        _, compiled, eager = self.pair()
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        take = tf.function(lambda: compiled.take(), jit_compile=True)
        rng = np.random.default_rng(4)
        for count in (1, 3, 4, 6, 9, 2, 5):
            for _ in range(count):
                g = hard_contributions(1, 21, seed=int(rng.integers(1 << 30)))[0]
                h = hard_contributions(1, 5, seed=int(rng.integers(1 << 30)))[0]
                add(tf.constant(g.reshape(3, 7)), tf.constant(h))
                eager.add([tf.constant(g.reshape(3, 7)), tf.constant(h)])
            assert compiled.count == count
            self.assert_same_bits(take(), eager.take())
        assert compiled.statistics() == eager.statistics()

    @pytest.mark.usefixtures("layout")
    @pytest.mark.parametrize("kind", ["skipped_nan", "float16", "sparse"])
    def test_compiled_adds_of_every_kind_give_the_eager_bits(self, kind):
        """Contributions refused at run time (NaN with nonfinite="skip": the accepted
        ones are written first), float16 variables and sparse gradients: compiled adds
        of six, past the 4 blocks, take bitwise what an eager accumulator takes, with
        the same statistics."""
        rng = np.random.default_rng(3)
        dense = tf.Variable(tf.zeros([4, 5], tf.float16 if kind == "float16" else tf.float32))
        table, bias = tf.Variable(tf.zeros([10, 5])), tf.Variable(tf.zeros([3]))
        variables = [table, bias] if kind == "sparse" else [dense, bias]
        options = {"nonfinite": "skip"} if kind == "skipped_nan" else {}
        compiled, eager = (GradientAccumulator(variables, **options) for _ in range(2))
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        for k in range(6):
            if kind == "sparse":
                values = rng.standard_normal((3, 5)).astype(np.float32)
                first = tf.IndexedSlices(
                    tf.constant(values), tf.constant(rng.integers(0, 10, 3)), tf.constant([10, 5])
                )
            else:
                values = rng.standard_normal((4, 5)).astype(np.float32)
                if kind == "skipped_nan" and k in (1, 4):
                    values[0, 0] = np.nan
                first = tf.cast(tf.constant(values), dense.dtype)
            second = tf.constant(rng.standard_normal(3).astype(np.float32))
            add(first, second)
            eager.add([first, second])
        assert compiled.statistics() == eager.statistics()
        assert compiled.statistics().rejected == (2 if kind == "skipped_nan" else 0)
        self.assert_same_bits(tf.function(compiled.take, jit_compile=True)(), eager.take())

    @pytest.mark.usefixtures("layout")
    def test_several_adds_in_one_compiled_call_find_room(self):
        """Six adds in one compiled function (more than the 4 blocks there are): the
        call grows the buffer first, under the lock, for all six."""
        _, compiled, eager = self.pair()
        grads = [hard_contributions(2, 21 + 5, seed=i) for i in range(2)]
        parts = [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads[0]]
        parts += [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads[1]]

        @tf.function(jit_compile=True)
        def six_adds_then_take():
            for k in range(6):
                compiled.add(list(parts[k % 4]))
            return compiled.take()

        for k in range(6):
            eager.add(list(parts[k % 4]))
        self.assert_same_bits(six_adds_then_take(), eager.take())
        assert compiled.statistics().taken == 6

    def test_a_compiled_call_inside_a_traced_function_prepares_there(self):
        """Keras' shape: an outer ``tf.function`` (not compiled) calls the compiled step.
        The growth runs in the outer function's section, before the call."""
        _, compiled, eager = self.pair()
        inner = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        outer = tf.function(lambda g, h: [inner(g, h), inner(h[0] + g, h)])
        rng = np.random.default_rng(8)
        for _ in range(3):  # 6 pending: past the 4 blocks
            g = tf.constant(rng.standard_normal((3, 7)).astype(np.float32))
            h = tf.constant(rng.standard_normal(5).astype(np.float32))
            outer(g, h)
            eager.add([g, h])
            eager.add([h[0] + g, h])
        assert compiled.count == 6
        self.assert_same_bits(compiled.take(), eager.take())

    @pytest.mark.usefixtures("layout")
    def test_threads_calling_a_compiled_add_give_the_same_bits(self):
        """Four threads each add one of four contributions through one compiled
        function, six times over: the same bits every time (the sorted sum of four)."""
        variables, compiled, _ = self.pair()
        add = tf.function(lambda g, h: compiled.add([g, h]), jit_compile=True)
        take = tf.function(lambda: compiled.take(), jit_compile=True)
        grads = [hard_contributions(1, 26, seed=20 + i)[0] for i in range(4)]
        parts = [(tf.constant(g[:21].reshape(3, 7)), tf.constant(g[21:])) for g in grads]
        add(*parts[0])
        compiled.take()
        results = set()
        for _ in range(6):
            run_threads(4, lambda i: add(*parts[i]))
            assert compiled.count == 4
            results.add(b"".join(t.numpy().tobytes() for t in take()))
        assert len(results) == 1
        assert compiled.statistics().added == 25 and compiled.statistics().taken == 25


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
