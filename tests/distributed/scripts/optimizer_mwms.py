"""SafeOptimizer on one worker of a MultiWorkerMirroredStrategy cluster; prints one JSON line.

Usage: python optimizer_mwms.py WORKER_INDEX PORT0,PORT1[,...] [--steps 8]
Every worker gets the same ports list; TF_CONFIG is built from it on 127.0.0.1.

Each worker trains the same Keras linear model on its own shard of a fixed data set
(``strategy.run`` in a ``tf.function``, gradients all-reduced across the workers), with
``SafeOptimizer(Adam, max_staleness=1)`` and the ``iterations`` read before the forward
pass as the version. Then one step tagged with version 0 (stale: dropped on every
worker alike), one eager step in cross-replica context, and four calls of an
``accumulate_steps=2`` SafeOptimizer inside ``strategy.run``. The worker also computes the
expected weights: plain Adam on the union of the shards, in this process without a
strategy. Weights are printed as the hex of their bytes so the test can compare the
workers bitwise.
"""

from __future__ import annotations

import argparse
import json

from loopback import set_tf_config  # same directory

SHARD = 32
FEATURES = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("index", type=int)
    parser.add_argument("ports")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    set_tf_config(args.index, args.ports)
    import keras
    import numpy as np
    import tensorflow as tf

    from safevars.optimizer import SafeOptimizer
    from safevars.variable import wrap

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    count = len(args.ports.split(","))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SHARD * count, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.5).astype("float32")
    mine = slice(args.index * SHARD, (args.index + 1) * SHARD)
    xs, ys = tf.constant(x[mine]), tf.constant(y[mine])
    extra = [tf.fill([FEATURES, 1], 0.5), tf.fill([1], 0.25)]  # the eager step's gradients

    def make_model() -> keras.Model:
        return keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer="zeros")]
        )

    with strategy.scope():
        model = make_model()
        opt = SafeOptimizer(keras.optimizers.Adam(0.05), max_staleness=1)
        opt.build(model.trainable_variables)

    @tf.function
    def step(stale):
        def replica():
            fresh = tf.convert_to_tensor(opt.iterations)
            version = tf.where(stale, tf.constant(0, tf.int64), fresh)
            with tf.control_dependencies([fresh]), tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(xs) - ys) ** 2, axis=-1)
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=SHARD * count)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables), version=version)
            return loss

        return strategy.reduce("SUM", strategy.run(replica), axis=None)

    losses = [float(step(tf.constant(False))) for _ in range(args.steps)]
    before_stale = [v.numpy() for v in model.trainable_variables]
    step(tf.constant(True))  # version 0, `steps` updates ago: dropped
    after_stale = [v.numpy() for v in model.trainable_variables]
    opt.apply_gradients(zip(extra, model.trainable_variables))  # eager, cross-replica
    replica_values = [
        [c.numpy().tobytes().hex() for c in strategy.experimental_local_results(v.value)]
        for v in model.trainable_variables
    ]

    # accumulate_steps=2: each call's gradient is the sum over the workers (1 + 2 + ...).
    with strategy.scope():
        accumulated = tf.Variable(tf.zeros([2]))
        accumulating = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=2)
        accumulating.build([accumulated])

    @tf.function
    def accumulate():
        def replica():
            grad = tf.fill([2], float(args.index + 1))  # made per replica, as gradients are
            accumulating.apply_gradients([(grad, accumulated)])

        strategy.run(replica)

    for _ in range(4):
        accumulate()

    # The expected weights: plain Adam on all shards at once, no strategy, no threads.
    reference = make_model()
    plain = keras.optimizers.Adam(0.05)
    for _ in range(args.steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((reference(tf.constant(x)) - tf.constant(y)) ** 2)
        plain.apply_gradients(
            zip(tape.gradient(loss, reference.trainable_variables), reference.trainable_variables)
        )
    plain.apply_gradients(zip(extra, reference.trainable_variables))

    weights = [v.numpy() for v in model.trainable_variables]
    print(
        json.dumps(
            {
                "index": args.index,
                "replicas": strategy.num_replicas_in_sync,
                "losses": losses,
                "weights": [w.tobytes().hex() for w in weights],
                "replica_values": replica_values,
                "max_abs_error": float(
                    max(
                        np.max(np.abs(w - r.numpy()))
                        for w, r in zip(weights, reference.trainable_variables)
                    )
                ),
                "stale_changed_nothing": all(
                    np.array_equal(a, b) for a, b in zip(before_stale, after_stale)
                ),
                "statistics": list(opt.statistics()),
                "iterations": int(opt.iterations.numpy()),
                "versions": [wrap(v).version for v in model.trainable_variables],
                "accumulated": accumulated.numpy().tolist(),
                "accumulating_statistics": list(accumulating.statistics()),
                "accumulating_version": wrap(accumulated).version,
            }
        )
    )


if __name__ == "__main__":
    main()
