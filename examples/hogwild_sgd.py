"""Hogwild-style asynchronous SGD: worker threads share one model, with and without safevars.

Run: python examples/hogwild_sgd.py [--threads 4] [--steps 60] [--verbose]

Each worker thread repeatedly reads the shared parameters, computes the gradient of a
logistic-regression loss on its own minibatch (synthetic data, fixed seed) and applies
it with one shared optimizer, without waiting for the others (Hogwild!, Niu et al.,
2011). The optimizer is SGD with momentum, instrumented to show what concurrent calls do
to it:

* ``overlapping applies``: apply calls that started while another one was still running
  (their reads and writes of the momentum slots and parameters interleave);
* ``lost steps``: the optimizer also keeps a step counter of its own the way many
  hand-written optimizers keep state (read, add one, assign); with overlapping calls some
  increments are lost.

The plain optimizer shows both, in amounts that depend on the scheduler. Wrapped in
``safevars.SafeOptimizer`` every call is one critical section: no overlap, no lost
step, and each call adds exactly 1 to the parameters' versions (``SafeOptimizer`` makes
the ``ProbedSGD`` itself safe, so the probes see the safe calls). A third run also passes
the version each gradient was computed from, so that stale gradients are scaled down
(``max_staleness=1, on_stale="scale"``).
"""

from __future__ import annotations

import argparse
import threading

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from safevars.optimizer import SafeOptimizer  # noqa: E402
from safevars.variable import wrap  # noqa: E402

FEATURES = 20
EXAMPLES = 4096
BATCH = 32


class ProbedSGD(keras.optimizers.SGD):
    """SGD with momentum that records overlapping ``apply`` calls and counts its steps."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.probe = threading.Lock()
        self.active = 0
        self.overlapping = 0
        self.counted_steps = tf.Variable(0, dtype=tf.int64, trainable=False)

    def apply(self, grads, trainable_variables=None):
        with self.probe:
            self.active += 1
            if self.active > 1:
                self.overlapping += 1
        try:
            # A read-then-assign counter, like the state of many custom optimizers.
            self.counted_steps.assign(self.counted_steps.read_value() + 1)
            return super().apply(grads, trainable_variables)
        finally:
            with self.probe:
                self.active -= 1


def make_data(seed: int = 0) -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype("float32")
    true_w = rng.normal(size=(FEATURES,)).astype("float32")
    logits = x @ true_w + 0.5 + rng.normal(scale=0.5, size=EXAMPLES).astype("float32")
    y = (logits > 0).astype("float32")
    return tf.constant(x), tf.constant(y)


def loss_and_accuracy(w, b, x, y) -> tuple[float, float]:
    logits = tf.linalg.matvec(x, w) + b
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
    accuracy = tf.reduce_mean(tf.cast((logits > 0) == (y > 0.5), tf.float32))
    return float(loss), float(accuracy)


def train(
    name, optimizer: ProbedSGD, threads: int, steps: int, x, y, pass_versions: bool = False
) -> dict:
    w = tf.Variable(tf.zeros([FEATURES]), name="w")
    b = tf.Variable(0.0, name="b")
    # Build before the threads start: a plain Keras optimizer built by concurrent first
    # calls creates its slots twice (and fails).
    optimizer.build([w, b])
    calls = [0] * threads
    barrier = threading.Barrier(threads)

    def worker(index: int) -> None:
        rng = np.random.default_rng(100 + index)
        barrier.wait()
        for _ in range(steps):
            rows = rng.integers(0, EXAMPLES, size=BATCH)
            xb, yb = tf.gather(x, rows), tf.gather(y, rows)
            version = int(optimizer.iterations.numpy())  # the parameters read below
            with tf.GradientTape() as tape:
                logits = tf.linalg.matvec(xb, w) + b
                loss = tf.reduce_mean(
                    tf.nn.sigmoid_cross_entropy_with_logits(labels=yb, logits=logits)
                )
            gw, gb = tape.gradient(loss, [w, b])
            if pass_versions:
                optimizer.apply_gradients([(gw, w), (gb, b)], version=version)
            else:
                optimizer.apply_gradients([(gw, w), (gb, b)])
            calls[index] += 1

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(300)
    if any(t.is_alive() for t in workers):
        raise RuntimeError("a worker did not finish in 300 s")
    total = sum(calls)
    loss, accuracy = loss_and_accuracy(w, b, x, y)
    counted = int(optimizer.counted_steps.numpy())
    row = {
        "name": name,
        "calls": total,
        "iterations": int(optimizer.iterations.numpy()),
        "counted": counted,
        "lost": total - counted,
        "overlapping": optimizer.overlapping,
        "loss": loss,
        "accuracy": accuracy,
    }
    if isinstance(optimizer, SafeOptimizer):
        row["version"] = wrap(w).version
        row["statistics"] = optimizer.statistics()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60, help="steps per worker")
    add_verbose_argument(parser)
    args = parser.parse_args()
    tf.random.set_seed(0)
    x, y = make_data()

    def sgd() -> ProbedSGD:
        return ProbedSGD(learning_rate=0.05, momentum=0.9)

    # SafeOptimizer(opt) returns opt itself, made safe: the probes are on the safe object.
    rows = [
        train("plain SGD(momentum)", sgd(), args.threads, args.steps, x, y),
        train("SafeOptimizer(SGD)", SafeOptimizer(sgd()), args.threads, args.steps, x, y),
        train(
            "SafeOptimizer(SGD, scale)",
            SafeOptimizer(sgd(), max_staleness=1, on_stale="scale"),
            args.threads,
            args.steps,
            x,
            y,
            pass_versions=True,
        ),
    ]
    print(
        f"Hogwild-style asynchronous SGD: {args.threads} workers x {args.steps} steps, "
        f"logistic regression ({FEATURES} features, {EXAMPLES} examples)"
    )
    header = (
        f"{'optimizer':<27} {'calls':>6} {'iterations':>10} {'counted':>8} "
        f"{'lost':>5} {'overlapping':>11} {'loss':>7} {'accuracy':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['name']:<27} {r['calls']:>6} {r['iterations']:>10} {r['counted']:>8} "
            f"{r['lost']:>5} {r['overlapping']:>11} {r['loss']:>7.4f} "
            f"{r['accuracy']:>8.3f}"
        )
    for r in rows[1:]:
        s = r["statistics"]
        print(
            f"{r['name']}: w.version {r['version']}, calls {s.calls}, applied "
            f"{s.applied}, scaled_stale {s.scaled_stale}, dropped_stale {s.dropped_stale}"
        )
    print(
        "lost = calls - counted: increments of the optimizer's own read-then-assign "
        "counter that concurrent calls overwrote; overlapping = apply calls that "
        "started while another was running."
    )


if __name__ == "__main__":
    main()
