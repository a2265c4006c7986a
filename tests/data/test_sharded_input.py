"""safevars.data.ShardedInput in one process: the assignment, the pipelines, the position.

The clusters (MultiWorkerMirrored 2x2, ParameterServer with a failing worker) are in
``test_distributed.py``; here: the layout for many sizes, determinism, checkpoints,
commits, MirroredStrategy on two logical CPUs, and the argument errors.
"""

from __future__ import annotations

import collections
import hashlib
import random
import time

import numpy as np
import pytest
import tensorflow as tf

from safevars.data import REMAINDER_POLICIES, ShardedInput, _layout
from safevars.errors import (
    InvalidArgumentError,
    NotCallableError,
    SafeVarsError,
    UnsupportedStrategyError,
)
from safevars.rng import ReplicaRNG
from tests.support.graph_walk import ancestors

SEED = 1234


def epoch_ids(data: ShardedInput, epoch: int) -> list[list[int]]:
    return [
        data.shard_ids(epoch, *divmod(g, data.replicas_per_worker)).tolist()
        for g in range(data.num_shards)
    ]


def drain(data: ShardedInput, worker: int = 0, replica: int = 0, **kwargs) -> list:
    """Every element of ``data.dataset(...)`` (eagerly), committed one by one."""
    out = []
    for element, receipt in data.dataset(worker, replica, **kwargs):
        out.append(tf.nest.map_structure(lambda t: t.numpy().tolist(), element))
        data.commit(receipt)
    return out


@pytest.fixture(params=["whole_epochs", "chunks"])
def unbatched_path(request, monkeypatch):
    """Both ways an unbatched stream of tensors or ids looks its elements up: an epoch of
    the shard at once (small data, the default), or chunks (an epoch over the byte
    bound; chunks of 4 here, so that an epoch spans several)."""
    if request.param == "chunks":
        monkeypatch.setattr(_layout, "_WHOLE_EPOCH_BYTES", 0)
        monkeypatch.setattr(_layout, "_CHUNK", 4)
    return request.param


# --------------------------------------------------------------------- the assignment


