"""``tf.saved_model.save`` of functions that write safevars objects, and their loaded copies.

A traced write captures the lock's mutex (a ``tf.CriticalSection``'s, not trackable), the
lock's gate and the variable's version variable: exporting it failed with "references an
'untracked' resource" until they were exported with the variable
(``safevars/locking/saved_model.py``).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.locking import share_lock
from safevars.optimizer import SafeOptimizer
from tests.support.graphs import kept_with
from tests.support.threading_harness import run_threads

THREADS, CALLS = 4, 150


def _save_and_load(module: tf.Module, tmp_path) -> tf.Module:
    path = os.fspath(tmp_path / "saved")
    tf.saved_model.save(module, path)
    return tf.saved_model.load(path)


def _version_of(loaded_variable) -> int:
    """The loaded copy of a variable's version counter (the first resource exported)."""
    (handle, *_) = [r.resource_handle for r in loaded_variable.safevars.resources]
    return int(tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int64))


def test_a_function_that_writes_is_exported_and_loaded(tmp_path):
    module = tf.Module()
    module.v = safevars.SafeVariable([1.0, 2.0])

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
    def add(x):
        module.v.assign_add(x)
        return module.v.read_value()

    module.add = add
    add(tf.constant([1.0, 1.0]))
    loaded = _save_and_load(module, tmp_path)
    np.testing.assert_array_equal(loaded.v.numpy(), [2.0, 3.0])
    assert _version_of(loaded.v) == 1  # the version when saved
    np.testing.assert_array_equal(loaded.add(tf.constant([1.0, 1.0])), [3.0, 4.0])
    assert _version_of(loaded.v) == 2
    # The original is untouched by its loaded copy.
    np.testing.assert_array_equal(module.v.numpy(), [2.0, 3.0])
    assert module.v.version == 1


def test_a_function_traced_by_the_save_itself_is_exported(tmp_path):
    # Never called before the save: tracing it there switches the lock to run-time mode.
    module = tf.Module()
    module.a_variable = safevars.SafeVariable(1.0)
    module.z_add = tf.function(
        lambda x: module.a_variable.assign_add(x), input_signature=[tf.TensorSpec([])]
    )
    loaded = _save_and_load(module, tmp_path)
    assert float(loaded.z_add(tf.constant(2.0))) == 3.0


def test_loaded_read_modify_writes_still_exclude_each_other(tmp_path):
    module = tf.Module()
    module.v = safevars.SafeVariable(0.0)
    module.bump = tf.function(lambda: module.v.update(lambda x: x + 1.0), input_signature=[])
    module.bump()
    loaded = _save_and_load(module, tmp_path)

    def worker(_):
        for _ in range(CALLS):
            loaded.bump()

    run_threads(THREADS, worker)
    assert loaded.v.numpy() == 1.0 + THREADS * CALLS
    assert _version_of(loaded.v) == 1 + THREADS * CALLS


def test_a_transaction_over_variables_sharing_a_lock(tmp_path):
    module = tf.Module()
    module.a = safevars.SafeVariable(10.0)
    module.b = safevars.SafeVariable(0.0)
    assert share_lock([module.a.guard, module.b.guard])

    @tf.function(input_signature=[tf.TensorSpec([])])
    def move(amount):
        def body():
            module.a.assign_sub(amount)
            module.b.assign_add(amount)
            return module.a.read_value() + module.b.read_value()

        return safevars.transaction([module.a, module.b], body)

    module.move = move
    assert float(move(tf.constant(1.0))) == 10.0
    loaded = _save_and_load(module, tmp_path)
    assert float(loaded.move(tf.constant(2.0))) == 10.0
    assert (float(loaded.a.numpy()), float(loaded.b.numpy())) == (7.0, 3.0)


