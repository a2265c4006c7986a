"""SafeOptimizer under MultiWorkerMirroredStrategy and ParameterServerStrategy, for real.

Each cluster runs in its own subprocess on 127.0.0.1 (in-process servers cannot be shut
down): ``distributed/scripts/optimizer_ps.py`` (3 workers, 1 PS, driven by
``ClusterCoordinator``) and ``distributed/scripts/optimizer_mwms.py`` (one process per
worker, ``TF_CONFIG``). Each prints one JSON line that the tests below check.
MirroredStrategy is covered in-process by ``test_mirrored.py``; the refusals are checked
in-process here.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.optimizer import SafeOptimizer
from safevars.variable import wrap
from tests.distributed.cluster_harness import run_on_ports, run_together, script

PS_WORKERS, PS_STEPS, PS_TRAIN_STEPS, PS_ACCUMULATE_CALLS = 3, 60, 90, 24
MWMS_WORKERS, MWMS_STEPS = 2, 8
CLUSTER_TIMEOUT = 300.0  # Seconds for one cluster (all its processes) to finish.


@pytest.fixture(scope="module")
def ps() -> dict:
    """One run of a 3-worker, 1-PS in-process cluster (see distributed/scripts/optimizer_ps.py)."""
    path = script("optimizer_ps.py")
    (result,) = run_together(
        [
            [
                path,
                "--workers",
                str(PS_WORKERS),
                "--steps",
                str(PS_STEPS),
                "--train-steps",
                str(PS_TRAIN_STEPS),
                "--accumulate-calls",
                str(PS_ACCUMULATE_CALLS),
            ]
        ],
        CLUSTER_TIMEOUT,
    )
    return result


@pytest.fixture(scope="module")
def mwms() -> list[dict]:
    """One run of a 2-process MultiWorkerMirroredStrategy cluster: each worker's result."""
    path = script("optimizer_mwms.py")
    return run_on_ports(
        MWMS_WORKERS,
        lambda ports: [
            [path, str(i), ports, "--steps", str(MWMS_STEPS)] for i in range(MWMS_WORKERS)
        ],
        CLUSTER_TIMEOUT,
    )


# --------------------------------------------------------------------- parameter servers


