"""SafeOptimizer on an in-process ParameterServerStrategy cluster; prints one JSON line.

Usage: python optimizer_ps.py [--workers 3] [--steps 60] [--train-steps 90]
Run it in its own process: in-process servers cannot be shut down.

Parts (tests/optimizer/test_distributed.py checks the result):

* ``exact``: asynchronous workers apply constant gradients with SGD(momentum) to a
  ``tf.Variable`` and a SafeVariable on the parameter server, half the steps inside
  ``strategy.run``, half in the scheduled function's cross-replica context, while the
  coordinator applies steps eagerly. With constant gradients the result does not depend
  on the order of the steps, only on whether each step's read-modify-write of the
  momentum slot, the variable and ``iterations`` was atomic: it must equal a serial run.
  Before that the same steps run with the plain optimizer on a plain variable, for
  comparison: Keras 3's ``Variable.assign_add`` is ``assign(self + value)``, so its
  ``iterations`` loses increments between concurrent workers (scheduler-dependent, only
  reported).
* ``train``: linear regression with a Keras model, gradients tagged with the
  ``iterations`` read before the forward pass, ``max_staleness=0, on_stale="drop"``:
  every call counted once on the PS, and stale steps (version 0) dropped exactly.
* ``per_worker``: one call on each worker for sure (the coordinator's per-worker
  functions); the counters on the PS count all of them.
* ``accumulate``: ``accumulate_steps=2`` with concurrent workers: one real update per two
  calls, whatever worker made them.
* ``scale`` / ``raise``: the other staleness policies, scheduled and from the coordinator.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from script_common import hexes  # noqa: E402

from safevars.errors import InvalidArgumentError, StaleGradientError  # noqa: E402
from safevars.local_cluster import start_in_process_cluster  # noqa: E402
from safevars.optimizer import SafeOptimizer  # noqa: E402
from safevars.variable import SafeVariable, wrap  # noqa: E402

SHAPE = [4]
LR, MOMENTUM = 0.01, 0.9


def error_text(call) -> str:
    try:
        call()
    except (StaleGradientError, InvalidArgumentError) as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    except tf.errors.InvalidArgumentError as e:  # a run-time assertion: its message
        failed = [line for line in str(e).splitlines() if "assertion failed" in line]
        return f"{type(e).__name__}: {(failed or [str(e)])[0][:300]}"
    return "no error"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eager-steps", type=int, default=6)
    parser.add_argument("--train-steps", type=int, default=90)
    parser.add_argument("--accumulate-calls", type=int, default=24)
    args = parser.parse_args()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, 1)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    worker_index = tf.distribute.coordinator.experimental_get_current_worker_index
    result: dict = {"workers": args.workers}

    # ----------------------------------------------------------------- exact
    with strategy.scope():
        w = tf.Variable(tf.zeros(SHAPE), name="w")
        sw = SafeVariable(tf.zeros(SHAPE), name="sw")
        plain_w = tf.Variable(tf.zeros(SHAPE), name="plain_w")
        safe = SafeOptimizer(keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM))
        safe.build([w, sw])
        plain = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
        plain.build([plain_w])
    ones = tf.ones(SHAPE)

    @tf.function
    def safe_cross_replica():
        safe.apply_gradients([(ones, w), (ones, sw)])

    @tf.function
    def safe_in_run():
        strategy.run(lambda: safe.apply_gradients([(tf.ones(SHAPE), w), (tf.ones(SHAPE), sw)]))

    @tf.function
    def plain_step():
        strategy.run(lambda: plain.apply_gradients([(tf.ones(SHAPE), plain_w)]))

    for _ in range(args.steps):  # the plain optimizer first, on its own
        coordinator.schedule(plain_step)
    coordinator.join()
    for i in range(args.steps):
        coordinator.schedule(safe_in_run if i % 2 else safe_cross_replica)
    # The coordinator applies steps eagerly while the workers run.
    eager_calls = []
    for _ in range(args.eager_steps):
        safe.apply_gradients([(ones, w), (ones, sw)])
        eager_calls.append(safe.statistics().calls)
    coordinator.join()
    total = args.steps + args.eager_steps
    # Serial runs of the same optimizer: for the safe steps and for the plain ones.
    reference_w = tf.Variable(tf.zeros(SHAPE))
    plain_reference_w = tf.Variable(tf.zeros(SHAPE))
    reference = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
    plain_reference = keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM)
    for i in range(total):
        reference.apply_gradients([(ones, reference_w)])
        if i < args.steps:
            plain_reference.apply_gradients([(ones, plain_reference_w)])
    result["exact"] = {
        "calls": total,
        "w": w.numpy().tolist(),
        "sw": sw.numpy().tolist(),
        "reference": reference_w.numpy().tolist(),
        "plain_w": plain_w.numpy().tolist(),
        "max_abs_error": float(
            np.max(np.abs(np.stack([w.numpy(), sw.numpy()]) - reference_w.numpy()))
        ),
        "plain_max_abs_error": float(np.max(np.abs(plain_w.numpy() - plain_reference_w.numpy()))),
        "plain_iterations": int(plain.iterations.numpy()),
        "iterations": int(safe.iterations.numpy()),
        "versions": [wrap(w).version, sw.version],
        "statistics": list(safe.statistics()),
        "eager_calls_seen": eager_calls,
        "variable_device": w.device,
        "lock_devices": [
            wrap(w).guard.cs._handle.device,
            sw.guard.cs._handle.device,
            safe._safevars.state_guard.cs._handle.device,
        ],
        "counters_device": safe.safevars_state.statistics.device,
    }

    # ----------------------------------------------------------------- train
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.5).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        opt = SafeOptimizer(keras.optimizers.SGD(0.05), max_staleness=0, on_stale="drop")
        opt.build(model.trainable_variables)
    xs, ys = tf.constant(x), tf.constant(y)

    def full_loss() -> float:
        return float(np.mean((model(x).numpy() - y) ** 2))

    def gradients(seed):
        rows = tf.random.stateless_uniform([32], tf.stack([seed, 0]), 0, 512, tf.int32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(tf.gather(xs, rows)) - tf.gather(ys, rows)) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def train_step(seed):
        def replica():
            # The version first: the parameters the gradients use are read after it.
            version = tf.convert_to_tensor(opt.iterations)
            with tf.control_dependencies([version]):
                grads = gradients(seed)
            opt.apply_gradients(zip(grads, model.trainable_variables), version=version)

        strategy.run(replica)
        return worker_index()

    @tf.function
    def stale_step(seed):
        grads = gradients(seed)
        opt.apply_gradients(
            zip(grads, model.trainable_variables), version=tf.constant(0, tf.int64)
        )

    loss_before = full_loss()
    ran_on = [
        coordinator.schedule(train_step, args=(tf.constant(i),)) for i in range(args.train_steps)
    ]
    coordinator.join()
    after_train = opt.statistics()
    weights = [v.numpy() for v in model.trainable_variables]
    stale = 12
    for i in range(stale):
        coordinator.schedule(stale_step, args=(tf.constant(i),))
    coordinator.join()
    after_stale = opt.statistics()
    unchanged_by_stale = hexes(weights) == hexes([v.numpy() for v in model.trainable_variables])

    @tf.function
    def one_per_worker():
        grads = gradients(tf.constant(7))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return worker_index()

    per_worker = coordinator._create_per_worker_resources(one_per_worker)
    per_worker_ran = sorted(int(value.fetch()) for value in per_worker._values)
    result["train"] = {
        "steps": args.train_steps,
        "loss_before": loss_before,
        "loss_after": full_loss(),
        "workers_used": sorted({int(r.fetch()) for r in ran_on}),
        "after_train": list(after_train),
        "after_stale": list(after_stale),
        "stale_scheduled": stale,
        "weights_unchanged_by_stale": unchanged_by_stale,
        "per_worker_ran": per_worker_ran,
        "after_per_worker": list(opt.statistics()),
        "iterations": int(opt.iterations.numpy()),
        "versions": [wrap(v).version for v in model.trainable_variables],
    }

    # ----------------------------------------------------------------- accumulate
    with strategy.scope():
        v5 = tf.Variable(tf.zeros([2]))
        accumulating = SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=2)
        accumulating.build([v5])

    @tf.function
    def accumulate(scale):
        strategy.run(lambda: accumulating.apply_gradients([(tf.ones([2]) * scale, v5)]))

    # Gradients 1 and 3 alternate: however concurrent calls pair up, the means sum to
    # (calls / 2) * 2, so v = -calls exactly.
    for i in range(args.accumulate_calls):
        coordinator.schedule(accumulate, args=(tf.constant(1.0 + 2.0 * (i % 2)),))
    coordinator.join()
    result["accumulate"] = {
        "calls": args.accumulate_calls,
        "v": v5.numpy().tolist(),
        "iterations": int(accumulating.iterations.numpy()),
        "version": wrap(v5).version,
        "statistics": list(accumulating.statistics()),
    }

    # ----------------------------------------------------------------- scale / raise
    with strategy.scope():
        v3 = tf.Variable(tf.zeros([2]))
        scaler = SafeOptimizer(keras.optimizers.SGD(1.0), max_staleness=1, on_stale="scale")
        scaler.build([v3])
        v4 = tf.Variable(tf.zeros([2]))
        strict = SafeOptimizer(keras.optimizers.SGD(1.0), max_staleness=0, on_stale="raise")
        strict.build([v4])

    @tf.function
    def scaled(version):
        scaler.apply_gradients([(tf.ones([2]), v3)], version=version)

    @tf.function
    def refused(version):
        strict.apply_gradients([(tf.ones([2]), v4)], version=version)

    for fresh in range(2):  # the version each step read: not stale
        coordinator.schedule(scaled, args=(tf.constant(fresh, tf.int64),))
        coordinator.join()
    coordinator.schedule(scaled, args=(tf.constant(0, tf.int64),))  # 2 updates stale
    coordinator.join()
    result["scale"] = {"v": v3.numpy().tolist(), "statistics": list(scaler.statistics())}

    coordinator.schedule(refused, args=(tf.constant(0, tf.int64),))
    coordinator.join()
    before = v4.numpy().tolist()
    coordinator.schedule(refused, args=(tf.constant(0, tf.int64),))
    scheduled_error = error_text(coordinator.join)
    eager_error = error_text(lambda: strict.apply_gradients([(ones[:2], v4)], version=0))
    future_error = error_text(lambda: strict.apply_gradients([(ones[:2], v4)], version=9))
    unchanged = v4.numpy().tolist() == before
    coordinator.schedule(refused, args=(tf.constant(1, tf.int64),))  # fresh: applied
    coordinator.join()
    result["raise"] = {
        "scheduled_error": scheduled_error,
        "eager_error": eager_error,
        "future_error": future_error,
        "unchanged": unchanged,
        "v_after_fresh": v4.numpy().tolist(),
        "statistics": list(strict.statistics()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
