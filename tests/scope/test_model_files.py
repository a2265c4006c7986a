"""Saved protected, loaded protected; copies and clones protected, each with its own lock.

A ``.keras`` file of a protected model carries a ``"safevars"`` entry in its metadata and
loads protected wherever it is loaded (before, outside the scope its weights came back
plain while its optimizer came back a SafeOptimizer); a file of a plain model loads
plain, optimizer included. ``copy.deepcopy``, ``pickle`` and ``keras.models.clone_model``
of a protected model give a protected model with a lock of its own. A checkpoint
restores values and versions into the model you protect.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import zipfile

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars._tf_internal import keras_model_files
from safevars.creator_scope import scope
from tests.scope.test_protect import data, locks_of, make_model, owned, versions

BATCH = 8


def protected_model(optimizer: str = "safe") -> keras.Model:
    """Built in the scope, compiled, trained 4 steps."""
    with scope():
        model = make_model()
        adam = keras.optimizers.Adam(1e-2)
        opt = safevars.SafeOptimizer(adam) if optimizer == "safe" else adam
        model.compile(optimizer=opt, loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def assert_same_state(a: keras.Model, b: keras.Model) -> None:
    for got, want in zip(
        [*a.weights, *a.optimizer.variables], [*b.weights, *b.optimizer.variables]
    ):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def assert_protected_apart(copied: keras.Model, original: keras.Model) -> None:
    """Protected, under one lock that is not the original's."""
    assert safevars.is_protected(copied)
    (lock,) = locks_of(copied)
    assert lock not in locks_of(original)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_keras_file_of_a_protected_model_loads_protected(tmp_path, where):
    model = protected_model()
    path = os.fspath(tmp_path / "model.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        assert json.loads(archive.read("metadata.json"))["safevars"] == {"protected": True}
    if where == "outside":
        loaded = keras.models.load_model(path)
        assert_protected_apart(loaded, model)
    else:
        with scope():
            marker = tf.Variable(0.0)  # made in the block: its lock is the block's
            loaded = keras.models.load_model(path)
        assert locks_of(loaded) == {safevars.wrap(marker).guard.lock}
    assert isinstance(loaded.optimizer, safevars.SafeOptimizer)
    assert_same_state(loaded, model)
    assert set(versions(loaded.weights)) == {1}  # the load is one write; files hold no versions
    x, y = data()
    for m in (model, loaded):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same_state(loaded, model)
    assert versions(loaded.trainable_variables) == [5] * 4


def test_a_keras_file_of_a_plain_model_loads_plain_optimizer_included(tmp_path):
    model = make_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    x, y = data()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    path = os.fspath(tmp_path / "plain.keras")
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        assert "safevars" not in json.loads(archive.read("metadata.json"))
    loaded = keras.models.load_model(path)
    assert len(safevars.unprotected_variables(loaded)) == len(owned(loaded))
    assert not isinstance(loaded.optimizer, safevars.SafeOptimizer)


def test_plain_keras_reads_the_marked_file(tmp_path):
    """The metadata entry is ignored by Keras' own loader (unpatched here)."""
    path = os.fspath(tmp_path / "model.keras")
    protected_model("plain").save(path)
    load = keras_model_files()._load_model_from_fileobj.__wrapped__
    with open(path, "rb") as f:
        loaded = load(f, None, True, True)
    assert len(loaded.weights) == 4 and not safevars.is_protected(loaded)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "clone_model"])
def test_copies_of_a_protected_model_are_protected_with_their_own_lock(how):
    model = protected_model()
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(model))
    else:
        copied = keras.models.clone_model(model)
    assert_protected_apart(copied, model)
    if how == "clone_model":  # fresh values, the same architecture
        assert [w.shape for w in copied.weights] == [w.shape for w in model.weights]
        assert set(versions(copied.weights)) == {0}
        return
    assert_same_state(copied, model)
    copied.layers[0].kernel.assign(tf.zeros((3, 4)))  # independent of the original
    assert float(tf.reduce_sum(tf.abs(model.layers[0].kernel))) > 0


def test_a_copy_of_a_plain_model_stays_plain():
    model = make_model()
    assert not safevars.is_protected(copy.deepcopy(model))
    assert not safevars.is_protected(keras.models.clone_model(model))


def test_a_checkpoint_restores_values_and_versions_into_the_model_you_protect(tmp_path):
    model = protected_model("plain")
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
        os.fspath(tmp_path / "ck")
    )
    fresh = make_model()
    fresh.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    safevars.protect(fresh)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(path).assert_consumed()
    assert_same_state(fresh, model)
    assert versions(fresh.trainable_variables) == versions(model.trainable_variables) == [4] * 4
    assert_protected_apart(fresh, model)


def test_a_saved_model_in_a_keras_model_is_protected_by_protect(tmp_path):
    """A SavedModel (model.export) used through TFSMLayer: its variables, loaded plain,
    are protected with the Keras model around them, and steps over them count."""
    path = os.fspath(tmp_path / "exported")
    make_model().export(path, verbose=False)
    layer = keras.layers.TFSMLayer(path, call_endpoint="serve", trainable=True)
    wrapper = keras.Sequential([keras.Input((3,)), layer])
    assert not safevars.is_protected(wrapper)
    safevars.protect(wrapper)
    assert safevars.is_protected(wrapper) and len(locks_of(wrapper)) == 1
    wrapper.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(BATCH)
    wrapper.fit(x, y, batch_size=BATCH, verbose=0)
    assert versions(wrapper.trainable_variables) == [1] * 4