class TestParameterServerStrategy:
    def test_concurrent_workers_and_coordinator_lose_no_update(self, ps):
        exact = ps["exact"]
        calls = exact["calls"]
        # Constant gradients: any order of atomic steps gives the serial result.
        assert exact["max_abs_error"] <= 1e-6, exact
        assert exact["iterations"] == calls
        assert exact["versions"] == [calls, calls]
        assert exact["statistics"] == [calls, calls, 0, 0, 0, 0, 0]
        # Every eager call from the coordinator was counted while the workers ran.
        seen = exact["eager_calls_seen"]
        assert all(a < b for a, b in zip(seen, seen[1:])) and seen[-1] <= calls
        # The plain optimizer's loss is scheduler-dependent; it is only reported.
        assert 0 < exact["plain_iterations"] <= PS_STEPS

    def test_one_critical_section_on_the_parameter_server(self, ps):
        exact = ps["exact"]
        device = exact["variable_device"]
        assert device.startswith("/job:ps")
        assert exact["lock_devices"] == [device] * 3  # w, sw and the optimizer state
        assert exact["counters_device"] == device

    def test_training_counts_every_call_and_drops_stale_steps(self, ps):
        train = ps["train"]
        steps, stale = train["steps"], train["stale_scheduled"]
        assert train["loss_after"] < 0.05 * train["loss_before"], train
        calls, applied, accumulated, pending, dropped, scaled, skipped = train["after_train"]
        assert calls == steps and applied + dropped == calls
        assert (accumulated, pending, scaled, skipped) == (0, 0, 0, 0)
        assert applied >= 1
        # Gradients tagged with version 0 after `applied` updates: every one is dropped.
        assert train["after_stale"] == [calls + stale, applied, 0, 0, dropped + stale, 0, 0]
        assert train["weights_unchanged_by_stale"]
        assert set(train["workers_used"]) <= set(range(PS_WORKERS))

    def test_counters_on_the_ps_count_every_workers_calls(self, ps):
        train = ps["train"]
        assert train["per_worker_ran"] == list(range(PS_WORKERS))
        calls, applied = train["after_stale"][:2]
        after = train["after_per_worker"]
        assert after[:2] == [calls + PS_WORKERS, applied + PS_WORKERS]
        assert train["iterations"] == after[1]
        assert train["versions"] == [after[1], after[1]]

    def test_scale_policy(self, ps):
        scale = ps["scale"]
        np.testing.assert_allclose(scale["v"], [-2.0 - 1.0 / 3.0] * 2, rtol=1e-6)
        assert scale["statistics"] == [3, 3, 0, 0, 0, 1, 0]

    def test_raise_policy_scheduled_and_from_the_coordinator(self, ps):
        refused = ps["raise"]
        assert "StaleGradientError" in refused["scheduled_error"], refused
        assert refused["eager_error"].startswith("StaleGradientError: "), refused
        assert refused["future_error"].startswith("InvalidArgumentError: version is 8 "), refused
        assert refused["unchanged"]
        assert refused["v_after_fresh"] == [-2.0, -2.0]
        assert refused["statistics"] == [2, 2, 0, 0, 0, 0, 0]

    def test_accumulation_across_workers(self, ps):
        acc = ps["accumulate"]
        calls = acc["calls"]
        assert acc["v"] == [-float(calls)] * 2
        assert acc["iterations"] == acc["version"] == calls // 2
        assert acc["statistics"] == [calls, calls // 2, calls, 0, 0, 0, 0]


# --------------------------------------------------------------------- multi-worker


class TestMultiWorkerMirroredStrategy:
    def test_workers_train_to_the_same_weights_as_one_process(self, mwms):
        first = mwms[0]
        for result in mwms:
            assert result["replicas"] == MWMS_WORKERS
            assert result["weights"] == first["weights"]  # bitwise, on every worker
            assert result["replica_values"] == [[w] for w in first["weights"]]
            assert result["max_abs_error"] <= 1e-5, result
            assert result["losses"][-1] < 0.7 * result["losses"][0], result["losses"]

    def test_versions_counts_and_stale_steps_agree_on_every_worker(self, mwms):
        for result in mwms:
            # MWMS_STEPS steps, one stale (dropped) and one eager step.
            assert result["statistics"] == [MWMS_STEPS + 2, MWMS_STEPS + 1, 0, 0, 1, 0, 0]
            assert result["iterations"] == MWMS_STEPS + 1
            assert result["versions"] == [MWMS_STEPS + 1] * 2
            assert result["stale_changed_nothing"]

    def test_accumulation_sums_the_workers_then_averages_the_calls(self, mwms):
        for result in mwms:
            # Each call's gradient is 1 + 2 = 3 after the all-reduce; 2 updates of mean 3.
            assert result["accumulated"] == [-6.0, -6.0]
            assert result["accumulating_statistics"] == [4, 2, 4, 0, 0, 0, 0]
            assert result["accumulating_version"] == 2


# --------------------------------------------------------------------- refusals


def test_unsupported_strategy_is_refused_naming_the_supported_ones():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.experimental.CentralStorageStrategy(devices[:2])
    with strategy.scope():
        v = tf.Variable(tf.zeros([2]))
        opt = SafeOptimizer(keras.optimizers.SGD(1.0))
        with pytest.raises(UnsupportedStrategyError) as info:
            opt.apply_gradients([(tf.ones([2]), v)])
    message = str(info.value)
    for name in (
        "CentralStorageStrategy",
        "MirroredStrategy",
        "MultiWorkerMirroredStrategy",
        "ParameterServerStrategy",
        "OneDeviceStrategy",
    ):
        assert name in message
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
    assert wrap(v).version == 0


def test_optimizer_created_outside_the_scope_is_refused(mirrored_strategy):
    opt = SafeOptimizer(keras.optimizers.SGD(1.0))
    with mirrored_strategy.scope():
        v = tf.Variable(tf.zeros([2]))
        opt.build([v])
    step = tf.function(
        lambda: mirrored_strategy.run(lambda: opt.apply_gradients([(tf.ones([2]), v)])),
        autograph=False,
    )
    with pytest.raises(InvalidArgumentError, match="inside `with strategy.scope"):
        step()
    with mirrored_strategy.scope(), pytest.raises(InvalidArgumentError, match="outside any"):
        opt.apply_gradients([(tf.ones([2]), v)])
    assert [c.numpy().tolist() for c in v.values] == [[0.0, 0.0]] * 2
    assert wrap(v).version == 0 and opt.statistics().calls == 0


def test_sharded_variables_are_refused():
    sharded = ShardedVariable([tf.Variable([1.0, 2.0]), tf.Variable([3.0])])
    opt = SafeOptimizer(keras.optimizers.SGD(1.0))
    with pytest.raises(UnsupportedStrategyError, match="variable_partitioner"):
        opt.apply_gradients([(tf.ones([3]), sharded)])
    with pytest.raises(UnsupportedStrategyError, match="ShardedVariable"):
        opt.build([sharded])
