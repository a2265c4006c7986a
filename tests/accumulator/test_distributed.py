"""GradientAccumulator under ParameterServerStrategy and MultiWorkerMirroredStrategy, for real.

Each cluster runs in its own subprocesses on 127.0.0.1 (in-process servers cannot be
shut down), both clusters at once: ``distributed/scripts/accumulator_ps.py`` (3 workers and 2
parameter servers in one process, driven by ``ClusterCoordinator``) and
``distributed/scripts/accumulator_mwms.py`` (one process per worker, ``TF_CONFIG``). The
subprocesses print arrays as the hex of their bytes; this process recomputes the
expected results with a local, non-distributed accumulator and compares bitwise.
MirroredStrategy is covered in test_mirrored.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator
from safevars.distribute import SUPPORTED_STRATEGIES
from safevars.errors import UnsupportedStrategyError
from tests.distributed.cluster_harness import run_on_ports, script
from tests.distributed.scripts.accumulator_ps import counted_contributions, hard_contributions
from tests.distributed.scripts.script_common import hexes

SEED = 11
PS_WORKERS, PS_TASKS, PS_COUNT, PS_ROUNDS = 3, 2, 48, 40
MWMS_WORKERS, MWMS_STEPS = 2, 3
CLUSTER_TIMEOUT = 300.0  # Seconds for both clusters (all their processes) to finish.


@pytest.fixture(scope="module", params=["one_row", "blocks"])
def clusters(request) -> dict:
    """One ParameterServerStrategy cluster and one 2-process MultiWorkerMirroredStrategy
    cluster, run at the same time. With "blocks" the deterministic accumulators store
    blocks of rows and keep the first pending ones by reference (the layout of large
    gradients, here from 4 elements: ``--blocks``); the expected results are the same
    bits."""
    blocks = ["--blocks"] if request.param == "blocks" else []
    ps = [
        script("accumulator_ps.py"),
        "--seed",
        str(SEED),
        "--workers",
        str(PS_WORKERS),
        "--ps",
        str(PS_TASKS),
        "--count",
        str(PS_COUNT),
        "--rounds",
        str(PS_ROUNDS),
        *blocks,
    ]

    def commands(ports: str) -> list[list[str]]:
        mwms = [
            [
                script("accumulator_mwms.py"),
                str(i),
                ports,
                "--seed",
                str(SEED),
                "--steps",
                str(MWMS_STEPS),
                *blocks,
            ]
            for i in range(MWMS_WORKERS)
        ]
        return [ps] + mwms

    results = run_on_ports(MWMS_WORKERS, commands, CLUSTER_TIMEOUT, dump_after=True)
    return {"ps": results[0], "mwms": results[1:]}


# --------------------------------------------------------------------- references


def split(row: np.ndarray) -> list[tf.Tensor]:
    return [tf.constant(row[:4].reshape(2, 2)), tf.constant(row[4:])]


def reference(rows: np.ndarray, **kwargs) -> list[str]:
    """What one local accumulator takes after adding ``rows`` in index order."""
    acc = GradientAccumulator(
        [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([2]))], **kwargs
    )
    for row in rows:
        acc.add(split(row))
    return hexes(acc.take())


def flat(hex_pair: list[str]) -> np.ndarray:
    return np.concatenate([np.frombuffer(bytes.fromhex(h), np.float32) for h in hex_pair])


# --------------------------------------------------------------------- ParameterServerStrategy


class TestParameterServer:
    def test_state_and_lock_live_on_the_first_variables_parameter_server(self, clusters):
        devices = clusters["ps"]["devices"]
        assert devices["kernel"].startswith("/job:ps/replica:0/task:1")
        assert devices["exact"] == devices["exact_lock"] == devices["kernel"]

    def test_scheduled_adds_from_every_worker_count_once(self, clusters):
        run = clusters["ps"]
        assert run["scheduled_workers"] == [list(range(PS_WORKERS))] * 2
        assert run["scheduled_added"] == [PS_COUNT, PS_COUNT]
        # Read before the second take: pending, added, ..., taken, takes.
        assert run["exact_statistics"] == [PS_COUNT, 2 * PS_COUNT, 0, 0, 0, PS_COUNT, 1, 0]

    def test_arrival_order_does_not_change_a_bit(self, clusters):
        run = clusters["ps"]
        rows = hard_contributions(PS_COUNT, SEED)
        want = reference(rows)
        # Two shuffled schedules, then every worker looping at once, forwards and back.
        assert run["exact_takes"] == [want, want]
        assert run["loop_workers"] == [list(range(PS_WORKERS))] * 2
        assert run["loop_takes"] == [want, want]
        # The data is order-sensitive: float32 sums in the two schedules' orders differ.
        naive = [
            np.add.reduce(rows[order], axis=0, dtype=np.float32).tobytes()
            for order in run["orders"]
        ]
        assert run["orders"][0] != run["orders"][1] and naive[0] != naive[1]
        # And the result is the mean within float32 rounding.
        exact_mean = rows.astype(np.float64).mean(axis=0)
        np.testing.assert_allclose(flat(want), exact_mean, rtol=2**-23, atol=0)

    def test_concurrent_adds_and_takes_lose_and_duplicate_nothing(self, clusters):
        c = clusters["ps"]["contention"]
        n = PS_WORKERS * PS_ROUNDS
        expected = counted_contributions(n).sum(axis=0)
        assert c["contributions"] == n and c["expected"] == expected.tolist()
        # Taken by the coordinator while the workers added: everything, exactly once.
        assert c["coordinator_taken"] == expected.tolist()
        pending, added, *_, taken, takes, discarded = c["counted_statistics"]
        assert (pending, added, taken, discarded) == (0, n, n, 0)
        assert 1 <= takes < c["coordinator_takes"]  # the extra last take found nothing
        assert c["last_take"] == [0.0] * len(expected)
        # Taken by the workers themselves (take_if_ready, num_required=4), and the rest.
        assert (np.add(c["worker_taken"], c["ready_rest"]) == expected).all()
        ready = c["ready_statistics"]
        assert ready[1] == n + c["ready_fillers"] and ready[0] == 0 and ready[5] == ready[1]
        # The float accumulator: an exact total for integer-valued gradients.
        assert c["fast"] == expected.tolist()
        assert c["fast_statistics"][1] == n

    def test_replica_context_coordinator_and_checkpoint(self, clusters):
        run = clusters["ps"]
        assert run["in_replica"] == [1, 1, 1]  # strategy.run in a scheduled function
        ones = counted_contributions(PS_WORKERS * PS_ROUNDS)
        ckpt = run["checkpoint"]
        assert ckpt["pending_before_restore"] == 5 and ckpt["pending_after_restore"] == 4
        # Saved: rows 0, 1, 2 from the workers and row 0 added on the coordinator.
        np.testing.assert_array_equal(ckpt["restored"], ones[[0, 1, 2, 0]].sum(axis=0))

    def test_add_and_take_from_workers_and_coordinator_takes_each_once(self, clusters):
        run = clusters["ps"]["add_and_take"]
        pairs = run["pairs"]
        ones = counted_contributions(PS_WORKERS * PS_ROUNDS)
        # Every contribution added (2 per scheduled call, then rows 0 and 1 again on the
        # coordinator) is in exactly one of the takes: integer values, exact sums.
        total = np.add(np.add(run["scheduled_taken"], run["coordinator"]), run["rest"])
        expected = ones[: 2 * pairs].sum(axis=0) + ones[0] + ones[1]
        np.testing.assert_array_equal(total, expected)
        stats = run["statistics"]  # pending, added, ..., taken, takes
        assert stats[0] == 0 and stats[1] == stats[5] == 2 * pairs + 2
        assert stats[6] >= pairs + 1  # one take per add_and_take (the last take may be empty)

    def test_an_accumulator_the_workers_cannot_reach_is_refused(self, clusters):
        errors = clusters["ps"]["errors"]
        for case in ("eager_in_scope", "scheduled"):
            assert errors[case].startswith("UnsupportedStrategyError:"), errors[case]
            assert "strategy.scope()" in errors[case]
            assert "MultiWorkerMirroredStrategy" in errors[case]
        assert errors["outside_statistics"] == [0] * 8


# --------------------------------------------------------------------- MultiWorkerMirrored


class TestMultiWorkerMirrored:
    def test_every_replica_of_every_worker_counts_once(self, clusters):
        replicas = MWMS_WORKERS
        for i, result in enumerate(clusters["mwms"]):
            assert result["index"] == i and result["replicas"] == replicas
            assert result["graph_added"] == [replicas] * MWMS_STEPS
            total = replicas * MWMS_STEPS
            assert result["graph_statistics"] == [total, total, 0, 0, 0, 0, 0, 0]
            assert result["eager_added"] == [replicas]
            assert result["state_devices"][0].startswith(f"/job:worker/replica:0/task:{i}")

    def test_workers_take_the_same_bits_as_one_local_accumulator(self, clusters):
        rows = hard_contributions(MWMS_STEPS * MWMS_WORKERS + MWMS_WORKERS, SEED)
        graph = reference(rows[: MWMS_STEPS * MWMS_WORKERS])
        eager = reference(rows[MWMS_STEPS * MWMS_WORKERS :])
        for result in clusters["mwms"]:
            assert result["graph_take"] == graph
            assert result["replica_takes"] == [eager]  # take inside strategy.run

    def test_sparse_gradients_of_different_lengths(self, clusters):
        for result in clusters["mwms"]:
            assert result["sparse_added"] == 2
            # Replica 0: row 0 += [1, 2]; replica 1: rows 0 and 1 += [2, 4].
            assert result["sparse_take"] == [[3.0, 6.0], [2.0, 4.0], [0.0, 0.0], [0.0, 0.0]]

    def test_staleness_is_decided_alike_on_every_worker(self, clusters):
        for result in clusters["mwms"]:
            assert result["stale_added"] == 1  # replica 1's gradients are one version old
            assert result["stale_statistics"] == [1, 2, 1, 0, 0, 1, 1, 0]

    def test_cross_replica_values_and_per_replica_values(self, clusters):
        for result in clusters["mwms"]:
            # A value in cross-replica context is the same on every worker: one contribution.
            assert result["same_added"] == 1 and result["same_count"] == 1
            # PerReplica values (each worker its own) are gathered from every worker.
            assert result["per_replica_added"] == 2
            assert result["per_replica_take"] == [[[3.0, 3.0], [3.0, 3.0]], [3.0, 3.0]]
            assert result["per_replica_statistics"] == [0, 3, 0, 0, 0, 2, 1, 1]

    def test_a_refused_contribution_fails_every_worker_and_changes_nothing(self, clusters):
        for result in clusters["mwms"]:
            assert result["eager_refusal"] == "NonFiniteGradientError"
            assert result["eager_refusal_statistics"] == [0] * 8
            assert result["after_refusal"] == 2
            assert result["graph_refusal"] == "InvalidArgumentError"
            assert result["graph_refusal_statistics"] == [2, 2, 0, 0, 0, 0, 0, 0]


# --------------------------------------------------------------------- in process


class TestUnsupported:
    def strategy(self) -> tf.distribute.Strategy:
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        return tf.distribute.experimental.CentralStorageStrategy(devices)

    def test_creating_in_an_unsupported_scope(self):
        with self.strategy().scope():
            v = tf.Variable(tf.zeros([2]))
            with pytest.raises(UnsupportedStrategyError) as info:
                GradientAccumulator([v])
        message = str(info.value)
        assert "CentralStorageStrategy" in message
        assert all(name in message for name in SUPPORTED_STRATEGIES)
        assert isinstance(info.value, NotImplementedError)

    def test_using_under_an_unsupported_strategy_changes_nothing(self):
        v = tf.Variable(tf.zeros([2]))
        acc = GradientAccumulator([v])
        acc.add([tf.ones([2])])
        strategy = self.strategy()
        with strategy.scope():
            for call in (
                lambda: acc.add([tf.ones([2])]),
                lambda: strategy.run(lambda: acc.add([tf.ones([2])])),
                tf.function(lambda: acc.add([tf.ones([2])]), autograph=False),
                acc.take,
                acc.take_if_ready,
                acc.reset,
            ):
                with pytest.raises(UnsupportedStrategyError, match="MirroredStrategy"):
                    call()
        assert acc.statistics() == (1, 1, 0, 0, 0, 0, 0, 0)
        np.testing.assert_array_equal(acc.take()[0], [1.0, 1.0])
