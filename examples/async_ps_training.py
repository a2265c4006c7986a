"""Asynchronous parameter-server training: plain Keras against safevars.

Run: python examples/async_ps_training.py [--workers 3] [--steps 90] [--verbose]

Starts an in-process ``ParameterServerStrategy`` cluster on 127.0.0.1 (``--workers``
workers and one parameter server, TensorFlow's own gRPC servers in this process) and
trains a linear regression on synthetic data (fixed seed) three times. A
``ClusterCoordinator`` schedules ``--steps`` training steps; each step runs on whichever
worker is free, reads the parameters from the parameter server, computes the gradient of
a minibatch and applies it there, without waiting for the other workers.

1. ``plain``: ``tf.Variable`` s and ``keras.optimizers.SGD(momentum=0.9)`` inside
   ``strategy.run``, plus an examples-seen counter written as ``n.assign(n + batch)``.
   Keras 3's ``Variable.assign_add`` is ``assign(self + value)``, so the optimizer's own
   ``iterations`` loses increments when workers overlap, as does the counter (how many
   depends on the scheduler).
2. ``safevars``: SafeVariables and ``safevars.SafeOptimizer`` around the same SGD; the
   counter uses ``n.update(lambda x: x + batch)``. Each ``apply_gradients`` is one
   critical section on the parameter server: nothing is lost, and each call adds 1 to
   the parameters' versions.
3. ``safevars max_staleness=0``: each step also passes the ``iterations`` it read before
   its forward pass; a step whose gradients were computed from parameters another worker
   has updated since is dropped and counted (``statistics().dropped_stale``).

``lost`` is scheduled steps minus ``iterations`` minus dropped stale steps.
"""

from __future__ import annotations

import argparse

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from safevars.local_cluster import start_in_process_cluster  # noqa: E402
from safevars.optimizer import SafeOptimizer  # noqa: E402
from safevars.variable import SafeVariable  # noqa: E402

FEATURES = 8
EXAMPLES = 2048
BATCH = 64


def make_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    true_w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (x @ true_w + 0.5 + rng.normal(scale=0.1, size=(EXAMPLES, 1))).astype("float32")
    return x, y


def train(
    name: str,
    strategy,
    coordinator,
    x: np.ndarray,
    y: np.ndarray,
    steps: int,
    safe: bool,
    max_staleness: int | None = None,
) -> dict:
    with strategy.scope():
        make = SafeVariable if safe else tf.Variable
        w = make(tf.zeros([FEATURES, 1]), name="w")
        b = make(tf.zeros([1]), name="b")
        examples = make(0.0, name="examples_seen")
        sgd = keras.optimizers.SGD(learning_rate=0.02, momentum=0.9)
        optimizer = SafeOptimizer(sgd, max_staleness=max_staleness) if safe else sgd
        optimizer.build([w, b])
    xs, ys = tf.constant(x), tf.constant(y)

    @tf.function
    def step(seed):
        def replica():
            # The version first: the parameters the gradients use are read after it.
            version = tf.convert_to_tensor(optimizer.iterations)
            rows = tf.random.stateless_uniform([BATCH], tf.stack([seed, 0]), 0, EXAMPLES, tf.int32)
            with tf.control_dependencies([version]), tf.GradientTape() as tape:
                prediction = tf.matmul(tf.gather(xs, rows), w) + b
                loss = tf.reduce_mean((prediction - tf.gather(ys, rows)) ** 2)
            grads = tape.gradient(loss, [w, b])
            if max_staleness is not None:
                optimizer.apply_gradients(zip(grads, [w, b]), version=version)
            else:
                optimizer.apply_gradients(zip(grads, [w, b]))
            if safe:
                examples.update(lambda n: n + BATCH)
            else:
                examples.assign(examples + BATCH)

        strategy.run(replica)

    for i in range(steps):
        coordinator.schedule(step, args=(tf.constant(i),))
    coordinator.join()
    iterations = int(optimizer.iterations.numpy())
    stats = optimizer.statistics() if safe else None
    dropped = stats.dropped_stale if safe else 0
    loss = float(np.mean((x @ w.numpy() + b.numpy() - y) ** 2))
    return {
        "name": name,
        "scheduled": steps,
        "iterations": iterations,
        "dropped": dropped,
        "lost": steps - iterations - dropped,
        "examples": int(examples.numpy()),
        "loss": loss,
        "statistics": stats,
        "version": int(w.version) if safe else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=90, help="scheduled training steps")
    add_verbose_argument(parser)
    args = parser.parse_args()
    x, y = make_data()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, 1)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    rows = [
        train("plain", strategy, coordinator, x, y, args.steps, safe=False),
        train("safevars", strategy, coordinator, x, y, args.steps, safe=True),
        train(
            "safevars max_staleness=0",
            strategy,
            coordinator,
            x,
            y,
            args.steps,
            safe=True,
            max_staleness=0,
        ),
    ]
    print(
        f"Asynchronous parameter-server training: {args.workers} workers, 1 PS, "
        f"{args.steps} scheduled steps of {BATCH} examples, linear regression "
        f"({FEATURES} features, {EXAMPLES} examples)"
    )
    print(
        f"{'run':<25} {'scheduled':>9} {'iterations':>10} {'dropped':>7} {'lost':>5} "
        f"{'examples':>8} {'loss':>8}"
    )
    for r in rows:
        print(
            f"{r['name']:<25} {r['scheduled']:>9} {r['iterations']:>10} {r['dropped']:>7} "
            f"{r['lost']:>5} {r['examples']:>8} {r['loss']:>8.4f}"
        )
    print(
        f"examples: the examples-seen counter; every run scheduled {args.steps * BATCH} examples."
    )
    for r in rows[1:]:
        s = r["statistics"]
        print(
            f"{r['name']}: w.version {r['version']}, calls {s.calls}, applied "
            f"{s.applied}, dropped_stale {s.dropped_stale}"
        )


if __name__ == "__main__":
    main()
