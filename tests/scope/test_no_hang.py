"""No hang with Keras: ``fit`` and friends inside ``safevars.locked(model)``.

``with safevars.locked(model): model.fit(...)`` after ``fit`` was traced once used to
hang forever (the traced step waited for the lock its caller held). Every way a thread
could wait on its own lock through Keras raises ``LockReentryError`` at once, or runs
where that is sound: ``predict`` (it takes no lock), a callback that locks the model
between steps, a new model trained in a scope nested in the block. Each body runs in a
thread with a deadline (``call_bounded``), so a hang fails the test instead of the run.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import safevars
from safevars.creator_scope import scope
from tests.support.threading_harness import call_bounded

BATCH = 8


def make_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True)


def trained() -> keras.Model:
    """A model built in the scope, with fit, evaluate and predict traced once."""
    x, y = data()
    with scope():
        model = make_model()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    model.evaluate(x, y, batch_size=BATCH, verbose=0)
    model.predict(x, batch_size=BATCH, verbose=0)
    return model


def versions(model: keras.Model) -> list[int]:
    return [w.value.version for w in model.weights]


@pytest.mark.parametrize("call", ["fit", "evaluate", "train_on_batch", "test_on_batch"])
def test_training_calls_inside_locked_model_raise_instead_of_hanging(call):
    model = trained()
    x, y = data()
    before = versions(model)

    def attempt():
        with safevars.locked(model):
            if call in ("fit", "evaluate"):
                getattr(model, call)(x, y, batch_size=BATCH, verbose=0)
            else:
                getattr(model, call)(x[:BATCH], y[:BATCH])

    with pytest.raises(safevars.LockReentryError, match="would hang"):
        call_bounded(attempt)
    assert versions(model) == before and not safevars.held_locks()
    model.fit(x, y, batch_size=BATCH, verbose=0)  # outside the block: runs
    assert versions(model) == [v + 2 for v in before]


def test_predict_inside_locked_model_runs():
    """predict takes no lock (forward-pass reads take none): holding the lock while it
    runs is sound, and it sees the weights as the block left them."""
    model = trained()
    x, _ = data()

    def body():
        with safevars.locked(model):
            for w in model.weights:
                w.assign(np.zeros(w.shape, np.float32))
            return model.predict(x, batch_size=BATCH, verbose=0)

    np.testing.assert_array_equal(call_bounded(body), np.zeros((16, 1), np.float32))


def test_a_callback_that_locks_the_model_between_steps_runs():
    model = trained()
    x, y = data()
    seen = []

    class Locking(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            with safevars.locked(model):  # between two steps: the lock is free
                seen.append(versions(model))

    call_bounded(lambda: model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[Locking()]))
    assert seen == [[3] * 4, [4] * 4]  # two steps in trained(), then two more


def test_a_nested_scope_inside_the_block():
    """Inside ``locked(model)``, a scope block opened for another model: training that
    one runs (another lock); training the locked model there still raises."""
    model = trained()
    x, y = data()

    def body():
        with safevars.locked(model):
            with scope():
                other = make_model()
                other.fit(x, y, batch_size=BATCH, verbose=0)
                assert versions(other) == [2] * 4
                model.fit(x, y, batch_size=BATCH, verbose=0)

    with pytest.raises(safevars.LockReentryError, match="would hang"):
        call_bounded(body)
