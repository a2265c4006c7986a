"""SafeVariable under tf.distribute, for real on this machine.

MirroredStrategy runs in-process over two logical CPUs. ParameterServerStrategy (3 workers,
1 PS) and MultiWorkerMirroredStrategy (2 worker processes) run in subprocesses on
127.0.0.1, since in-process servers cannot be shut down.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import safevars
from tests.distributed.cluster_harness import run_on_ports, run_together, script
from tests.support.threading_harness import run_threads

SUBPROCESS_TIMEOUT = 300  # Seconds for one cluster (all its processes) to finish.


class TestMirrored:
    def test_cross_replica_writes_are_locked_and_counted(self, mirrored_strategy, mode):
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(1.0)
        mode(lambda: v.assign_add(2.0))()
        mode(lambda: v.update(lambda x: x * 2.0))()
        assert [float(c.numpy()) for c in v.values] == [6.0, 6.0]
        assert v.version == 2

    def test_replica_assign_add_merges_then_writes_once(self, mirrored_strategy, mode):
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(0.0, aggregation=tf.VariableAggregation.SUM)

        def step():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                v.assign_add(tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))

            mirrored_strategy.run(replica_fn)

        run = mode(step)
        for _ in range(3):
            run()
        assert [float(c.numpy()) for c in v.values] == [9.0, 9.0]  # 3 steps x (1 + 2)
        assert v.version == 3

    def test_replica_update_applies_every_replica_once(self, mirrored_strategy, mode):
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(0.0, aggregation=tf.VariableAggregation.SUM)

        def step():
            return mirrored_strategy.run(lambda: v.update(lambda x: x + 1.0))

        out = mode(step)()
        seen = sorted(float(t) for t in mirrored_strategy.experimental_local_results(out))
        assert seen == [1.0, 2.0]  # each replica sees the value its own fn wrote
        assert [float(c.numpy()) for c in v.values] == [2.0, 2.0]
        assert v.version == 2

    def test_concurrent_threads_running_replica_steps_lose_nothing(self, mirrored_strategy):
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(0.0, aggregation=tf.VariableAggregation.SUM)

        @tf.function
        def step():
            mirrored_strategy.run(lambda: v.update(lambda x: x + 1.0))

        step()  # trace once before the threads start
        run_threads(4, lambda i: [step() for _ in range(25)])
        replicas = mirrored_strategy.num_replicas_in_sync
        expected = replicas * (1 + 4 * 25)
        assert [float(c.numpy()) for c in v.values] == [expected] * replicas
        assert v.version == expected

    def test_transaction_and_snapshot_in_cross_replica_graph(self, mirrored_strategy):
        with mirrored_strategy.scope():
            a = safevars.SafeVariable(10.0)
            b = safevars.SafeVariable(0.0)

        @tf.function
        def move():
            safevars.transaction([a, b], lambda: (a.assign_sub(1.0), b.assign_add(1.0)))
            sa, sb = safevars.snapshot([a, b])
            return sa.value + sb.value

        assert float(move()) == 10.0
        assert (a.version, b.version) == (1, 1)
        np.testing.assert_array_equal([c.numpy() for c in b.values], [1.0, 1.0])

    def test_aggregation_none_writes_each_copy_its_replicas_value(self, mirrored_strategy, mode):
        """With aggregation NONE (the default) TensorFlow writes, inside strategy.run,
        each replica's own copy with that replica's value, merging nothing (Keras' EMA
        copies of use_ema=True): safevars refused it. A SafeVariable now leaves every
        copy as a plain variable does, each write one locked write counting one version,
        and each replica gets back its own copy's value."""
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(0.0)
            plain = tf.Variable(0.0)

        def step(variable):
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                own = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
                variable.assign(own)
                return variable.assign_add(10.0 * own)

            return mirrored_strategy.run(replica_fn)

        returned = {}
        for variable in (v, plain):
            out = mode(lambda variable=variable: step(variable))()
            returned[variable is v] = [
                float(tf.convert_to_tensor(x))
                for x in mirrored_strategy.experimental_local_results(out)
            ]
        expected = [11.0 * (r + 1) for r in range(mirrored_strategy.num_replicas_in_sync)]
        assert [float(c.numpy()) for c in plain.values] == expected
        assert [float(c.numpy()) for c in v.values] == expected
        assert returned[True] == returned[False] == expected
        assert v.version == 2

    def test_aggregation_none_copies_are_written_in_one_section(self, mirrored_strategy):
        """Every replica's copy of one NONE write is written in one section: a reader
        under the lock never sees one replica's copy written and another's not."""
        replicas = mirrored_strategy.num_replicas_in_sync
        with mirrored_strategy.scope():
            v = safevars.SafeVariable(0.0)

        @tf.function
        def step():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                v.assign_add(tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))

            mirrored_strategy.run(replica_fn)

        step()  # traced before the threads start (run-time mode: eager locks take the mutex)
        seen = []

        def worker(index):
            if index < 2:
                for _ in range(100):
                    step()
                return
            for _ in range(200):
                with safevars.locked(v):
                    seen.append(([float(c.numpy()) for c in v.values], v.version))

        run_threads(4, worker)
        assert len(seen) == 400
        for copies, version in seen:  # copy r holds version x (r + 1), never half a write
            assert copies == [float(version * (r + 1)) for r in range(replicas)]
        assert v.version == 201

    def test_scatter_and_compare_and_assign_in_replica_context_are_refused(
        self, mirrored_strategy
    ):
        with mirrored_strategy.scope():
            v = safevars.SafeVariable([0.0, 0.0], aggregation=tf.VariableAggregation.SUM)
        with pytest.raises(safevars.UnsupportedStrategyError, match="outside strategy.run"):
            mirrored_strategy.run(
                lambda: v.scatter_add(tf.IndexedSlices(tf.constant([1.0]), tf.constant([0])))
            )
        with pytest.raises(safevars.UnsupportedStrategyError, match="outside strategy.run"):
            mirrored_strategy.run(lambda: v.compare_and_assign([1.0, 1.0], 0))
        assert v.version == 0


def test_unsupported_strategy_is_named():
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.experimental.CentralStorageStrategy(devices[:2])
    with strategy.scope():
        with pytest.raises(safevars.UnsupportedStrategyError, match="MirroredStrategy"):
            safevars.SafeVariable(0.0)


def test_parameter_server_cluster_loses_nothing():
    (result,) = run_together(
        [[script("ps_cluster.py"), "--workers", "3", "--steps", "150"]], SUBPROCESS_TIMEOUT
    )
    assert result["safe"] == 150.0 and result["safe_version"] == 150
    assert result["eager_write"] == "refused"
    assert result["a"] + result["b"] == 100.0 and result["b"] == 50.0
    assert result["a_version"] == result["b_version"] == 50
    assert result["snapshot_sums"] == [100.0]  # no torn snapshot on any worker
    assert result["snapshot_version_gaps"] == [0]
    assert result["lock_device"] == result["device"]
    assert result["device"].startswith("/job:ps")


def test_multi_worker_mirrored_two_processes():
    results = run_on_ports(
        2,
        lambda ports: [
            [script("mwms_worker.py"), str(i), ports, "--steps", "10"] for i in range(2)
        ],
        SUBPROCESS_TIMEOUT,
    )
    for result in results:
        assert result["replicas"] == 2
        assert result["counter"] == 20.0 and result["counter_version"] == 20
        assert result["total"] == 30.0 and result["total_version"] == 10
