"""What SafeOptimizer tests share: fixed data, a small Keras model, the state a refused call
must leave unchanged, the optimizers a safe one is compared against, and training runs
compared bitwise."""

from __future__ import annotations

import keras
import numpy as np

from safevars.optimizer import SafeOptimizer
from safevars.variable import wrap

RNG = np.random.default_rng(1234)
INIT = RNG.normal(size=(4, 3)).astype("float32")
GRADS = [RNG.normal(size=(4, 3)).astype("float32") for _ in range(6)]


def regression_data(n: int = 256, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    w = rng.normal(size=(8, 1)).astype("float32")
    return x, (x @ w + 0.1).astype("float32")


def small_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
    )


def everything(opt: SafeOptimizer, variables) -> tuple:
    """Every piece of state a refused call must leave unchanged."""
    return (
        [np.array(v.numpy()) for v in variables],
        [np.array(v.numpy()) for v in opt.variables],
        [wrap(v).version for v in variables],
        opt.statistics(),
    )


def assert_same_state(before: tuple, after: tuple) -> None:
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)
    assert before[2:] == after[2:]


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw_clip_schedule": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5),
        weight_decay=0.1,
        clipnorm=0.5,
    ),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "nadam": lambda: keras.optimizers.Nadam(0.05),  # overrides _backend_update_step
    "adam_ema": lambda: keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=4),
}


def assert_same_training(a: keras.Model, b: keras.Model) -> None:
    """Bitwise the same model weights and optimizer state (layout included)."""
    assert len(a.optimizer.variables) == len(b.optimizer.variables)
    for x, z in zip(a.weights + a.optimizer.variables, b.weights + b.optimizer.variables):
        assert x.shape == z.shape
        np.testing.assert_array_equal(np.asarray(x.numpy()), np.asarray(z.numpy()))


def compiled(optimizer, seed: int = 0, build: bool = False) -> keras.Model:
    model = small_model(seed)
    model.compile(optimizer=optimizer, loss="mse")
    if build:
        model.optimizer.build(model.trainable_variables)
    return model


def fit(model: keras.Model, epochs: int = 1) -> None:
    x, y = regression_data()
    model.fit(x, y, epochs=epochs, batch_size=32, shuffle=False, verbose=0)
