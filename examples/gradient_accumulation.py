"""Worker threads feed one optimizer through a safevars.GradientAccumulator.

Run: python examples/gradient_accumulation.py [--workers 4] [--steps 25] [--verbose]

A small Keras classifier (synthetic data, fixed seed) is trained with synchronous data
parallelism on threads. At every step each worker computes the gradient of its own
micro-batch from the current weights and ``add``\\ s it, tagged with the version it was
computed from; workers sleep a random few milliseconds first, so they finish in a
different order at every step and in every run. The trainer ``take``\\ s the mean as
soon as all of them have arrived (``num_required=workers``) and applies it with SGD.

The whole training runs twice with different random delays. Because the accumulator's
result does not depend on the order contributions arrive in, both runs end with
bitwise identical weights, although the arrival orders differed. The first step's
accumulated gradient is also compared with the gradient of the full batch.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from safevars.accumulator import GradientAccumulator  # noqa: E402

FEATURES, CLASSES, MICRO_BATCH = 16, 4, 32


def make_data(workers: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(workers * MICRO_BATCH, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def make_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(CLASSES),
        ]
    )


def train(workers: int, steps: int, jitter_seed: int) -> dict:
    """One training run; returns weights, losses, arrival orders and statistics."""
    x, y = make_data(workers)
    model = make_model()
    variables = model.trainable_variables
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = keras.optimizers.SGD(0.5)
    acc = GradientAccumulator(variables, num_required=workers, max_staleness=0)

    # One signature for the full batch and the micro-batches: traced once, not once per
    # shape (which TensorFlow would report as retracing).
    @tf.function(
        autograph=False,
        input_signature=[
            tf.TensorSpec([None, FEATURES], tf.float32),
            tf.TensorSpec([None], tf.int32),
        ],
    )
    def gradients(xb: tf.Tensor, yb: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor]]:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        return loss, tape.gradient(loss, variables)

    full_batch = [g.numpy() for g in gradients(tf.constant(x), tf.constant(y))[1]]
    start = threading.Barrier(workers + 1)  # workers and trainer, once per step
    arrivals: list[list[int]] = [[] for _ in range(steps)]
    record = threading.Lock()
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        rng = random.Random(jitter_seed * 1000 + index)
        xb = tf.constant(x[index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
        yb = tf.constant(y[index * MICRO_BATCH : (index + 1) * MICRO_BATCH])
        try:
            for step in range(steps):
                start.wait(timeout=60)
                version = acc.version  # the number of steps applied so far
                _, grads = gradients(xb, yb)
                time.sleep(rng.uniform(0.0, 0.004))
                acc.add(grads, version=version)
                with record:
                    arrivals[step].append(index)
        except BaseException as e:  # noqa: BLE001 - reported by the trainer
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    losses, first_step = [], None
    for _ in range(steps):
        losses.append(float(loss_fn(y, model(x))))
        start.wait(timeout=60)
        mean = acc.take(timeout=60)
        if first_step is None:
            first_step = [g.numpy() for g in mean]
        optimizer.apply(mean, variables)
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(first_step, full_batch))
    return {
        "weights": [v.numpy() for v in variables],
        "losses": losses + [float(loss_fn(y, model(x)))],
        "arrivals": arrivals,
        "statistics": acc.statistics(),
        "full_batch_gap": gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=25)
    add_verbose_argument(parser)
    args = parser.parse_args()

    runs = [train(args.workers, args.steps, jitter_seed=seed) for seed in (1, 2)]
    for n, run in enumerate(runs, 1):
        orders = {tuple(order) for order in run["arrivals"]}
        print(
            f"run {n}: loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, "
            f"{len(orders)} distinct arrival orders over {args.steps} steps"
        )
        print(f"run {n}: {run['statistics']}")
    differing = sum(a != b for a, b in zip(runs[0]["arrivals"], runs[1]["arrivals"]))
    identical = all(
        a.tobytes() == b.tobytes() for a, b in zip(runs[0]["weights"], runs[1]["weights"])
    )
    print(f"steps whose arrival order differed between the runs: {differing}")
    print(f"final weights bitwise identical across runs: {identical}")
    print(
        f"first step: accumulated mean vs full-batch gradient, max |diff| = "
        f"{runs[0]['full_batch_gap']:.2e}"
    )


if __name__ == "__main__":
    main()
