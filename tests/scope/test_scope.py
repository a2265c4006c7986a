"""safevars.scope(): a Keras model built inside is protected, Keras' own writes included.

Every write Keras makes (a plain optimizer's step, ``layer.kernel.assign``,
``set_weights``, ``load_weights``, metric and ``iterations`` increments) must be locked and
counted, eagerly, in ``tf.function`` and under ``MirroredStrategy``; and a model trained
in one thread can be snapshotted from another, each snapshot a state the model was in.
"""

from __future__ import annotations

import contextlib
import os
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.creator_scope import scope
from tests.support.threading_harness import run_threads

BATCH = 4
SAMPLES = 32
STEPS_PER_EPOCH = SAMPLES // BATCH


def make_model(units: int = 4) -> keras.Model:
    """A small MLP with seeded initializers: the same weights whenever it is built."""
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(
                units,
                activation="tanh",
                kernel_initializer=keras.initializers.GlorotUniform(seed=1),
            ),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=2)),
        ]
    )


def data(samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def backing(variable) -> safevars.SafeVariable:
    return variable.value


def versions(variables) -> list[int]:
    return [safevars.wrap(v).version for v in variables]


# ---------------------------------------------------------------------- what is wrapped


def test_every_variable_created_inside_is_a_safe_variable():
    with scope():
        model = make_model()
        optimizer = keras.optimizers.Adam()
        plain = tf.Variable(1.0)
        direct = safevars.SafeVariable(2.0)
        with scope():  # nested: wrapped once
            nested = tf.Variable(3.0)
    outside = tf.Variable(4.0)
    for weight in model.weights:
        assert isinstance(weight, keras.Variable)  # Keras' class, path and policy kept
        assert type(backing(weight)) is safevars.SafeVariable
        assert safevars.wrap(weight) is backing(weight)
    assert type(backing(optimizer.iterations)) is safevars.SafeVariable
    assert type(plain) is safevars.SafeVariable and type(nested) is safevars.SafeVariable
    assert type(direct.__wrapped__) is tf.Variable(0.0).__class__  # not a proxy of a proxy
    assert not isinstance(outside, safevars.SafeVariable)


def test_variables_created_while_tracing_inside_the_scope_are_safe():
    holder = []

    @tf.function
    def create():
        if not holder:
            holder.append(tf.Variable(1.0))
        return holder[0].assign_add(1.0)

    with scope():
        create()
    assert isinstance(holder[0], safevars.SafeVariable) and holder[0].version == 1


def test_slots_of_safe_weights_are_safe_even_if_the_optimizer_is_built_outside():
    with scope():
        model = make_model()
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)
    slots = [v for v in optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 2 * len(model.trainable_variables)
    assert all(type(backing(s)) is safevars.SafeVariable for s in slots)
    assert type(backing(optimizer.iterations)) is not safevars.SafeVariable  # made outside


# ---------------------------------------------------------------------- Keras' writes


def test_layer_assign_set_weights_and_load_weights_are_counted(tmp_path, mode):
    with scope():
        model = make_model()
    kernel = model.layers[0].kernel
    mode(lambda: kernel.assign(tf.ones(kernel.shape)))()
    assert versions([kernel]) == [1]
    model.set_weights([w.numpy() * 2 for w in model.weights])
    assert versions(model.weights) == [2, 1, 1, 1]
    path = os.fspath(tmp_path / "m.weights.h5")
    model.save_weights(path)
    model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
    model.load_weights(path)
    assert versions(model.weights) == [4, 3, 3, 3]
    np.testing.assert_array_equal(kernel.numpy(), np.full(kernel.shape, 2.0))


def test_checkpoint_restore_brings_back_value_and_version(tmp_path):
    """tf.train.Checkpoint of a model built in the scope saves the versions, as a
    SafeVariable's checkpoint does, and a restore brings both back."""
    with scope():
        model = make_model()
    kernel = model.layers[0].kernel
    kernel.assign(tf.ones(kernel.shape))
    saved = [w.numpy() for w in model.weights]
    path = tf.train.Checkpoint(model=model).save(os.fspath(tmp_path / "ckpt"))
    model.set_weights([np.zeros(w.shape, np.float32) for w in model.weights])
    kernel.assign(tf.fill(kernel.shape, 3.0))
    assert versions(model.weights) == [3, 1, 1, 1]
    tf.train.Checkpoint(model=model).restore(path).assert_consumed()
    assert versions(model.weights) == [1, 0, 0, 0]
    for weight, value in zip(model.weights, saved):
        np.testing.assert_array_equal(weight.numpy(), value)
    # A plain model's checkpoint loads the values (it has no versions: they stay, and
    # the status reports them unmatched, as for a SafeVariable) and a plain model loads
    # this one (the versions are extra entries it leaves alone).
    plain = make_model()
    plain_path = tf.train.Checkpoint(model=plain).save(os.fspath(tmp_path / "plain"))
    tf.train.Checkpoint(model=model).restore(plain_path).expect_partial()
    assert versions(model.weights) == [1, 0, 0, 0]
    for weight, other in zip(model.weights, plain.weights):
        np.testing.assert_array_equal(weight.numpy(), other.numpy())
    tf.train.Checkpoint(model=plain).restore(path).expect_partial()
    np.testing.assert_array_equal(plain.layers[0].kernel.numpy(), saved[0])


def _fit(model, optimizer, epochs=1, run_eagerly=False, jit_compile=False):
    model.compile(
        optimizer=optimizer, loss="mse", run_eagerly=run_eagerly, jit_compile=jit_compile
    )
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return epochs * STEPS_PER_EPOCH


def _assert_one_version_per_step(model, optimizer, steps):
    assert versions(model.trainable_variables) == [steps] * len(model.trainable_variables)
    slots = [
        v
        for v in optimizer.variables
        if v is not optimizer.iterations and "learning_rate" not in v.path
    ]
    assert slots and versions(slots) == [steps] * len(slots)
    assert int(optimizer.iterations.numpy()) == steps


@pytest.mark.parametrize(
    "how, name",
    [
        ("eager", "adam"),
        ("eager", "sgd_momentum"),
        ("tf_function", "adam"),
        ("tf_function", "sgd_momentum"),
        ("xla", "adam"),
    ],  # (one XLA case: compiling is slow)
)
def test_fit_with_a_plain_optimizer_counts_each_step_once(how, name):
    with scope():
        model = make_model()
        optimizer = (
            keras.optimizers.Adam(1e-2)
            if name == "adam"
            else keras.optimizers.SGD(1e-2, momentum=0.9)
        )
    steps = _fit(model, optimizer, run_eagerly=how == "eager", jit_compile=how == "xla")
    _assert_one_version_per_step(model, optimizer, steps)
    assert backing(optimizer.iterations).version == steps


class LazyModel(keras.Model):
    """A subclassed model with a weight of its own made at once and a layer built by
    its first call: Keras builds it (and the optimizer) in the first traced step."""

    def __init__(self):
        super().__init__()
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False)
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)


