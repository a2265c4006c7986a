"""ReplicaRNG under ParameterServerStrategy and MultiWorkerMirroredStrategy, for real.

Each cluster runs in its own subprocesses on 127.0.0.1 (in-process servers cannot be
shut down): ``distributed/scripts/rng_ps.py`` (3 workers and 1 or 2 PS in one process, driven by
``ClusterCoordinator``) and ``distributed/scripts/rng_mwms.py`` (one process per worker,
``TF_CONFIG``). Each kind of cluster runs twice with the same seed. The subprocesses
print arrays as the hex of their bytes; this process recomputes every stream from its
documented key with an eager ``ReplicaRNG`` and compares bitwise.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.rng import ReplicaRNG
from tests.distributed.cluster_harness import run_on_ports, run_together, script
from tests.distributed.scripts.script_common import hexes

SEED, OTHER_SEED = 2024, 7
PS_WORKERS, PS_STEPS, PS_TASKS = 3, 24, (1, 2)
MWMS_WORKERS, MWMS_STEPS = 2, 3
CLUSTER_TIMEOUT = 300.0  # Seconds for one cluster (all its processes) to finish.


@pytest.fixture(scope="module")
def ps_runs() -> list[dict]:
    """Two runs with the same seeds, two clusters at once: 3 workers with 1 PS, then
    with 2 PS (the streams must not depend on where they are placed)."""
    path = script("rng_ps.py")
    command = [
        path,
        "--seed",
        str(SEED),
        "--other-seed",
        str(OTHER_SEED),
        "--workers",
        str(PS_WORKERS),
        "--steps",
        str(PS_STEPS),
    ]
    return run_together([command + ["--ps", str(ps)] for ps in PS_TASKS], CLUSTER_TIMEOUT)


@pytest.fixture(scope="module")
def mwms_runs() -> list[list[dict]]:
    """Two runs of a 2-process MultiWorkerMirroredStrategy cluster with the same seed."""
    path = script("rng_mwms.py")
    runs = []
    for _ in range(2):
        runs.append(
            run_on_ports(
                MWMS_WORKERS,
                lambda ports: [
                    [path, str(i), ports, "--seed", str(SEED), "--steps", str(MWMS_STEPS)]
                    for i in range(MWMS_WORKERS)
                ],
                CLUSTER_TIMEOUT,
            )
        )
    return runs


# --------------------------------------------------------------------- references


def step_draws(stream) -> list[tf.Tensor]:
    """The fixed draw sequence of the subprocess scripts."""
    return [stream.normal([4]), stream.uniform_int([3], 0, 1_000_000), stream.make_seed()]


def worker_stream(seed: int, worker: int, replica: int = 0, num_replicas: int = 1):
    """The documented stream of (seed, worker task, replica), computed in this process."""
    return ReplicaRNG(seed, num_replicas, worker=("worker", worker)).for_replica(replica)


def ps_sequence(run: dict, worker: int) -> list[list[str]]:
    """What ``worker`` drew, in its order: its first draws, then its steps in order.

    Each worker runs one scheduled function at a time and takes them from one FIFO
    queue, so its steps in schedule order are its steps in execution order.
    """
    first = run["per_worker"][worker]
    assert first["worker"] == worker
    return [first["draws"]] + [s["draws"] for s in run["steps"] if s["worker"] == worker]


def ps_reference(seed: int, worker: int, steps: int) -> list[list[str]]:
    stream = worker_stream(seed, worker)
    expected = [hexes(step_draws(stream))]
    for _ in range(steps):
        in_replica = stream.normal([4])
        expected.append(hexes([in_replica] + step_draws(stream)))
    return expected


# --------------------------------------------------------------------- ParameterServerStrategy


class TestParameterServer:
    def test_one_stream_per_worker_on_the_parameter_servers(self, ps_runs):
        for run, num_ps in zip(ps_runs, PS_TASKS):
            assert run["num_workers"] == PS_WORKERS and run["num_replicas"] == 1
            # Round robin: worker w's stream on PS task w % num_ps.
            assert [d.split("/device:")[0] for d in run["devices"]] == [
                f"/job:ps/replica:0/task:{w % num_ps}" for w in range(PS_WORKERS)
            ]
            assert run["stream_workers"] == [["worker", w] for w in range(PS_WORKERS)]
            # Stream w is the documented stream of task worker:w, whichever process.
            assert run["keys"] == [worker_stream(SEED, w).key for w in range(PS_WORKERS)]
            assert len(set(run["keys"])) == PS_WORKERS
            assert run["identity"] == ["chief", 0]
            assert f"num_workers={PS_WORKERS}" in run["repr"]

    def test_each_worker_draws_its_own_stream(self, ps_runs):
        for run in ps_runs:
            assert sorted(s["step"] for s in run["steps"]) == list(range(PS_STEPS))
            assert {s["worker"] for s in run["steps"]} <= set(range(PS_WORKERS))
            sequences = [ps_sequence(run, w) for w in range(PS_WORKERS)]
            for w, sequence in enumerate(sequences):
                # Bitwise the stream (seed, worker w, replica 0), draw after draw.
                assert sequence == ps_reference(SEED, w, len(sequence) - 1)[: len(sequence)]
            values = [{h for draws in seq for h in draws} for seq in sequences]
            for i in range(PS_WORKERS):
                for j in range(i + 1, PS_WORKERS):
                    assert not values[i] & values[j], (i, j)  # Pairwise distinct streams.

    def test_a_rerun_with_the_same_seed_is_bitwise_equal(self, ps_runs):
        first, second = ps_runs
        assert first["keys"] == second["keys"]
        assert first["per_worker"] == second["per_worker"]  # Each worker's first draws.
        for w in range(PS_WORKERS):
            a, b = ps_sequence(first, w), ps_sequence(second, w)
            n = min(len(a), len(b))  # The coordinator may give a worker other steps.
            assert a[:n] == b[:n]

    def test_step_keyed_draws_do_not_depend_on_the_worker(self, ps_runs):
        first, second = ps_runs
        keyed = [{s["step"]: s["keyed"] for s in run["steps"]} for run in ps_runs]
        assert keyed[0] == keyed[1]
        assert len(set(keyed[0].values())) == PS_STEPS
        coordinator = ReplicaRNG(SEED, worker=("chief", 0))
        for step in range(PS_STEPS):
            want = tf.random.stateless_normal([4], seed=coordinator.element_seed(step))
            assert keyed[0][step] == hexes([want])[0]

    def test_another_seed_gives_other_streams(self, ps_runs):
        for run in ps_runs:
            for w, first in enumerate(run["per_worker"]):
                assert first["other"] == hexes([worker_stream(OTHER_SEED, w).normal([4])])[0]
                assert first["other"] != first["draws"][0]

    def test_checkpoint_saves_and_restores_every_worker_stream(self, ps_runs):
        assert all(run["checkpoint_continues"] for run in ps_runs)

    def test_unsupported_uses_raise_naming_the_supported_ones(self, ps_runs):
        errors = ps_runs[0]["errors"]
        for case in ("eager_on_coordinator", "eager_in_scope"):
            assert errors[case].startswith("UnsupportedStrategyError:"), errors[case]
            assert "ClusterCoordinator.schedule" in errors[case]
            assert "MirroredStrategy" in errors[case] and "for_worker" in errors[case]
        unscheduled = errors["unscheduled_function"]
        assert unscheduled.startswith("UnsupportedStrategyError:"), unscheduled
        assert "outside ClusterCoordinator.schedule" in unscheduled
        outside = errors["rng_created_outside_scope"]
        assert outside.startswith("UnsupportedStrategyError:") and "strategy.scope()" in outside
        assert errors["for_replica"].startswith("InvalidArgumentError:")
        assert "for_worker(worker_index" in errors["for_replica"]
        assert errors["for_worker_out_of_range"].startswith("InvalidArgumentError:")
        assert "0..2" in errors["for_worker_out_of_range"]


# --------------------------------------------------------------------- MultiWorkerMirrored


class TestMultiWorkerMirrored:
    def test_each_worker_replica_has_its_own_stream(self, mwms_runs):
        results = mwms_runs[0]
        all_keys = set()
        draws_of = []
        for i, result in enumerate(results):
            assert result["index"] == i
            assert result["worker"] == ["worker", i]  # From the strategy's resolver.
            assert result["replicas_in_sync"] == result["num_replicas"] == MWMS_WORKERS
            assert list(result["local"]) == [str(i)]  # One CPU replica per worker.
            assert result["moved"] == [r == i for r in range(MWMS_WORKERS)]
            all_keys |= set(result["keys"])
            # Replica i of worker i draws the documented stream (seed, worker i, i).
            stream = worker_stream(SEED, i, replica=i, num_replicas=MWMS_WORKERS)
            assert result["keys"][i] == stream.key
            got = result["local"][str(i)]["draws"]
            assert got == [hexes(step_draws(stream)) for _ in range(MWMS_STEPS)]
            assert len({h for step in got for h in step}) == 3 * MWMS_STEPS
            draws_of.append({h for step in got for h in step})
        assert len(all_keys) == MWMS_WORKERS * MWMS_WORKERS  # (worker, replica) keys.
        assert not draws_of[0] & draws_of[1]
        seeds = [results[i]["local"][str(i)]["seed_for"] for i in range(MWMS_WORKERS)]
        assert len(set(seeds)) == MWMS_WORKERS
        assert seeds[1] == ReplicaRNG(SEED, MWMS_WORKERS, worker=("worker", 1)).seed_for(
            "augment", replica_id=1
        )

    def test_a_rerun_with_the_same_seed_is_bitwise_equal(self, mwms_runs):
        first, second = mwms_runs
        assert first == second


# --------------------------------------------------------------------- in process


class TestUnsupported:
    def test_creating_under_an_unsupported_strategy(self):
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        strategy = tf.distribute.experimental.CentralStorageStrategy(devices)
        with strategy.scope():
            with pytest.raises(UnsupportedStrategyError, match="MirroredStrategy") as info:
                ReplicaRNG(1)
        assert "ParameterServerStrategy" in str(info.value)
        assert isinstance(info.value, NotImplementedError)

    def test_drawing_under_an_unsupported_strategy_changes_nothing(self):
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
        strategy = tf.distribute.experimental.CentralStorageStrategy(devices)
        rng = ReplicaRNG(1, num_replicas=2)
        before = [s.state.numpy().tolist() for s in rng.streams]
        with strategy.scope():
            for draw in (lambda: rng.normal([2]), tf.function(lambda: rng.normal([2]))):
                with pytest.raises(UnsupportedStrategyError, match="CentralStorageStrategy"):
                    draw()
            with pytest.raises(UnsupportedStrategyError):
                rng.seed_for("x")
        assert [s.state.numpy().tolist() for s in rng.streams] == before

    def test_for_worker_is_for_parameter_server_rngs(self):
        with pytest.raises(InvalidArgumentError, match="for_replica"):
            ReplicaRNG(1).for_worker(0)
