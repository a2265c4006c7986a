"""safevars.scope() on an in-process ParameterServerStrategy cluster; prints one JSON line.

Usage: python scope_ps.py [--workers 3] [--steps 60]
Run it in its own process: in-process servers cannot be shut down.

A Keras model and a plain Keras ``SGD(momentum)`` are built inside ``strategy.scope()``
and ``safevars.scope()``: their variables live on the parameter server and are
SafeVariables. Asynchronous workers then apply constant gradients ``--steps`` times
(scheduled with a ``ClusterCoordinator``, inside ``strategy.run``: a plain Keras
optimizer refuses the scheduled function's cross-replica context), then the coordinator
takes a snapshot of the model and writes the bias, each in a ``tf.function``. With constant gradients the result does not depend
on the order of the steps, only on whether each step's read-modify-write of the momentum
slot, the weight and ``iterations`` was atomic: it must equal a serial run, and every
version must count the steps. The same run without ``safevars.scope()`` is reported for
comparison (scheduler-dependent), and a third run builds the model and optimizer plainly,
then protects them with ``safevars.protect`` under ``strategy.scope()``, before training.
"""

from __future__ import annotations

import contextlib
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from script_common import parse, parser  # noqa: E402

import safevars  # noqa: E402
from safevars.local_cluster import start_in_process_cluster  # noqa: E402

FEATURES = 4
LR, MOMENTUM = 0.01, 0.9


def train(strategy, coordinator, steps: int, how: str) -> dict:
    """``how``: "plain", "scope" (built inside safevars.scope()) or "protect"."""
    safe = how != "plain"
    with strategy.scope(), safevars.scope() if how == "scope" else contextlib.nullcontext():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(1, kernel_initializer="zeros")]
        )
        optimizer = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        optimizer.build(model.trainable_variables)
        if how == "protect":
            safevars.protect([model, optimizer])
    grads = [tf.ones([FEATURES, 1]), tf.ones([1])]

    @tf.function
    def in_run():
        strategy.run(
            lambda: optimizer.apply_gradients(
                zip([tf.identity(g) for g in grads], model.trainable_variables)
            )
        )

    for _ in range(steps):
        coordinator.schedule(in_run)
    coordinator.join()
    weights = model.trainable_variables
    result = {
        "kernel": weights[0].numpy().ravel().tolist(),
        "bias": weights[1].numpy().ravel().tolist(),
        "iterations": int(optimizer.iterations.numpy()),
    }
    if safe:
        result["safe"] = all(
            isinstance(v.value, safevars.SafeVariable)
            for v in [*model.weights, *optimizer.variables]
        )
        result["versions"] = [safevars.wrap(w.value).version for w in weights]
        result["iterations_version"] = safevars.wrap(optimizer.iterations.value).version
        result["slot_versions"] = [safevars.wrap(v.value).version for v in optimizer.variables[2:]]
        # Locks on a parameter server are taken in tf.functions (an eager take from the
        # coordinator is refused), here called on the coordinator.
        versions = tf.function(lambda: [s.version for s in safevars.snapshot(model)])()
        result["snapshot_versions"] = [int(v) for v in versions]
        bias = weights[1]
        tf.function(lambda: bias.assign(tf.fill([1], 5.0)))()
        result["bias_version_after_assign"] = safevars.wrap(bias.value).version
    return result


def main() -> None:
    arguments = parser()
    arguments.add_argument("--workers", type=int, default=3)
    arguments.add_argument("--steps", type=int, default=60)
    args = parse(arguments)
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, 1)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    plain = train(strategy, coordinator, args.steps, "plain")
    safe = train(strategy, coordinator, args.steps, "scope")
    protected = train(strategy, coordinator, args.steps, "protect")

    # The serial reference: the same optimizer, the same steps, one after the other.
    kernel, bias = tf.Variable(tf.zeros([FEATURES, 1])), tf.Variable(tf.zeros([1]))
    reference = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
    for _ in range(args.steps):
        reference.apply_gradients([(tf.ones([FEATURES, 1]), kernel), (tf.ones([1]), bias)])
    print(
        json.dumps(
            {
                "workers": args.workers,
                "steps": args.steps,
                "plain": plain,
                "safe": safe,
                "protected": protected,
                "reference": {
                    "kernel": kernel.numpy().ravel().tolist(),
                    "bias": bias.numpy().ravel().tolist(),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