@pytest.mark.parametrize("how", ["eager", "tf_function"])
@pytest.mark.parametrize("safe_optimizer", [False, True], ids=["plain", "safe"])
def test_fit_of_a_model_built_by_its_first_step(how, safe_optimizer):
    """The train step's section built the optimizer before the step, when only the
    model's own weight existed: the step then failed ("Unknown variable" for the Dense
    kernel). A model not yet built is left to build itself, and its optimizer with it."""
    with scope():  # (fit in the block: the weights are made by its first step)
        model = LazyModel()
        optimizer = keras.optimizers.Adam(1e-2)
        optimizer = safevars.SafeOptimizer(optimizer) if safe_optimizer else optimizer
        steps = _fit(model, optimizer, run_eagerly=how == "eager")
    assert versions(model.dense.weights) == [steps] * 2
    assert int(optimizer.iterations.numpy()) == steps
    if safe_optimizer:
        assert optimizer.statistics().calls == steps


def _embedding_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(
                10, 4, embeddings_initializer=keras.initializers.RandomUniform(seed=3)
            ),
            keras.layers.Flatten(),
            keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed=4)),
        ]
    )


@pytest.mark.parametrize(
    "how, safe_optimizer",
    [("tf_function", False), ("tf_function", True), ("xla", False), ("xla", True)],
    ids=["sgd", "safe_sgd", "sgd_xla", "safe_sgd_xla"],
)
def test_fit_applies_sparse_gradients_with_scatter(how, safe_optimizer):
    """An Embedding's gradient is ``IndexedSlices``, which Keras' SGD applies with
    ``scatter_sub`` inside ``strategy.extended.update``: in the traced step, the count
    of that write waited for what the scatter returned, an unread variable over the
    eager handle the step captured ("Tensor.graph is undefined when eager execution is
    enabled"). Same weights as without safevars, one version per step."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 10, size=(SAMPLES, 3)).astype(np.int32)
    y = rng.normal(size=(SAMPLES, 1)).astype(np.float32)

    def fit(model, optimizer):
        model.compile(optimizer=optimizer, loss="mse", jit_compile=how == "xla")
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    with scope():
        model = _embedding_model()
        optimizer = keras.optimizers.SGD(0.1)
    fit(model, safevars.SafeOptimizer(optimizer) if safe_optimizer else optimizer)
    plain = _embedding_model()
    fit(plain, keras.optimizers.SGD(0.1))
    for got, want in zip(model.weights, plain.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(model.weights) == [STEPS_PER_EPOCH] * len(model.weights)


def _build_compiled(optimizer_class=keras.optimizers.Adam):
    """A model compiled with metrics, which are built here (by one evaluate call)."""
    model, optimizer = make_model(), optimizer_class(1e-2)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], jit_compile=False)
    model.evaluate(*data(BATCH), verbose=0)
    return model, optimizer


@pytest.mark.parametrize("order", ["scope_outside", "scope_inside"])
def test_fit_under_mirrored_strategy_counts_each_update_once(mirrored_strategy, order):
    """One version per step on every weight and slot however many replicas, the same
    weights and metrics as the plain model bit for bit (metrics are sync-on-read
    variables: each replica writes its own copy, as without safevars)."""
    if order == "scope_outside":
        with scope(), mirrored_strategy.scope():
            model, optimizer = _build_compiled()
    else:
        with mirrored_strategy.scope(), scope():
            model, optimizer = _build_compiled()
    with mirrored_strategy.scope():
        plain_model, _ = _build_compiled()
    assert all(
        isinstance(backing(w).__wrapped__, tf.distribute.DistributedValues) for w in model.weights
    )
    assert all(type(v.value) is safevars.SafeVariable for m in model.metrics for v in m.variables)
    x, y = data()
    with mirrored_strategy.scope():
        fit = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        history = model.fit(x, y, **fit).history
        expected = plain_model.fit(x, y, **fit).history
    assert history == expected  # (merging the replicas' metric writes changed a last bit)
    for got, want in zip(model.weights, plain_model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    _assert_one_version_per_step(model, optimizer, 2 * STEPS_PER_EPOCH)
    for variable in model.weights + optimizer.variables:  # every replica's copy alike
        copies = [c.numpy() for c in backing(variable).values]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), variable.path


@pytest.mark.parametrize("swap", [False, True], ids=["ema", "ema_swapped_by_callback"])
def test_fit_under_mirrored_strategy_with_ema(mirrored_strategy, swap):
    """Keras' EMA copies (``use_ema=True``) are mirrored with aggregation NONE and
    written inside each replica's step, each replica its own copy: safevars refused
    that write (UnsupportedStrategyError). Now every copy is written as without
    safevars, in one locked write counting one version per step; SwapEMAWeights, which
    swaps weights and copies in cross-replica context, gives the plain model's result."""

    def build():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        return model, optimizer

    with mirrored_strategy.scope(), scope():
        model, optimizer = build()
    with mirrored_strategy.scope():
        plain_model, plain_optimizer = build()
    x, y = data()

    def fit(model):
        callbacks = [keras.callbacks.SwapEMAWeights(swap_on_epoch=True)] if swap else []
        return model.fit(
            x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
        ).history

    with mirrored_strategy.scope():
        assert fit(model) == fit(plain_model)
    averages = optimizer._model_variables_moving_average
    assert averages and all(type(backing(v)) is safevars.SafeVariable for v in averages)
    pairs = [*zip(model.weights, plain_model.weights)]
    pairs += zip(averages, plain_optimizer._model_variables_moving_average)
    for got, want in pairs:
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    for variable in averages:  # every replica's copy alike, as without safevars
        copies = [c.numpy() for c in backing(variable).values]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), variable.path
    if not swap:  # (the callback's swaps count versions of their own)
        steps = 2 * STEPS_PER_EPOCH
        assert versions(averages) == [steps] * len(averages)
        # fit ends by writing the averages into the weights (finalize_variable_values).
        weights = model.trainable_variables
        assert versions(weights) == [steps + 1] * len(weights)


