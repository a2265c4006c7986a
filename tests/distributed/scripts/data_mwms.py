"""ShardedInput on one worker of a 2-replica-per-worker MultiWorkerMirroredStrategy cluster.

Usage: python data_mwms.py WORKER_INDEX PORT0,PORT1 --seed SEED --other-seed SEED --out DIR
Every worker gets the same ports list; TF_CONFIG is built from it on 127.0.0.1. Prints one
JSON line: for every case, the element ids each local replica received, step by step.

On a CPU, MultiWorkerMirroredStrategy runs one replica per worker; this script gives
each worker two replicas (two logical CPUs) by patching the strategy's local device list,
as a machine with two GPUs per worker would have.
"""

from __future__ import annotations

import argparse
import json
import os

from loopback import set_tf_config  # same directory

LOCAL_REPLICAS = 2
SPREAD = dict(size=23, batch=2)  # 4 shards: 6, 6, 6, 5 elements; 3 batches each per epoch
SHORT = dict(size=21, batch=5)  # 6, 5, 5, 5 elements: worker 1 runs out a step earlier


def two_replicas_per_worker(tf) -> None:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * LOCAL_REPLICAS
    )
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    original = cars.CollectiveAllReduceExtended._initialize_local_devices

    def local_devices(self, resolver, worker_device):
        devices, kind = original(self, resolver, worker_device)
        if kind != "CPU":
            return devices, kind
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(LOCAL_REPLICAS)), kind

    cars.CollectiveAllReduceExtended._initialize_local_devices = local_devices


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("ports")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--other-seed", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    set_tf_config(args.index, args.ports)
    import tensorflow as tf

    two_replicas_per_worker(tf)
    from safevars.data import ShardedInput

    strategy = tf.distribute.MultiWorkerMirroredStrategy()

    def make(size: int, seed: int, remainder: str) -> ShardedInput:
        with strategy.scope():
            return ShardedInput(size, seed=seed, remainder=remainder, with_weights=True)

    def steps(data: ShardedInput, iterator, count: int) -> list[list]:
        """``count`` steps; per step, per local replica: [replica id, ids, weights]."""

        @tf.function
        def step(iterator):
            (ids, weights), receipt = next(iterator)

            def replica(ids, weights):
                context = tf.distribute.get_replica_context()
                # A collective per step keeps the workers in lock step, as training does.
                total = context.all_reduce("sum", tf.reduce_sum(weights))
                return context.replica_id_in_sync_group, ids, weights, total

            out = strategy.run(replica, args=(ids, weights))
            data.commit(receipt, after=out)
            return out

        rows = []
        for _ in range(count):
            replica_ids, ids, weights, _ = step(iterator)
            local = strategy.experimental_local_results
            rows.append(
                [
                    [int(r), i.numpy().tolist(), w.numpy().tolist()]
                    for r, i, w in zip(local(replica_ids), local(ids), local(weights))
                ]
            )
        return rows

    result = {"index": args.index, "replicas": strategy.num_replicas_in_sync, "cases": {}}
    cases = result["cases"]
    # One epoch of each tail policy, epochs=1: the pipelines end with the epoch.
    for remainder in ("spread", "pad", "drop"):
        data = make(SPREAD["size"], args.seed, remainder)
        iterator = iter(data.distribute(strategy, SPREAD["batch"], epochs=1))
        cases[remainder] = steps(data, iterator, data.steps_per_epoch(SPREAD["batch"]))
        result.setdefault("layout", {})[remainder] = [
            data.num_workers,
            data.replicas_per_worker,
            data.num_shards,
        ]
    data = make(SHORT["size"], args.seed, "spread")
    iterator = iter(data.distribute(strategy, SHORT["batch"], epochs=1))
    cases["short"] = steps(data, iterator, data.steps_per_epoch(SHORT["batch"]))
    other = make(SPREAD["size"], args.other_seed, "spread")
    cases["other_seed"] = steps(other, iter(other.distribute(strategy, SPREAD["batch"])), 3)

    # Endless pipeline: epoch 0, then a checkpoint in the middle of epoch 1, the rest of
    # epoch 1; then a new ShardedInput restored from the checkpoint continues.
    data = make(SPREAD["size"], args.seed, "spread")
    iterator = iter(data.distribute(strategy, SPREAD["batch"]))
    cases["before_checkpoint"] = steps(data, iterator, 4)
    path = tf.train.Checkpoint(data=data).write(
        os.path.join(args.out, f"worker{args.index}", "ckpt")
    )
    result["checkpoint"] = path
    result["positions_at_checkpoint"] = data.positions.numpy().tolist()
    cases["after_checkpoint"] = steps(data, iterator, 2)
    restored = make(SPREAD["size"], args.seed, "spread")
    tf.train.Checkpoint(data=restored).read(path).assert_consumed()
    iterator = iter(restored.distribute(strategy, SPREAD["batch"]))
    cases["restored"] = steps(restored, iterator, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