class TestLayout:
    @pytest.mark.parametrize("size", [4, 7, 12, 13, 23, 64])
    @pytest.mark.parametrize("workers, replicas", [(1, 1), (2, 2), (3, 1), (1, 4)])
    def test_every_policy_for_sizes_that_divide_or_not(self, size, workers, replicas):
        shards = workers * replicas
        q, r = divmod(size, shards)
        for remainder in REMAINDER_POLICIES:
            if size < shards and remainder != "pad":
                continue
            data = ShardedInput(
                size,
                seed=SEED,
                num_workers=workers,
                replicas_per_worker=replicas,
                remainder=remainder,
            )
            for epoch in (0, 1):
                ids = epoch_ids(data, epoch)
                flat = [i for shard in ids for i in shard]
                lengths = [len(shard) for shard in ids]
                if remainder == "spread":  # exactly once
                    assert sorted(flat) == list(range(size))
                    assert lengths == [q + 1] * r + [q] * (shards - r)
                elif remainder == "drop":  # at most once, r left out
                    assert len(set(flat)) == len(flat) == q * shards
                    assert set(flat) <= set(range(size))
                else:  # pad: every element, then the epoch's first shards - r again
                    assert lengths == [q + (r > 0)] * shards
                    assert set(flat) == set(range(size))
                    extra = collections.Counter(flat) - collections.Counter(range(size))
                    firsts = [shard[0] for shard in ids][: (shards - r) % shards]
                    assert sorted(extra.elements()) == sorted(firsts)
                for g, shard in enumerate(ids):
                    assert data.shard_length(*divmod(g, replicas)) == len(shard)

    def test_dropped_elements_change_every_epoch(self):
        data = ShardedInput(23, seed=SEED, num_workers=2, replicas_per_worker=2, remainder="drop")
        missing = [
            frozenset(range(23)) - {i for s in epoch_ids(data, e) for i in s} for e in range(4)
        ]
        assert all(len(m) == 3 for m in missing) and len(set(missing)) > 1

    def test_shards_are_strided_slots_of_one_epoch_order(self):
        data = ShardedInput(12, seed=SEED, num_workers=1, replicas_per_worker=3)
        ids = epoch_ids(data, 0)
        order = [ids[p % 3][p // 3] for p in range(12)]
        assert sorted(order) == list(range(12))
        # The same order as one shard over everything.
        assert order == ShardedInput(12, seed=SEED).shard_ids(0).tolist()

    def test_same_seed_same_assignment_other_seed_or_epoch_another(self):
        a = ShardedInput(100, seed=SEED, num_workers=2, replicas_per_worker=2)
        b = ShardedInput(100, seed=ReplicaRNG(SEED), num_workers=2, replicas_per_worker=2)
        assert epoch_ids(a, 0) == epoch_ids(b, 0)
        assert epoch_ids(a, 3) == epoch_ids(b, 3)
        other = ShardedInput(100, seed=SEED + 1, num_workers=2, replicas_per_worker=2)
        assert epoch_ids(a, 0) != epoch_ids(other, 0)
        assert epoch_ids(a, 0) != epoch_ids(a, 1)

    def test_the_order_is_pinned(self):
        # Bitwise the same in every process and run: a change of this digest changes
        # every user's data order (a TensorFlow change to RandomIndexShuffle included).
        data = ShardedInput(1000, seed=SEED, num_workers=2, replicas_per_worker=2)
        digest = hashlib.sha256(np.asarray(epoch_ids(data, 5), np.int64).tobytes())
        assert digest.hexdigest()[:16] == PINNED_ORDER
        assert epoch_ids(data, 0)[0][:5] == PINNED_FIRST

    def test_unshuffled_is_plain_strided_sharding(self):
        data = ShardedInput(10, seed=SEED, num_workers=2, replicas_per_worker=2, shuffle=False)
        assert epoch_ids(data, 0) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
        assert epoch_ids(data, 1) == epoch_ids(data, 0)


PINNED_ORDER = "5bb6a96f57b684ab"  # sha256[:16] of epoch 5, seed 1234, 1000 elements, 2x2
PINNED_FIRST = [29, 951, 255, 534, 723]


# --------------------------------------------------------------------- pipelines


class TestPipeline:
    @pytest.mark.parametrize("batch_size", [None, 3])
    @pytest.mark.usefixtures("unbatched_path")
    def test_sources_give_the_assignment(self, batch_size):
        table = np.arange(30) * 10
        features = {"x": table, "y": np.arange(30.0) / 2}
        ids = ShardedInput(30, seed=SEED, num_workers=2, replicas_per_worker=2)
        want = ids.shard_ids(0, 1, 1).tolist() + ids.shard_ids(1, 1, 1).tolist()
        sources = {
            "ids": (30, lambda e: e),
            "tensors": (
                features,
                lambda e: [v // 10 for v in e["x"]] if batch_size else e["x"] // 10,
            ),
            "dataset": (
                tf.data.Dataset.from_tensor_slices(table).map(lambda v: v + 1),
                lambda e: [(v - 1) // 10 for v in e] if batch_size else (e - 1) // 10,
            ),
        }
        for name, (source, to_id) in sources.items():
            data = ShardedInput(source, seed=SEED, num_workers=2, replicas_per_worker=2)
            got = drain(data, 1, 1, batch_size=batch_size, epochs=2)
            flat = [i for b in got for i in to_id(b)] if batch_size else [to_id(e) for e in got]
            assert flat == want, name
            if batch_size:  # batches stay inside an epoch: 7 = 3 + 3 + 1 per epoch
                assert [len(to_id(b)) for b in got] == [3, 3, 1, 3, 3, 1], name

    def test_map_fn_and_weights(self):
        data = ShardedInput(
            10,
            seed=SEED,
            num_workers=4,
            remainder="pad",
            map_fn=lambda i: i * 2,
            with_weights=True,
        )
        got = drain(data, 3, epochs=1)
        assert [x // 2 for x, _ in got] == data.shard_ids(0, 3).tolist()
        assert [w for _, w in got] == [1.0, 1.0, 0.0]  # shard 3 of 10 = 2 * 4 + 2 pads

    @pytest.mark.usefixtures("unbatched_path")
    def test_padded_tensors_carry_their_weights(self):
        table = np.arange(10) * 10
        data = ShardedInput(table, seed=SEED, num_workers=4, remainder="pad", with_weights=True)
        got = drain(data, 3, epochs=2)
        assert [x // 10 for x, _ in got] == data.shard_ids(0, 3).tolist() + data.shard_ids(
            1, 3
        ).tolist()
        assert [w for _, w in got] == [1.0, 1.0, 0.0] * 2

    def test_unbatched_streams_gather_an_epoch_at_once_up_to_the_byte_bound(self, monkeypatch):
        def whole(data):
            return _layout._gathers_whole_epochs(data._layout, data._elements)

        rows = {"x": np.zeros((101, 8), np.float32), "y": np.zeros(101, np.int64)}
        data = ShardedInput(rows, seed=SEED, num_workers=2)  # 51 slots on shard 0
        weighted = ShardedInput(rows, seed=SEED, num_workers=2, with_weights=True)
        assert whole(data) and whole(weighted) and whole(ShardedInput(101, seed=SEED))
        # 51 x (32 + 8 + 16 receipt) = 2856 bytes, 51 x 4 more with weights.
        monkeypatch.setattr(_layout, "_WHOLE_EPOCH_BYTES", 2856)
        assert whole(data) and not whole(weighted)
        monkeypatch.setattr(_layout, "_WHOLE_EPOCH_BYTES", 2855)
        assert not whole(data)
        monkeypatch.undo()
        strings = ShardedInput(np.array([b"a", b"bc"] * 5), seed=SEED)  # no fixed size
        mapped = ShardedInput(10, seed=SEED, map_fn=lambda i: i)  # one lookup per element
        assert not whole(strings) and not whole(mapped)
        assert sorted(e.numpy() for e, _ in strings.dataset(epochs=1)) == [b"a"] * 5 + [b"bc"] * 5

    def test_order_does_not_depend_on_thread_timing(self):
        def jitter(i):  # each element takes a random time on one of many threads
            def sleep(v):
                time.sleep(random.random() * 0.002)
                return v

            return tf.numpy_function(sleep, [i], tf.int64, stateful=True)

        data = ShardedInput(40, seed=SEED, num_workers=2, map_fn=jitter)
        options = tf.data.Options()
        options.threading.private_threadpool_size = 8
        for _ in range(2):
            got = [int(e) for e, _ in data.dataset(1, epochs=1).with_options(options)]
            assert got == data.shard_ids(0, 1).tolist()

    def test_iterating_in_a_tf_function(self):
        data = ShardedInput(9, seed=SEED, num_workers=3)
        iterator = iter(data.dataset(2, batch_size=2))

        @tf.function
        def step():
            return data.next(iterator)

        got = [step().numpy().tolist() for _ in range(3)]
        assert got == [
            data.shard_ids(0, 2).tolist()[:2],
            data.shard_ids(0, 2).tolist()[2:],
            data.shard_ids(1, 2).tolist()[:2],
        ]
        assert data.position(2) == (1, 2)


# --------------------------------------------------------------------- position


class TestPosition:
    @pytest.mark.usefixtures("unbatched_path")
    def test_read_ahead_is_not_consumed(self):
        data = ShardedInput(20, seed=SEED, num_workers=2)
        iterator = iter(data.dataset(1))  # prefetches ahead of what is committed
        received = [next(iterator) for _ in range(5)]
        for _, receipt in received[:3]:
            data.commit(receipt)
        assert data.position(1) == (0, 3)
        got = [int(e) for e, _ in data.dataset(1, epochs=1)]
        assert got == data.shard_ids(0, 1).tolist()[3:]

    @pytest.mark.parametrize("batch_size", [None, 4])
    @pytest.mark.usefixtures("unbatched_path")
    def test_checkpoint_then_a_new_object_continues_exactly(self, tmp_path, batch_size):
        def make():
            return ShardedInput(np.arange(25) * 3, seed=SEED, num_workers=2, replicas_per_worker=2)

        uninterrupted = make()
        want = drain(uninterrupted, 1, 0, batch_size=batch_size, epochs=3)
        data = make()
        iterator = iter(data.dataset(1, 0, batch_size=batch_size))
        first = []
        for _ in range(3 if batch_size else 9):  # into epoch 1 (6 slots per epoch)
            element, receipt = next(iterator)
            first.append(element.numpy().tolist())
            data.commit(receipt)
        consumed = len(sum(first, [])) if batch_size else len(first)
        path = tf.train.Checkpoint(data=data).write(str(tmp_path / "ckpt"))
        next(iterator)  # taken, not committed, not saved
        restored = make()
        tf.train.Checkpoint(data=restored).read(path).assert_consumed()
        assert restored.position(1, 0) == data.position(1, 0) == divmod(consumed, 6)
        assert data.position(1, 0)[0] == 1
        rest = drain(restored, 1, 0, batch_size=batch_size, epochs=2)
        assert first + rest == want

    def test_restoring_another_layout_fails_when_building(self, tmp_path):
        data = ShardedInput(25, seed=SEED)
        path = tf.train.Checkpoint(data=data).write(str(tmp_path / "ckpt"))
        other = ShardedInput(25, seed=SEED + 1)
        tf.train.Checkpoint(data=other).read(path)
        with pytest.raises(InvalidArgumentError, match="another layout"):
            other.dataset()

    def test_commit_refuses_a_gap_and_a_repeat(self, mode):
        data = ShardedInput(20, seed=SEED, num_workers=2)
        iterator = iter(data.dataset(0, batch_size=2))
        _, first = next(iterator)
        _, second = next(iterator)
        commit = mode(lambda r: data.commit(r))
        # The message names shard 0, the receipt's start 2 and the committed position 0.
        position = r"\[shard, receipt start, committed position\]:\] \[0\] \[2\] \[0\]"
        with pytest.raises(tf.errors.InvalidArgumentError, match=f"never committed.*{position}"):
            commit(second)  # would skip the first batch
        assert data.positions.numpy().tolist() == [0, 0]  # nothing committed
        commit(first)
        with pytest.raises(tf.errors.InvalidArgumentError, match="repeats"):
            commit(first)  # would count it twice
        assert data.positions.numpy().tolist() == [2, 0]
        commit(second)
        assert data.positions.numpy().tolist() == [4, 0]
        commit(tf.zeros([0, 2], tf.int64))  # an empty (partial) batch
        assert data.positions.numpy().tolist() == [4, 0]

    def test_a_pipeline_built_before_later_commits_cannot_commit(self):
        data = ShardedInput(20, seed=SEED)
        stale = data.dataset()
        for _, receipt in data.dataset().take(3):
            data.commit(receipt)
        _, receipt = next(iter(stale))  # starts again at 0: would repeat 3 elements
        with pytest.raises(tf.errors.InvalidArgumentError, match="repeats"):
            data.commit(receipt)
        assert data.position() == (0, 3)

    def test_a_commit_is_one_assert_and_one_scatter_without_a_cond(self):
        """The per-element cost: tf.debugging.Assert would put the check (int64 data) in a
        tf.cond, about 2.5 µs of a ~45 µs element in the benchmark's pipeline; a strided
        slice per receipt column instead of one Unpack cost about 2 µs of 26."""
        data = ShardedInput(6, seed=SEED)
        commit = tf.function(data.commit, autograph=False)
        for spec in (tf.TensorSpec([2], tf.int64), tf.TensorSpec([None, 2], tf.int64)):
            graph = commit.get_concrete_function(spec).graph
            types = [op.type for op in graph.get_operations()]
            assert types.count("Assert") == 1 and types.count("ResourceScatterMax") == 1
            assert not {"If", "StatelessIf", "Switch", "Merge"} & set(types)
            assert types.count("Unpack") == 1
        element = commit.get_concrete_function(tf.TensorSpec([2], tf.int64)).graph
        assert "StridedSlice" not in {op.type for op in element.get_operations()}
        commit(tf.constant([0, 0], tf.int64))
        assert data.position() == (0, 1)
        commit(tf.constant([[0, 1], [0, 2]], tf.int64))
        assert data.position() == (0, 3)

    def test_commit_runs_after_its_dependencies(self):
        data = ShardedInput(6, seed=SEED)
        counter = tf.Variable(0)
        iterator = iter(data.dataset())

        @tf.function
        def step():
            element, receipt = next(iterator)
            data.commit(receipt, after=counter.assign_add(1))
            return element

        graph = step.get_concrete_function().graph
        (scatter,) = [op for op in graph.get_operations() if op.type == "ResourceScatterMax"]
        assert "AssignAddVariableOp" in {op.type for op in ancestors(scatter)}
        step()  # the commit runs although nothing uses it
        assert int(counter.numpy()) == 1 and data.position() == (0, 1)


# --------------------------------------------------------------------- MirroredStrategy


class TestMirrored:
    def test_each_replica_gets_its_shard_and_restores(self, mirrored_strategy, tmp_path):
        strategy = mirrored_strategy
        with strategy.scope():
            data = ShardedInput(11, seed=SEED, remainder="spread")
        assert (data.num_workers, data.replicas_per_worker) == (1, 2)
        iterator = iter(data.distribute(strategy, batch_size=2))

        @tf.function
        def step(iterator):
            ids, receipt = next(iterator)
            out = strategy.run(lambda x: tf.identity(x), args=(ids,))
            data.commit(receipt, after=out)
            return out

        got = [[], []]
        for i in range(5):  # epoch 0 (3 steps), then 2 of epoch 1
            if i == 4:
                path = tf.train.Checkpoint(data=data).write(str(tmp_path / "ckpt"))
            for r, ids in enumerate(strategy.experimental_local_results(step(iterator))):
                got[r].append(ids.numpy().tolist())
        for r in range(2):
            want = data.shard_ids(0, 0, r).tolist() + data.shard_ids(1, 0, r).tolist()
            assert [i for b in got[r] for i in b] == want[: len(sum(got[r], []))]
        assert [len(b) for b in got[1]] == [2, 2, 1, 2, 2]  # shard 1 has 5 of 11
        with strategy.scope():
            restored = ShardedInput(11, seed=SEED, remainder="spread")
        tf.train.Checkpoint(data=restored).read(path).assert_consumed()
        again = strategy.experimental_local_results(_one_step(strategy, restored))
        assert [ids.numpy().tolist() for ids in again] == [got[0][4], got[1][4]]

    def test_a_strategy_of_another_size_is_refused(self, mirrored_strategy):
        data = ShardedInput(10, seed=SEED)  # outside the scope: one shard
        with pytest.raises(InvalidArgumentError, match="replicas_per_worker=1"):
            data.distribute(mirrored_strategy, batch_size=2)


def _one_step(strategy, data):
    ids, receipt = next(iter(data.distribute(strategy, batch_size=2)))
    data.commit(receipt)
    return ids


# --------------------------------------------------------------------- errors


class TestErrors:
    @pytest.mark.parametrize(
        "kwargs, argument",
        [
            (dict(source=-1), "source"),
            (dict(source=0), "source"),
            (dict(source=True), "source"),
            (dict(source="abc"), "source"),
            (dict(source=object()), "source"),
            (dict(source={"a": np.zeros(3), "b": np.zeros(4)}), "source"),
            (dict(source=np.float32(1.0)), "source"),
            (dict(source=tf.data.Dataset.range(3).repeat()), "source"),
            (dict(source=tf.data.Dataset.range(6).filter(lambda i: i > 2)), "source"),
            (dict(source=10, seed=-1), "seed"),
            (dict(source=10, seed=1.5), "seed"),
            (dict(source=10, remainder="wrap"), "remainder"),
            (dict(source=10, num_workers=0), "num_workers"),
            (dict(source=10, replicas_per_worker=-2), "replicas_per_worker"),
            (dict(source=10, shuffle="yes"), "shuffle"),
            (dict(source=10, with_weights=1), "with_weights"),
            (dict(source=3, num_workers=4), "remainder='pad'"),
        ],
    )
    def test_bad_arguments_name_the_argument(self, kwargs, argument):
        kwargs = {"seed": SEED, **kwargs}
        with pytest.raises(InvalidArgumentError, match=argument) as info:
            ShardedInput(**kwargs)
        assert isinstance(info.value, (SafeVarsError, ValueError))

    def test_non_random_access_dataset_names_the_fix(self):
        source = (
            tf.data.Dataset.range(6)
            .filter(lambda i: i > 2)
            .apply(tf.data.experimental.assert_cardinality(3))
        )
        with pytest.raises(InvalidArgumentError, match="random access"):
            ShardedInput(source, seed=SEED)
        # With .cache() it works.
        assert ShardedInput(source.cache(), seed=SEED).num_elements == 3

    def test_map_fn_must_be_callable(self):
        with pytest.raises(NotCallableError, match="map_fn"):
            ShardedInput(10, seed=SEED, map_fn=3)

    @pytest.mark.parametrize(
        "call, argument",
        [
            (lambda d: d.dataset(2), "worker"),
            (lambda d: d.dataset(0, 1), "replica"),
            (lambda d: d.dataset(-1), "worker"),
            (lambda d: d.dataset(batch_size=0), "batch_size"),
            (lambda d: d.dataset(epochs=0), "epochs"),
            (lambda d: d.shard_ids(-1), "epoch"),
            (lambda d: d.steps_per_epoch(0), "batch_size"),
        ],
    )
    def test_bad_pipeline_arguments(self, call, argument):
        data = ShardedInput(10, seed=SEED, num_workers=2)
        with pytest.raises(InvalidArgumentError, match=argument):
            call(data)
        assert data.positions.numpy().tolist() == [0, 0]

    def test_parameter_server_only_and_unsupported_strategies(self):
        data = ShardedInput(10, seed=SEED)
        with pytest.raises(UnsupportedStrategyError, match="ParameterServerStrategy"):
            data.per_worker_dataset(object())
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        central = tf.distribute.experimental.CentralStorageStrategy(devices)
        with central.scope(), pytest.raises(UnsupportedStrategyError, match="MirroredStrategy"):
            ShardedInput(10, seed=SEED)
        with pytest.raises(UnsupportedStrategyError):
            data.distribute(central, batch_size=2)
