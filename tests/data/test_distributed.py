"""ShardedInput under MultiWorkerMirroredStrategy and ParameterServerStrategy, for real.

Both clusters run at once, in subprocesses on 127.0.0.1 (in-process servers cannot be shut
down): ``distributed/scripts/data_mwms.py`` (2 worker processes x 2 replicas) and
``distributed/scripts/data_ps.py`` (3 workers and 1 parameter server; worker 1 is a process of its
own, killed with a step in flight and restarted). Every element id a replica or worker
received is compared with the assignment this process computes from the seed, and the
checkpoints the clusters wrote are restored here, in another process, to continue.
"""

from __future__ import annotations

import collections
import functools

import pytest
import tensorflow as tf

from safevars.data import ShardedInput
from tests.distributed.cluster_harness import run_on_ports, script

SEED, OTHER_SEED = 2024, 7
MWMS_WORKERS, LOCAL_REPLICAS = 2, 2
SPREAD = dict(size=23, batch=2)  # tests/distributed/scripts/data_mwms.py's cases
SHORT = dict(size=21, batch=5)
PS_WORKERS, PS_SIZE, PS_BATCH = 3, 50, 2
TIMEOUT = 300.0  # Seconds for both clusters together; a bound on a hang, not a timing check.


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("data_clusters")

    def mwms(ports: str) -> list[list[str]]:
        return [
            [
                script("data_mwms.py"),
                str(i),
                ports,
                "--seed",
                str(SEED),
                "--other-seed",
                str(OTHER_SEED),
                "--out",
                str(out / "mwms"),
            ]
            for i in range(MWMS_WORKERS)
        ]

    ps = [
        script("data_ps.py"),
        "--seed",
        str(SEED),
        "--other-seed",
        str(OTHER_SEED),
        "--out",
        str(out / "ps"),
        "--size",
        str(PS_SIZE),
        "--batch",
        str(PS_BATCH),
    ]
    *workers, ps_result = run_on_ports(MWMS_WORKERS, lambda ports: mwms(ports) + [ps], TIMEOUT)
    return {"mwms": workers, "ps": ps_result}


@functools.cache
def reference(size: int, seed: int, remainder: str, workers: int, replicas: int) -> ShardedInput:
    """The assignment computed in this process (no strategy, eager)."""
    return ShardedInput(
        size,
        seed=seed,
        num_workers=workers,
        replicas_per_worker=replicas,
        remainder=remainder,
        with_weights=True,
    )


def mwms_reference(remainder: str = "spread", size: int = SPREAD["size"], seed: int = SEED):
    return reference(size, seed, remainder, MWMS_WORKERS, LOCAL_REPLICAS)


def per_replica(results: list[dict], case: str) -> dict[int, tuple[list, list]]:
    """Global replica id -> (ids, weights) it received in ``case``, all steps joined."""
    out: dict[int, tuple[list, list]] = {}
    for worker, result in enumerate(results):
        for step in result["cases"][case]:
            assert [row[0] for row in step] == [
                worker * LOCAL_REPLICAS + j for j in range(LOCAL_REPLICAS)
            ]
            for replica, ids, weights in step:
                got = out.setdefault(replica, ([], []))
                got[0].extend(ids)
                got[1].extend(weights)
    return out


# --------------------------------------------------------------------- MultiWorkerMirrored