@pytest.mark.parametrize("strategy", ["none", "mirrored"])
def test_fit_with_safe_optimizer_counts_each_step_once(strategy, mirrored_strategy):
    context = mirrored_strategy.scope if strategy == "mirrored" else contextlib.nullcontext
    with context(), scope():
        model = make_model()
        optimizer = safevars.SafeOptimizer(keras.optimizers.Adam(1e-2))
    with context():
        steps = _fit(model, optimizer)
    _assert_one_version_per_step(model, optimizer, steps)


def test_custom_loop_under_one_device_strategy():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope(), scope():
        model, optimizer = make_model(), keras.optimizers.SGD(0.1, momentum=0.5)
    grads = [tf.ones_like(v) for v in model.trainable_variables]

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply_gradients(zip(grads, model.trainable_variables)))

    with strategy.scope():
        for _ in range(3):
            step()
    _assert_one_version_per_step(model, optimizer, 3)


def _threads_apply_a_plain_optimizer(model, optimizer, threads, calls, step):
    grads = [tf.ones_like(v) for v in model.trainable_variables]

    def worker(_):
        for _ in range(calls):
            step(grads)

    run_threads(threads, worker)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_threads_sharing_a_plain_optimizer_lose_no_update(graph):
    """SGD with momentum reads its slot and the weight and writes both; each thread's
    update must be one section, so K concurrent steps equal K steps in one thread."""
    threads, calls = 4, 12
    total = threads * calls
    with scope():
        model = make_model()
        optimizer = keras.optimizers.SGD(0.5, momentum=0.5)
    reference_model = make_model()
    reference = keras.optimizers.SGD(0.5, momentum=0.5)
    ones = [tf.ones_like(v) for v in reference_model.trainable_variables]
    for _ in range(total):
        reference.apply_gradients(zip(ones, reference_model.trainable_variables))

    def apply(grads):
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    optimizer.build(model.trainable_variables)  # Keras' build itself is not thread-safe

    _threads_apply_a_plain_optimizer(
        model, optimizer, threads, calls, tf.function(apply) if graph else apply
    )
    for got, want in zip(model.trainable_variables, reference_model.trainable_variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(model.trainable_variables) == [total] * len(model.trainable_variables)
    assert int(optimizer.iterations.numpy()) == total  # Keras' read-then-assign, atomic here


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
def test_keras_assign_add_and_assign_sub_are_atomic(graph):
    with scope():
        counter = keras.Variable(0.0)
        tally = keras.Variable(np.zeros(2, np.float32))

    def bump():
        counter.assign_add(1.0)
        tally.assign_sub([1.0, 2.0])

    call = tf.function(bump) if graph else bump
    run_threads(4, lambda _: [call() for _ in range(50)])
    assert float(counter.numpy()) == 200.0 and backing(counter).version == 200
    np.testing.assert_array_equal(tally.numpy(), [-200.0, -400.0])


def test_keras_assign_add_keeps_keras_arithmetic():
    with scope():
        count = keras.Variable(3, dtype="int32")
        vector = keras.Variable(np.ones(3, np.float32))
    assert int(count.assign_add(2.7).numpy()) == int(
        keras.Variable(3, dtype="int32").assign_add(2.7)
    )
    out = vector.assign_sub(1.0)  # a scalar broadcasts, as Keras' own self - value does
    np.testing.assert_array_equal(out.numpy(), [0.0, 0.0, 0.0])
    assert backing(count).version == 1 and backing(vector).version == 1
    plain = keras.Variable(np.ones(3, np.float32))
    with pytest.raises(Exception) as expected:
        plain.assign_add(np.ones(4, np.float32))
    with pytest.raises(type(expected.value)):  # what Keras' own self + value raises
        vector.assign_add(np.ones(4, np.float32))
    assert backing(vector).version == 1


# ---------------------------------------------------------------------- model snapshots


def test_snapshots_of_a_model_in_training_are_states_it_was_in():
    """fit with SafeOptimizer in one thread (one step is one section), 1,000+
    ``safevars.snapshot(model)`` in another: every trainable weight in a snapshot has the
    same version, the snapshot's values are the model's at that version, and a second
    model loaded from it predicts what the training model predicted then."""
    epochs, minimum = 4, 1000
    x, y = data()
    probe = x[:8]
    with scope():
        model = make_model(units=8)
        optimizer = safevars.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    trainable = len(model.trainable_variables)
    at_version: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
    want, got = threading.Event(), threading.Event()
    done, reader_done = threading.Event(), threading.Event()

    def record() -> int:
        snaps = safevars.snapshot(model)
        (version,) = {s.version for s in snaps[:trainable]}
        at_version[version] = ([s.numpy() for s in snaps], model(probe).numpy())
        return version

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record()
            if batch % 4 == 0:  # make sure the reader sees this state too
                got.clear()
                want.set()
                while not got.wait(0.01):
                    assert not reader_done.is_set(), "the snapshot thread stopped"

    record()
    taken: list[tuple[int, list[np.ndarray]]] = []

    def role(i):
        if i == 0:
            try:
                model.fit(
                    x,
                    y,
                    batch_size=BATCH,
                    epochs=epochs,
                    shuffle=False,
                    verbose=0,
                    callbacks=[Record()],
                )
            finally:
                done.set()
            return
        try:
            while not done.is_set() or len(taken) < minimum:
                wanted = want.is_set()
                snaps = safevars.snapshot(model)
                found = {s.version for s in snaps[:trainable]}
                assert len(found) == 1, f"trainable weights at different versions: {found}"
                taken.append((found.pop(), [s.numpy() for s in snaps]))
                if wanted:
                    want.clear()
                    got.set()
        finally:
            reader_done.set()

    run_threads(2, role)
    seen = sorted({version for version, _ in taken})
    assert len(taken) >= minimum and len(seen) > epochs * STEPS_PER_EPOCH // 4
    for version, arrays in taken:
        expected, _ = at_version[version]
        for a, b in zip(arrays, expected):
            np.testing.assert_array_equal(a, b)
    serving = make_model(units=8)
    for version in seen:
        serving.set_weights(next(s for v, s in taken if v == version))
        np.testing.assert_allclose(serving(probe).numpy(), at_version[version][1], rtol=1e-6)
    final = max(at_version)
    assert versions(model.trainable_variables) == [final] * trainable
    assert len(at_version) == epochs * STEPS_PER_EPOCH + 1  # one new version per step


def test_snapshot_of_a_model_loads_into_another_model():
    with scope():
        model = make_model()
    model.layers[0].kernel.assign(tf.ones((3, 4)))
    snaps = safevars.snapshot(model)
    assert [s.version for s in snaps] == [1, 0, 0, 0]
    assert [s.name for s in snaps] == [backing(w).name for w in model.weights]
    other = make_model()
    other.set_weights(snaps)
    for a, b in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    nested = safevars.snapshot({"model": model, "layer": model.layers[1]})
    assert len(nested["model"]) == 4 and len(nested["layer"]) == 2


def test_locked_and_transaction_take_a_model():
    with scope():
        model = make_model()
    with safevars.locked(model):
        assert all(backing(w).statistics().locked for w in model.weights)
        model.layers[0].kernel.assign(tf.zeros((3, 4)))  # re-entrant: counted, not blocked
    assert not any(backing(w).statistics().locked for w in model.weights)
    before = [w.numpy() for w in model.weights]

    def scale_then_fail():
        for w in model.weights:
            w.assign(w * 2.0 + 1.0)
        raise KeyError("abort")

    with pytest.raises(KeyError, match="abort"):
        safevars.transaction(model, scale_then_fail)
    for w, b in zip(model.weights, before):  # rolled back, value and version
        np.testing.assert_array_equal(w.numpy(), b)
    assert versions(model.weights) == [1, 0, 0, 0]

    @tf.function
    def step():
        return safevars.transaction(
            model, lambda: [w.assign_add(tf.ones_like(w)) for w in model.weights]
        )

    step()
    assert versions(model.weights) == [2, 1, 1, 1]


def test_plain_and_keras_variables_are_wrapped_on_the_fly():
    plain = tf.Variable([1.0, 2.0])
    kv = keras.Variable(np.zeros(2, np.float32))
    snaps = safevars.snapshot({"plain": plain, "keras": kv})
    assert snaps["plain"].version == 0 and snaps["plain"].numpy().tolist() == [1.0, 2.0]
    safe = safevars.wrap(plain)
    safe.assign_add([1.0, 1.0])  # counted: made through the wrapped proxy
    assert safevars.snapshot([plain])[0].version == 1
    with safevars.locked(plain, kv):  # the lock wrap gives, shared by every wrap
        assert safe.statistics().locked and safevars.wrap(kv).statistics().locked
    safevars.transaction([plain], lambda: safe.assign([0.0, 0.0]))
    assert safe.version == 2


def test_unsupported_strategy_is_refused():
    strategy = tf.distribute.experimental.CentralStorageStrategy()
    with pytest.raises(safevars.UnsupportedStrategyError, match="CentralStorageStrategy"):
        with strategy.scope(), scope():
            pass
    with scope(), strategy.scope():
        with pytest.raises(safevars.UnsupportedStrategyError, match="CentralStorageStrategy"):
            tf.Variable(1.0)


def test_plain_optimizer_on_a_hand_made_mirrored_safe_variable(mirrored_strategy):
    """Without safevars.scope(): Keras' optimizer writes each replica's copy through
    strategy.extended.update; the update is still one locked section, counted once."""
    with mirrored_strategy.scope():
        v = safevars.SafeVariable([1.0, 2.0])
        optimizer = keras.optimizers.SGD(0.5, momentum=0.5)
        optimizer.build([v])

        @tf.function
        def step():
            mirrored_strategy.run(
                lambda: optimizer.apply_gradients([(tf.constant([1.0, 1.0]), v)])
            )

        for _ in range(3):
            step()
    (slot,) = [s for s in optimizer.variables if "momentum" in s.path]
    assert v.version == 3 and backing(slot).version == 3
    copies = [c.numpy() for c in v.values]
    np.testing.assert_array_equal(copies[0], copies[1])
