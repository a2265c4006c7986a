"""GradientAccumulator on one worker of a MultiWorkerMirroredStrategy cluster; one JSON line.

Usage: python accumulator_mwms.py WORKER_INDEX PORT0,PORT1[,...] --seed SEED [--steps 3]
Every worker gets the same ports list; TF_CONFIG is built from it on 127.0.0.1.

Arrays are printed as the hex of their bytes, so a test can compare them bitwise with a
reference computed in another process.
"""

from __future__ import annotations

import json

from loopback import set_tf_config  # same directory
from script_common import parse, parser, scaled


def main() -> None:
    arguments = parser(worker=True, seed=True)
    arguments.add_argument("--steps", type=int, default=3)
    args = parse(arguments)
    set_tf_config(args.index, args.ports)
    import tensorflow as tf
    from accumulator_ps import hard_contributions  # same directory
    from script_common import hexes
    from tensorflow.python.distribute import values as ds_values

    from safevars.accumulator import GradientAccumulator
    from safevars.errors import NonFiniteGradientError

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    replicas = strategy.num_replicas_in_sync
    steps = args.steps
    hard = tf.constant(hard_contributions(steps * replicas + replicas, args.seed))
    with strategy.scope():
        kernel = tf.Variable(tf.zeros([2, 2]))
        bias = tf.Variable(tf.zeros([2]))
        params = [kernel, bias]
        exact = GradientAccumulator(params)  # deterministic=True, mean
        table = tf.Variable(tf.zeros([4, 2]))
        sparse = GradientAccumulator([table], reduction="sum", deterministic=False)
        stale = GradientAccumulator(params, reduction="sum", max_staleness=0)
        counted = GradientAccumulator(params, reduction="sum", num_required=replicas)
        strict = GradientAccumulator(params, nonfinite="raise")

    def split(row: tf.Tensor) -> list[tf.Tensor]:
        return [tf.reshape(row[:4], [2, 2]), row[4:]]

    def replica_id() -> tf.Tensor:
        return tf.distribute.get_replica_context().replica_id_in_sync_group

    def local(value) -> list:
        return list(strategy.experimental_local_results(value))

    # -- Replica context inside tf.function: contribution step * replicas + replica ------

    @tf.function
    def add_step(step):
        return strategy.run(
            lambda: exact.add(split(tf.gather(hard, step * replicas + replica_id())))
        )

    graph_added = [int(local(add_step(tf.constant(s)))[0]) for s in range(steps)]
    graph_statistics = list(exact.statistics())
    graph_take = hexes(exact.take())

    # -- Eager strategy.run, then take inside strategy.run -------------------------------

    eager_added = local(
        strategy.run(lambda: exact.add(split(tf.gather(hard, steps * replicas + replica_id()))))
    )

    @tf.function
    def take_in_replicas():
        return strategy.run(lambda: [tf.identity(t) for t in exact.take()])

    replica_takes = [hexes(grads) for grads in zip(*[local(t) for t in take_in_replicas()])]

    # -- Sparse gradients of different lengths per replica (float accumulator) -----------

    @tf.function
    def add_sparse():
        def fn():
            rid = replica_id()
            rows = tf.range(rid + 1)  # replica r gives rows 0..r, each (r + 1) * [1, 2]
            values = tf.cast(rid + 1, tf.float32) * tf.ones([rid + 1, 2]) * [1.0, 2.0]
            return sparse.add([tf.IndexedSlices(values, rows, tf.constant([4, 2]))])

        return strategy.run(fn)

    sparse_added = int(local(add_sparse())[0])
    sparse_take = sparse.take()[0].numpy().tolist()

    # -- Staleness: replica r says its gradients are r versions old ----------------------

    @tf.function
    def add_stale():
        def fn():
            version = tf.cast(stale.version, tf.int64) - tf.cast(replica_id(), tf.int64)
            return stale.add(split(tf.ones([6])), version=tf.maximum(version, 0))

        return strategy.run(fn)

    stale.add(split(tf.zeros([6])))
    stale.take()  # version 1: replica 1's version 0 is one behind
    stale_added = int(local(add_stale())[0])
    stale_statistics = list(stale.statistics())

    # -- Cross-replica context: a value the same on every worker, and PerReplica ---------

    @tf.function
    def add_same():
        return counted.add(split(tf.range(6, dtype=tf.float32)))

    same_added = int(add_same())
    same_count = counted.count
    counted.reset()
    worker_row = tf.fill([6], float(args.index + 1))
    per_replica_added = counted.add([ds_values.PerReplica((g,)) for g in split(worker_row)])
    per_replica_take = [t.numpy().tolist() for t in counted.take(timeout=scaled(60))]
    per_replica_statistics = list(counted.statistics())

    # -- One worker's gradient is not finite: every worker refuses the step --------------

    def bad_on_worker_1():
        row = tf.ones([6]) * tf.where(tf.equal(replica_id(), 1), float("nan"), 1.0)
        return strict.add(split(row))

    try:
        strategy.run(bad_on_worker_1)
        eager_refusal = "no error"
    except NonFiniteGradientError as e:
        eager_refusal = type(e).__name__
    eager_refusal_statistics = list(strict.statistics())
    after_refusal = int(local(strategy.run(lambda: strict.add(split(tf.ones([6])))))[0])

    @tf.function
    def bad_step():
        return strategy.run(bad_on_worker_1)

    try:  # Last: a failed step may leave the collectives unusable.
        bad_step()
        graph_refusal = "no error"
    except tf.errors.InvalidArgumentError as e:
        graph_refusal = "NonFiniteGradientError" in str(e) and type(e).__name__
    graph_refusal_statistics = list(strict.statistics())

    print(
        json.dumps(
            {
                "index": args.index,
                "replicas": replicas,
                "graph_added": graph_added,
                "graph_statistics": graph_statistics,
                "graph_take": graph_take,
                "eager_added": [int(n) for n in eager_added],
                "replica_takes": replica_takes,
                "sparse_added": sparse_added,
                "sparse_take": sparse_take,
                "stale_added": stale_added,
                "stale_statistics": stale_statistics,
                "same_added": same_added,
                "same_count": same_count,
                "per_replica_added": int(per_replica_added),
                "per_replica_take": per_replica_take,
                "per_replica_statistics": per_replica_statistics,
                "eager_refusal": eager_refusal,
                "eager_refusal_statistics": eager_refusal_statistics,
                "after_refusal": after_refusal,
                "graph_refusal": graph_refusal,
                "graph_refusal_statistics": graph_refusal_statistics,
                "state_devices": [exact._state.device, exact._guard.device],
            }
        )
    )


if __name__ == "__main__":
    main()