def _train_module(accumulate_steps: int):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    optimizer = SafeOptimizer(keras.optimizers.Adam(0.01), accumulate_steps=accumulate_steps)
    module = tf.Module()
    module.model, module.optimizer = model, optimizer

    @tf.function(input_signature=[tf.TensorSpec([8, 4]), tf.TensorSpec([8, 1])])
    def train(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    module.train = train
    return module


def test_safe_optimizer_steps_are_exported_with_their_bookkeeping(tmp_path):
    x = tf.random.stateless_normal([8, 4], seed=[1, 2])
    y = tf.random.stateless_normal([8, 1], seed=[3, 4])
    for accumulate_steps in (1, 2):
        module = _train_module(accumulate_steps)
        module.train(x, y)
        loaded = _save_and_load(module, tmp_path / str(accumulate_steps))
        # The loaded step continues from the saved state, as the original does; with
        # accumulate_steps=2 the first loaded call completes the pending accumulation.
        expected = [float(module.train(x, y)) for _ in range(3)]
        got = [float(loaded.train(x, y)) for _ in range(3)]
        assert got == expected, accumulate_steps
        if accumulate_steps == 2:
            assert expected[1] == expected[2] != expected[0]


def test_checkpoints_keep_their_layout():
    v = safevars.SafeVariable(1.0)
    kept_with(v, tf.function(lambda: v.assign_add(1.0)))()  # run-time mode: a mutex, a gate
    names = {name for name, _ in tf.train.Checkpoint(v=v)._checkpoint_dependencies}
    assert names == {"v"}
    children = v._trackable_children("checkpoint")
    assert set(children) == {"safevars_version"} | set(
        v.__wrapped__._trackable_children("checkpoint")
    )


def test_a_replica_step_under_mirrored_strategy(mirrored_strategy, tmp_path):
    with mirrored_strategy.scope():
        v = safevars.SafeVariable(1.0, aggregation=tf.VariableAggregation.MEAN)
    module = tf.Module()
    module.v = v

    @tf.function(input_signature=[])
    def step():
        mirrored_strategy.run(lambda: module.v.assign_add(1.0))
        return module.v.read_value()

    module.step = step
    assert float(step()) == 2.0
    loaded = _save_and_load(module, tmp_path)
    assert float(loaded.step()) == 3.0
    assert float(loaded.v.numpy()) == 3.0


def test_keras_export_of_a_model_with_safe_weights_trained_by_safe_optimizer(tmp_path):
    with safevars.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    assert isinstance(model.layers[0].kernel.value, safevars.SafeVariable)
    model.compile(optimizer=SafeOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x = np.random.default_rng(0).random((16, 4), np.float32)
    model.fit(x, x[:, :1], epochs=1, verbose=0)  # traced writes: locks in run-time mode
    model.export(os.fspath(tmp_path / "exported"), verbose=False)
    loaded = tf.saved_model.load(os.fspath(tmp_path / "exported"))
    np.testing.assert_allclose(loaded.serve(x), model.predict(x, verbose=0), atol=1e-6)


# ------------------------------------------------- Keras layers in the scope whose call writes


class _Counter(keras.layers.Layer):
    """Counts its calls in a non-trainable weight (Keras' own export tests use one)."""

    def build(self, input_shape):
        self.count = self.add_weight(shape=(), initializer="zeros", dtype="int32", trainable=False)

    def call(self, x):
        self.count.assign_add(1)  # in the scope: one locked update of a SafeVariable
        return x


def _counting_model() -> keras.Model:
    with safevars.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), _Counter()])
    assert isinstance(model.layers[-1].count.value, safevars.SafeVariable)
    return model


def _calls_exclude_each_other(call, count) -> None:
    """``call()`` from several threads: each call's read-modify-write of ``count()``
    takes the loaded lock, so none is lost."""
    start = count()

    def worker(_):
        for _ in range(CALLS):
            call()

    run_threads(THREADS, worker)
    assert count() == start + THREADS * CALLS


def test_a_keras_layer_whose_call_writes_its_state_is_exported(tmp_path):
    """tf.saved_model.save finds a layer's weights through the keras.Variable, not the
    SafeVariable it holds: the mutex its traced write captures was untracked until the
    Keras variable named it (creator_scope/keras_variables.py)."""
    model = _counting_model()
    module = tf.Module()
    module.model, module.count = model, model.layers[-1].count
    module.call = tf.function(lambda x: model(x), input_signature=[tf.TensorSpec([None, 3])])
    x = tf.ones([2, 3])
    module.call(x)
    loaded = _save_and_load(module, tmp_path)
    counter = loaded.count
    assert int(counter.numpy()) == 1  # the value when saved
    np.testing.assert_allclose(loaded.call(x), model(x), atol=1e-6)
    assert int(counter.numpy()) == 2
    _calls_exclude_each_other(lambda: loaded.call(x), lambda: int(counter.numpy()))
    assert int(model.layers[-1].count.numpy()) == 2  # the original: its own two calls


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
def test_an_export_archive_endpoint_that_writes(tmp_path, tracked):
    """Keras' ExportArchive tracks the variables its endpoints used: the plain variables
    the SafeVariables wrap. Without track(model) nothing else reaches what the endpoint's
    write captures (safevars.locking.saved_model.tracks_guarded_state); with it, the
    Keras variables name it too."""
    model = _counting_model()
    archive = keras.export.ExportArchive()
    if tracked:
        archive.track(model)
    archive.add_endpoint("serve", model.__call__, input_signature=[tf.TensorSpec([None, 3])])
    archive.write_out(os.fspath(tmp_path / "exported"), verbose=False)
    loaded = tf.saved_model.load(os.fspath(tmp_path / "exported"))
    x = tf.ones([2, 3])
    np.testing.assert_allclose(loaded.serve(x), model(x), atol=1e-6)
    # The counter: the endpoint's last variable (Keras' loaded archive writes the copy
    # of the Keras variable when the model was tracked, else that of the tf.Variable).
    count = (loaded.variables if tracked else loaded._all_variables)[-1]
    assert count.dtype == tf.int32
    _calls_exclude_each_other(lambda: loaded.serve(x), lambda: int(count.numpy()))


