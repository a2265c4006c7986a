"""safevars.scope() on one worker of a MultiWorkerMirroredStrategy cluster; prints one JSON line.

Usage: python scope_mwms.py WORKER_INDEX PORT0,PORT1[,...] [--steps 6]

Each worker builds the same Keras model and a plain Keras SGD inside ``strategy.scope()``
and ``safevars.scope()``, trains for ``--steps`` steps on its shard of a fixed data set
(``strategy.run`` in a ``tf.function``, gradients all-reduced across the workers; Keras 3's
``model.fit`` does not run under this strategy, keras-team/keras#20585), then
writes the kernel once by hand (``layer.kernel.assign``) and loads weights back with
``model.set_weights``. It reports the weights' versions, the optimizer's ``iterations``
and the weights as hex bytes, so the test can check the counts and compare workers bitwise.
It then does the same with a model and optimizer built plainly and protected with
``safevars.protect`` (under ``"protected"``).
"""

from __future__ import annotations

import contextlib
import json

from loopback import set_tf_config  # same directory
from script_common import parse, parser

FEATURES = 4
PER_WORKER_BATCH = 8


def main() -> None:
    arguments = parser(worker=True)
    arguments.add_argument("--steps", type=int, default=6)
    args = parse(arguments)
    set_tf_config(args.index, args.ports)
    import keras
    import numpy as np
    import tensorflow as tf

    import safevars

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = len(args.ports.split(","))
    global_batch = PER_WORKER_BATCH * workers
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * args.steps, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).with_options(options)

    def train(how: str) -> dict:
        """``how``: "scope" (built inside safevars.scope()) or "protect" (built plainly,
        then protected with safevars.protect)."""
        with strategy.scope():
            with safevars.scope() if how == "scope" else contextlib.nullcontext():
                model = keras.Sequential(
                    [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer="zeros")]
                )
                optimizer = keras.optimizers.SGD(0.1)
                optimizer.build(model.trainable_variables)
            if how == "protect":
                safevars.protect([model, optimizer])

        @tf.function
        def train_step(batch):
            def replica(x, y):
                with tf.GradientTape() as tape:
                    per_example = tf.reduce_mean((model(x) - y) ** 2, axis=-1)
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
                return loss

            return strategy.reduce("SUM", strategy.run(replica, args=batch), axis=None)

        batches = strategy.experimental_distribute_dataset(data)
        losses = [float(train_step(batch)) for batch in batches]
        after_fit = {w.name: safevars.wrap(w.value).version for w in model.trainable_weights}
        iterations = int(optimizer.iterations.numpy())
        iterations_safe = isinstance(optimizer.iterations.value, safevars.SafeVariable)
        slots_safe = all(isinstance(v.value, safevars.SafeVariable) for v in optimizer.variables)
        weights_safe = all(isinstance(w.value, safevars.SafeVariable) for w in model.weights)
        fitted = [w.numpy().tobytes().hex() for w in model.trainable_weights]
        snapshot = safevars.snapshot(model)

        kernel = model.layers[0].kernel
        with strategy.scope():
            kernel.assign(tf.ones_like(kernel))
        after_assign = safevars.wrap(kernel.value).version
        model.set_weights(snapshot)  # one write per weight
        after_set = {w.name: safevars.wrap(w.value).version for w in model.trainable_weights}
        restored = [w.numpy().tobytes().hex() for w in model.trainable_weights]
        return {
            "losses": losses,
            "weights_safe": weights_safe,
            "slots_safe": slots_safe,
            "iterations_safe": iterations_safe,
            "iterations": iterations,
            "iterations_version": safevars.wrap(optimizer.iterations.value).version,
            "versions_after_fit": after_fit,
            "snapshot_versions": [s.version for s in snapshot],
            "kernel_version_after_assign": after_assign,
            "versions_after_set_weights": after_set,
            "fitted": fitted,
            "restored": restored,
        }

    print(
        json.dumps(
            {
                "index": args.index,
                "replicas": strategy.num_replicas_in_sync,
                **train("scope"),
                "protected": train("protect"),
            }
        )
    )


if __name__ == "__main__":
    main()
