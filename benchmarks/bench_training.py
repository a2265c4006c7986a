"""Family 3: training with ``SafeOptimizer(Adam)`` against plain ``Adam``.

Two cases, each with two variants built from the same initial weights:

* ``train_step/...``: one ``tf.function`` training step (forward, backward and
  ``apply_gradients``) of an MLP of 3 × 512 ``Dense`` layers (ReLU) and a 10-way softmax,
  on a batch of 256 (also with ``--quick``, which only takes fewer rounds). The baseline is
  plain ``keras.optimizers.Adam``; ``SafeOptimizer(Adam)`` runs the same step with the
  update inside the variables' critical sections and bumps every version. Goal
  (issue 5): at most 1.05× in one run.
* ``fit_epoch/...``: one epoch of ``model.fit`` (``verbose=0``) on a fixed synthetic
  data set, 8 steps of 256 (``--quick``: 2 steps), compiled with each optimizer.
  No goal; the ratio includes Keras' per-epoch overhead, which is the same for both.
* ``mirrored_train_step/...`` (issue 6): the same training step under
  ``MirroredStrategy`` (``strategy.run``, the global batch split over the replicas,
  gradients all-reduced; the SafeOptimizer section runs once per step in cross-replica
  context, over every replica's copy). The replicas are the first two logical devices of
  the suite's device kind (two logical CPUs when the process configured them before
  TensorFlow started, else one device); ``params["replicas"]`` records how many.
  ``--quick``: a 3 × 128 MLP on a batch of 64. No goal in the issue; the ratio is
  reported.

Both run on ``ctx.device``; data are generated once with a fixed seed.

Where the extra time goes: the update holds the mutexes of one ``tf.CriticalSection``
per model variable plus one for the optimizer state (9 for this MLP), taken in order
once every gradient is computed (so no lock is held during the backward pass, but the
Adam updates no longer overlap it: about 2% of this step in an A/B run) and released
together after the update; each variable's version is bumped once. Two plain-Adam
models built alike differed by up to 5% in the same A/B run, so a single run's ratio
carries about that much noise on this 2-core machine.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from benchmarks.case import Case, Context
from safevars.optimizer import SafeOptimizer

FAMILY = "training"
DESCRIPTION = (
    "an MLP training step (alone and under MirroredStrategy) and a model.fit epoch: "
    "SafeOptimizer(Adam) vs Adam"
)
ORDER = 3

WIDTH = 512
LAYERS = 3
FEATURES = 256
CLASSES = 10
GOAL = 1.05


def _model(seed: int, width: int = WIDTH) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((FEATURES,))]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(LAYERS)]
    layers.append(keras.layers.Dense(CLASSES))
    return keras.Sequential(layers)


def _data(examples: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(examples, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=(examples,)).astype("int32")
    return x, y


def _train_step(model: keras.Model, optimizer: Any, x: tf.Tensor, y: tf.Tensor) -> Any:
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(autograph=False)
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def call() -> None:
        step().numpy()  # wait for the step (and keep the loss from being pruned)

    return call


def _mirrored_strategy(ctx: Context) -> tf.distribute.MirroredStrategy:
    kind = ctx.device_kind.upper()
    devices = [d.name for d in tf.config.list_logical_devices(kind)][:2] or [ctx.device]

    class _OwnCollectiveKeys(tf.distribute.MirroredStrategy):
        # Collective keys of its own, so no other MirroredStrategy in the benchmark
        # process shares (and clashes on) their cached shapes.
        _collective_key_base = 7_000_000

    return _OwnCollectiveKeys(devices)


def _mirrored_train_step(
    strategy: tf.distribute.MirroredStrategy, model: keras.Model, optimizer: Any,
    x: np.ndarray, y: np.ndarray,
) -> Any:
    batch = len(x)
    replicas = strategy.num_replicas_in_sync
    share = batch // replicas

    def shard(ctx: tf.distribute.ReplicaContext) -> tuple[tf.Tensor, tf.Tensor]:
        start = ctx.replica_id_in_sync_group * share
        return tf.constant(x[start:start + share]), tf.constant(y[start:start + share])

    inputs = strategy.experimental_distribute_values_from_function(shard)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    @tf.function(autograph=False)
    def step(inputs: Any) -> tf.Tensor:
        def replica(xs: tf.Tensor, ys: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                per_example = loss_fn(ys, model(xs, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=inputs), axis=None)

    def call() -> None:
        step(inputs).numpy()

    return call


def _mirrored_case(ctx: Context) -> Case:
    width, batch = (128, 64) if ctx.quick else (WIDTH, 256)
    strategy = _mirrored_strategy(ctx)
    x, y = _data(batch)
    with strategy.scope():
        plain_model, safe_model = _model(2, width), _model(2, width)
        plain_opt = keras.optimizers.Adam(1e-3)
        safe_opt = SafeOptimizer(keras.optimizers.Adam(1e-3))
        plain_opt.build(plain_model.trainable_variables)  # not inside strategy.run
        safe_opt.build(safe_model.trainable_variables)
    replicas = strategy.num_replicas_in_sync
    return Case(
        family=FAMILY,
        name=f"mirrored_train_step/mlp{LAYERS}x{width}/b{batch}/r{replicas}",
        variants={
            "Adam": _mirrored_train_step(strategy, plain_model, plain_opt, x, y),
            "SafeOptimizer(Adam)": _mirrored_train_step(strategy, safe_model, safe_opt, x, y),
        },
        params={"layers": LAYERS, "width": width, "features": FEATURES,
                "classes": CLASSES, "batch": batch, "replicas": replicas,
                "devices": list(strategy.extended.worker_devices)},
    )


def _fit_epoch(model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int) -> Any:
    def call() -> None:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)

    return call


def cases(ctx: Context) -> list[Case]:
    batch = 256
    fit_steps = 2 if ctx.quick else 8
    with tf.device(ctx.device):
        x, y = _data(batch * fit_steps)
        xb, yb = tf.constant(x[:batch]), tf.constant(y[:batch])
        plain_model, safe_model = _model(0), _model(0)
        plain_step = _train_step(plain_model, keras.optimizers.Adam(1e-3), xb, yb)
        safe_step = _train_step(
            safe_model, SafeOptimizer(keras.optimizers.Adam(1e-3)), xb, yb
        )
        fit_plain, fit_safe = _model(1), _model(1)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        fit_plain.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        fit_safe.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(1e-3)), loss=loss)
    shape = f"mlp{LAYERS}x{WIDTH}"
    params = {"layers": LAYERS, "width": WIDTH, "features": FEATURES, "classes": CLASSES}
    return [
        Case(
            family=FAMILY,
            name=f"train_step/{shape}/b{batch}",
            variants={"Adam": plain_step, "SafeOptimizer(Adam)": safe_step},
            params={**params, "batch": batch},
            goal=("SafeOptimizer(Adam)", GOAL),
        ),
        Case(
            family=FAMILY,
            name=f"fit_epoch/{shape}/b{batch}x{fit_steps}",
            variants={
                "Adam": _fit_epoch(fit_plain, x, y, batch),
                "SafeOptimizer(Adam)": _fit_epoch(fit_safe, x, y, batch),
            },
            ops_per_call=fit_steps,
            params={**params, "batch": batch, "steps_per_epoch": fit_steps},
        ),
        _mirrored_case(ctx),
    ]