class TestMultiWorkerMirrored:
    def test_two_workers_with_two_replicas_each(self, runs):
        for result in runs["mwms"]:
            assert result["replicas"] == MWMS_WORKERS * LOCAL_REPLICAS
            assert set(map(tuple, result["layout"].values())) == {(2, 2, 4)}

    @pytest.mark.parametrize(
        "case, remainder, size",
        [
            ("spread", "spread", SPREAD["size"]),
            ("pad", "pad", SPREAD["size"]),
            ("drop", "drop", SPREAD["size"]),
            ("short", "spread", SHORT["size"]),
        ],
    )
    def test_each_replica_gets_its_shard_in_the_seeds_order(self, runs, case, remainder, size):
        got = per_replica(runs["mwms"], case)
        want = mwms_reference(remainder, size)
        for replica, (ids, _) in got.items():
            worker, local = divmod(replica, LOCAL_REPLICAS)
            assert ids == want.shard_ids(0, worker, local).tolist(), (case, replica)

    def test_an_epoch_is_the_dataset_exactly_once(self, runs):
        for case, size in (("spread", SPREAD["size"]), ("short", SHORT["size"])):
            ids = [i for got, _ in per_replica(runs["mwms"], case).values() for i in got]
            assert sorted(ids) == list(range(size)), case

    def test_tail_policies_for_a_size_that_does_not_divide(self, runs):
        size, shards = SPREAD["size"], MWMS_WORKERS * LOCAL_REPLICAS  # 23 = 5 * 4 + 3
        pad = per_replica(runs["mwms"], "pad")
        real = [i for ids, w in pad.values() for i, x in zip(ids, w) if x == 1.0]
        copies = [i for ids, w in pad.values() for i, x in zip(ids, w) if x == 0.0]
        assert sorted(real) == list(range(size))
        assert len(copies) == shards - size % shards == 1
        assert copies == [mwms_reference("pad").shard_ids(0, 0, 0)[0]]  # the epoch's first
        assert {len(ids) for ids, _ in pad.values()} == {6}
        drop = [i for ids, _ in per_replica(runs["mwms"], "drop").values() for i in ids]
        assert len(drop) == len(set(drop)) == shards * (size // shards)
        spread = per_replica(runs["mwms"], "spread")
        assert [len(spread[r][0]) for r in range(shards)] == [6, 6, 6, 5]

    def test_another_seed_gives_another_order(self, runs):
        other = per_replica(runs["mwms"], "other_seed")
        same = per_replica(runs["mwms"], "spread")
        assert all(other[r][0] != same[r][0] for r in other)
        want = mwms_reference(seed=OTHER_SEED)
        for replica, (ids, _) in other.items():
            assert ids == want.shard_ids(0, *divmod(replica, LOCAL_REPLICAS)).tolist()

    def test_a_restored_pipeline_continues_exactly(self, runs):
        before = per_replica(runs["mwms"], "before_checkpoint")
        after = per_replica(runs["mwms"], "after_checkpoint")
        restored = per_replica(runs["mwms"], "restored")
        want = mwms_reference()
        for replica in range(MWMS_WORKERS * LOCAL_REPLICAS):
            worker, local = divmod(replica, LOCAL_REPLICAS)
            assert restored[replica] == after[replica]
            # Epoch 0, then epoch 1 reshuffled, without a gap or a repeat at the checkpoint.
            epochs = [want.shard_ids(e, worker, local).tolist() for e in (0, 1)]
            assert before[replica][0] + after[replica][0] == epochs[0] + epochs[1]
        for worker, result in enumerate(runs["mwms"]):
            lengths = [want.shard_length(*divmod(g, LOCAL_REPLICAS)) for g in range(4)]
            mine = range(worker * LOCAL_REPLICAS, (worker + 1) * LOCAL_REPLICAS)
            # 4 steps of 2: epoch 0 (3 batches) and one batch of epoch 1, own shards only.
            assert result["positions_at_checkpoint"] == [
                lengths[g] + 2 if g in mine else 0 for g in range(4)
            ]

    def test_a_new_process_restores_each_workers_checkpoint(self, runs):
        after = per_replica(runs["mwms"], "after_checkpoint")
        for worker, result in enumerate(runs["mwms"]):
            data = ShardedInput(
                SPREAD["size"],
                seed=SEED,
                num_workers=MWMS_WORKERS,
                replicas_per_worker=LOCAL_REPLICAS,
                with_weights=True,
            )
            tf.train.Checkpoint(data=data).read(result["checkpoint"]).assert_consumed()
            for local in range(LOCAL_REPLICAS):
                batches = data.dataset(worker, local, batch_size=SPREAD["batch"]).take(2)
                ids = [i for (x, _), _ in batches for i in x.numpy().tolist()]
                assert ids == after[worker * LOCAL_REPLICAS + local][0]


# --------------------------------------------------------------------- ParameterServer


def ps_reference(seed: int = SEED) -> ShardedInput:
    return reference(PS_SIZE, seed, "spread", PS_WORKERS, 1)


def by_shard(log: list) -> dict[int, list[tuple[int, int]]]:
    """Worker -> [(counter, id)] it committed, sorted by counter."""
    out = collections.defaultdict(list)
    for worker, ids, counters in log:
        out[worker].extend(zip(counters, ids))
    return {w: sorted(pairs) for w, pairs in out.items()}


def expected_id(data: ShardedInput, worker: int, counter: int) -> int:
    epoch, slot = divmod(counter, data.shard_length(worker))
    return int(_ids(data, epoch, worker)[slot])


@functools.cache
def _ids(data: ShardedInput, epoch: int, worker: int):
    return data.shard_ids(epoch, worker)


class TestParameterServer:
    def test_positions_live_on_the_parameter_server(self, runs):
        run = runs["ps"]
        assert run["positions_device"] == "/job:ps/replica:0/task:0/device:CPU:0"
        assert run["num_workers"] == PS_WORKERS and run["lengths"] == [17, 17, 16]

    def test_every_committed_element_is_its_workers_shard_in_order(self, runs):
        want = ps_reference()
        shards = by_shard(runs["ps"]["committed"])
        assert set(shards) == set(range(PS_WORKERS))
        for worker, pairs in shards.items():
            counters = [c for c, _ in pairs]
            assert counters == list(range(len(counters))), worker  # no gap, no repeat
            # Every epoch reshuffled from the seed, whatever step or worker order.
            assert [i for _, i in pairs] == [expected_id(want, worker, c) for c in counters]

    def test_epoch_zero_is_committed_and_trained_exactly_once(self, runs):
        run = runs["ps"]
        epoch0 = [
            i
            for w, pairs in by_shard(run["committed"]).items()
            for c, i in pairs
            if c < run["lengths"][w]
        ]
        assert sorted(epoch0) == list(range(PS_SIZE))
        # The killed step took a batch but neither trained on it nor committed it.
        assert run["trained"][:PS_SIZE] == [1] * PS_SIZE

    def test_a_killed_workers_in_flight_batch_is_delivered_again(self, runs):
        run = runs["ps"]
        shard, counter = run["in_flight"]
        assert shard == 1
        assert run["positions_when_killed"][1] == counter  # taken, not committed
        redelivered = [
            (w, ids) for w, ids, counters in run["committed"] if counters[0] == counter and w == 1
        ]
        assert len(redelivered) == 1  # once, by the restarted worker 1, after the kill
        want = ps_reference()
        assert redelivered[0][1] == [
            expected_id(want, 1, counter + k) for k in range(len(redelivered[0][1]))
        ]
        assert run["phase2_positions"][1] >= run["lengths"][1]

    def test_a_restored_pipeline_continues_exactly(self, runs):
        run = runs["ps"]
        original, restored = by_shard(run["committed"]), by_shard(run["restored"])
        for worker in range(PS_WORKERS):
            start, end = run["at_checkpoint"][worker], run["lengths"][worker]
            assert restored[worker][0][0] == start
            assert [p for p in restored[worker] if p[0] < end] == [
                p for p in original[worker] if start <= p[0] < end
            ]

    def test_a_new_process_restores_the_coordinators_checkpoint(self, runs):
        run = runs["ps"]
        data = ShardedInput(PS_SIZE, seed=SEED, num_workers=PS_WORKERS)
        tf.train.Checkpoint(data=data).read(run["checkpoint"]).assert_consumed()
        original = by_shard(run["committed"])
        for worker in range(PS_WORKERS):
            start = run["at_checkpoint"][worker]
            assert data.position(worker) == (0, start)
            batches = data.dataset(worker, batch_size=PS_BATCH).take(3)
            ids = [i for x, _ in batches for i in x.numpy().tolist()]
            assert ids == [i for c, i in original[worker] if c >= start][: len(ids)]

    def test_another_seed_gives_another_order(self, runs):
        run = runs["ps"]
        other, want = by_shard(run["other"]), ps_reference(OTHER_SEED)
        same = by_shard(run["committed"])
        for worker, pairs in other.items():
            assert [i for _, i in pairs] == [expected_id(want, worker, c) for c, _ in pairs]
            assert [i for _, i in pairs] != [i for _, i in same[worker][: len(pairs)]]

    def test_single_shard_pipelines_are_refused_on_the_coordinator(self, runs):
        error = runs["ps"]["errors"]["dataset"]
        assert error.startswith("UnsupportedStrategyError") and "per_worker_dataset" in error
