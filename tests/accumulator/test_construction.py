"""GradientAccumulator: construction and the block layout of deterministic storage."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.accumulator import state as accumulator_state
from safevars.errors import (
    DTypeMismatchError,
    InvalidArgumentError,
)
from tests.support.accumulator import as_int
from tests.support.graph_walk import ancestors


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
        (reduce,) = [op for op in calls if "reduce_pending_rows" in name(op)]
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