def test_an_export_archive_endpoint_that_writes_a_safe_variable(tmp_path):
    """The same for a SafeVariable made by hand that an endpoint writes."""
    v = safevars.SafeVariable(0.0)
    archive = keras.export.ExportArchive()
    archive.add_endpoint("bump", lambda: v.update(lambda x: x + 1.0), input_signature=[])
    archive.write_out(os.fspath(tmp_path / "exported"), verbose=False)
    loaded = tf.saved_model.load(os.fspath(tmp_path / "exported"))
    (copy,) = loaded._all_variables
    _calls_exclude_each_other(loaded.bump, lambda: float(copy.numpy()))
    assert v.version == 0 and float(v.numpy()) == 0.0  # the loaded copy is its own


# ---------------------------------------------------------------------- loading in a scope


def _plain_module() -> tf.Module:
    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])
    module.scale = tf.function(
        lambda x: module.v * x, input_signature=[tf.TensorSpec([], tf.float32)]
    )
    return module


@pytest.mark.parametrize("saved_with", ["plain", "safevars"])
def test_a_saved_model_loads_inside_the_scope(tmp_path, saved_with):
    """Inside safevars.scope() the loader's variables are SafeVariables, whose
    checkpoint children include a version variable that no SavedModel holds: loading
    failed with "Found 1 Python objects that were not bound to checkpointed values"."""
    if saved_with == "plain":
        module = _plain_module()
    else:
        with safevars.scope():
            module = _plain_module()
        module.v.assign_add([1.0, 1.0])  # version 1, value [2, 3]
    path = os.fspath(tmp_path / "saved")
    tf.saved_model.save(module, path)
    with safevars.scope():
        loaded = tf.saved_model.load(path)
    assert isinstance(loaded.v, safevars.SafeVariable)
    assert loaded.v.version == 0  # a SavedModel holds no version for it: a new variable's
    expected = module.v.numpy()
    np.testing.assert_array_equal(loaded.scale(tf.constant(2.0)), 2.0 * expected)
    loaded.v.assign_add([1.0, 1.0])  # writes through the loaded variable: locked, counted
    assert loaded.v.version == 1
    # Checkpoints of the loaded variable carry its version again (only the loader's own
    # restore leaves it out).
    ckpt = tf.train.Checkpoint(v=loaded.v).write(os.fspath(tmp_path / "ckpt"))
    loaded.v.assign([0.0, 0.0])
    tf.train.Checkpoint(v=loaded.v).read(ckpt).assert_consumed()
    assert loaded.v.version == 1
    np.testing.assert_array_equal(loaded.v.numpy(), expected + 1.0)


def test_keras_tfsm_layer_after_export_inside_the_scope(tmp_path):
    """Keras' TFSMLayer loads an exported model with tf.saved_model.load: inside the
    scope it failed as above; now its weights are SafeVariable-backed."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    path = os.fspath(tmp_path / "exported")
    model.export(path, verbose=False)
    with safevars.scope():
        layer = keras.layers.TFSMLayer(path, call_endpoint="serve")
    assert len(layer.weights) == 4
    assert all(isinstance(w.value, safevars.SafeVariable) for w in layer.weights)
    x = np.random.default_rng(0).random((5, 4), np.float32)
    np.testing.assert_allclose(layer(x), model.predict(x, verbose=0), atol=1e-6)
