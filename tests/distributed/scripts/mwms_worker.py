"""One worker of a MultiWorkerMirroredStrategy cluster; prints one JSON line.

Usage: python mwms_worker.py WORKER_INDEX PORT0,PORT1[,...] [--steps 20]
Every worker gets the same ports list; TF_CONFIG is built from it on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json

from loopback import set_tf_config  # same directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("ports")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    set_tf_config(args.index, args.ports)
    import tensorflow as tf

    import safevars

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        counter = safevars.SafeVariable(0.0, aggregation=tf.VariableAggregation.SUM)
        total = safevars.SafeVariable(0.0, aggregation=tf.VariableAggregation.SUM)

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            counter.update(lambda x: x + 1.0)
            total.assign_add(tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32))

        strategy.run(replica_fn)

    for _ in range(args.steps):
        step()
    print(
        json.dumps(
            {
                "index": args.index,
                "replicas": strategy.num_replicas_in_sync,
                "counter": float(counter.numpy()),
                "counter_version": int(counter.version),
                "total": float(total.numpy()),
                "total_version": int(total.version),
            }
        )
    )


if __name__ == "__main__":
    main()
