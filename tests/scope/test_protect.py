"""safevars.protect(model): the model you already have, protected in place; and the check.

A model built outside ``safevars.scope()`` (or loaded, or fitted already) is turned into
what the scope would have built: every variable it owns backed by a SafeVariable under
one lock, values and optimizer state untouched (training continues bitwise), Keras'
traced functions traced again, one lock per step, and the variables Keras creates later
protected too. ``is_protected`` / ``unprotected_variables`` say where protection is
missing, and the scope no longer leaves a model half protected.
"""

from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.creator_scope import scope
from tests.scope.test_one_lock_per_step import all_ops, train_graph
from tests.support.threading_harness import run_threads

BATCH = 8


def make_model(seed: int = 0) -> keras.Model:
    """A small seeded MLP: the same weights whenever it is made."""
    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, activation="tanh", kernel_initializer=init(seed=seed + 1)),
            keras.layers.Dense(1, kernel_initializer=init(seed=seed + 2)),
        ]
    )


class Lazy(keras.Model):
    """A subclassed model without ``build``: Keras creates its weights at its first call."""

    def __init__(self) -> None:
        super().__init__()
        init = keras.initializers.GlorotUniform
        self.hidden = keras.layers.Dense(4, activation="tanh", kernel_initializer=init(seed=1))
        self.out = keras.layers.Dense(1, kernel_initializer=init(seed=2))

    def call(self, x):
        return self.out(self.hidden(x))


def data(samples: int = 32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 3)).astype(np.float32)
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def owned(model: keras.Model) -> list:
    """Every variable the model owns: weights, metrics', optimizer's."""
    found = list(model.variables) + list(model.metrics_variables)
    if getattr(model, "optimizer", None) is not None:
        found += list(model.optimizer.variables)
    return list({id(v): v for v in found}.values())


def locks_of(model: keras.Model) -> set:
    """The locks of the model's variables; fails on a plain one."""
    locks = set()
    for v in owned(model):
        assert isinstance(v.value, safevars.SafeVariable), f"{v.path} is plain"
        locks.add(v.value.guard.lock)
    return locks


def versions(variables) -> list[int]:
    return [v.value.version for v in variables]


def compiled(model: keras.Model, optimizer=None) -> keras.Model:
    model.compile(optimizer=optimizer or keras.optimizers.Adam(1e-2), loss="mse")
    return model


# ---------------------------------------------------------------------- protect()


def test_protecting_a_fitted_model_continues_training_bitwise_under_one_lock():
    x, y = data()
    plain, protected = compiled(make_model()), compiled(make_model())
    for model in (plain, protected):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # traced
    assert not safevars.is_protected(protected)

    assert safevars.protect(protected) is protected
    assert protected.train_function is None  # traced again at its next use
    assert safevars.is_protected(protected) and not safevars.unprotected_variables(protected)
    assert len(locks_of(protected)) == 1
    for model in (plain, protected):
        model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)  # 8 steps
    for got, want in zip(owned(protected), owned(plain)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(protected.trainable_variables) == [8] * 4  # counted since protect()
    assert int(protected.optimizer.iterations.numpy()) == 12
    safevars.protect(protected)  # again: nothing changes
    assert versions(protected.trainable_variables) == [8] * 4


@pytest.mark.parametrize("kind", ["safe", "plain"])
def test_a_protected_model_trains_with_one_lock_per_step(kind):
    """Its traced fit step holds one MutexLock, as a model built in the scope."""
    opt = keras.optimizers.Adam(1e-2)
    model = compiled(make_model(), safevars.SafeOptimizer(opt) if kind == "safe" else opt)
    x, y = data(BATCH)
    model.train_on_batch(x, y)  # traced over plain variables
    safevars.protect(model)
    ops = [op.type for op in all_ops(train_graph(model, lambda: model.train_on_batch(x, y)))]
    assert ops.count("MutexLock") == ops.count("ConsumeMutexLock") == 1


def test_a_protected_models_step_counts_versions_as_the_same_model_made_in_the_scope():
    """A Keras optimizer built before ``protect`` made its slots (Adam's moments) plain:
    ``protect`` finds them, so a step counts weights and slots with one joint add, as in
    the scope (it added one more version per slot: 200 ops a step for 100 weights)."""
    x, y = data(BATCH)
    protected = compiled(make_model())
    protected.train_on_batch(x, y)  # the optimizer built, its slots plain
    safevars.protect(protected)
    with scope():
        in_scope = compiled(make_model())
    adds = []
    for model in (protected, in_scope):
        graph = train_graph(model, lambda model=model: model.train_on_batch(x, y))
        adds.append([op.type for op in all_ops(graph)].count("AssignAddVariableOp"))
    assert adds[0] == adds[1], adds
    adam = protected.optimizer
    for weight, m, v in zip(protected.trainable_variables, adam._momentums, adam._velocities):
        joint = weight.value.guard.joint
        assert joint is not None and m.value.guard.joint is joint is v.value.guard.joint


def test_threads_training_a_protected_model_equal_the_same_steps_in_one_thread():
    """4 threads x 4 train_on_batch on a model protected after its first fit: bitwise the
    weights of the same 16 steps in one thread, versions and iterations exact, and every
    snapshot a reader takes meanwhile has all trainable weights at one version."""
    threads, calls = 4, 4
    x, y = data(BATCH)
    reference, model = compiled(make_model()), compiled(make_model())
    for m in (reference, model):
        m.train_on_batch(x, y)
    safevars.protect(model)
    for _ in range(threads * calls):
        reference.train_on_batch(x, y)
    model.train_on_batch(x, y)  # traces the protected step before the threads
    trainable = len(model.trainable_variables)
    torn = []

    def role(i):
        if i < threads:
            for _ in range(calls - (1 if i == 0 else 0)):
                model.train_on_batch(x, y)
            return
        for _ in range(50):
            found = {s.version for s in safevars.snapshot(model)[:trainable]}
            if len(found) != 1:
                torn.append(found)

    run_threads(threads + 1, role)
    assert not torn
    state = [*model.weights, *model.optimizer.variables]  # (metrics are reset per call)
    for got, want in zip(state, [*reference.weights, *reference.optimizer.variables]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(model.trainable_variables) == [threads * calls] * trainable
    assert int(model.optimizer.iterations.numpy()) == threads * calls + 1


def test_an_unbuilt_subclassed_model_is_protected_when_keras_builds_it():
    model = Lazy()
    assert not safevars.is_protected(model)  # no weights yet, and none will be safe
    safevars.protect(model)
    assert safevars.is_protected(model)
    x, y = data()
    compiled(model).fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # builds it here
    assert len(locks_of(model)) == 1 and len(model.weights) == 4
    assert versions(model.trainable_variables) == [4] * 4


def test_protect_takes_an_optimizer_variables_and_lists():
    v = tf.Variable(1.0)
    w = keras.Variable(np.zeros(2, np.float32))
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build([w])
    out = safevars.protect([v, w, opt])
    assert isinstance(out[0], safevars.SafeVariable) and out[0].__wrapped__ is v
    assert out[1] is w and out[2] is opt  # Keras objects are protected in place
    locks = {out[0].guard.lock, w.value.guard.lock} | {u.value.guard.lock for u in opt.variables}
    assert len(locks) == 1 and safevars.is_protected(opt) and safevars.is_protected(w)
    opt.apply([tf.ones(2)], [w])  # the optimizer's step over the protected weight
    assert w.value.version == 1


def test_protect_keeps_the_versions_of_variables_wrapped_before():
    """A SafeOptimizer over a plain model wraps the weights on the fly, and counts their
    versions: protect() keeps those versions and joins their lock."""
    x, y = data(BATCH)
    model = compiled(make_model(), safevars.SafeOptimizer(keras.optimizers.SGD(0.1)))
    model.train_on_batch(x, y)
    model.train_on_batch(x, y)
    assert [safevars.wrap(w).version for w in model.trainable_variables] == [2] * 4
    safevars.protect(model)
    assert versions(model.trainable_variables) == [2] * 4 and len(locks_of(model)) == 1
    model.train_on_batch(x, y)
    assert versions(model.trainable_variables) == [3] * 4


def test_bad_input_to_protect_changes_nothing():
    model = make_model()
    with pytest.raises(safevars.InvalidArgumentError, match=r"structure\[1\] is str"):
        safevars.protect([model, "kernel"])
    assert safevars.unprotected_variables(model)  # the model stayed plain
    assert not safevars.is_protected(model)

    @tf.function
    def inside():
        safevars.protect(model)
        return 0

    with pytest.raises(safevars.InvalidArgumentError, match="outside tf.function"):
        inside()
    assert len(safevars.unprotected_variables(model)) == 4


def test_protect_while_a_lock_is_held_raises_and_changes_nothing():
    model = make_model()
    with safevars.locked(model.weights):  # wrapped on the fly, each its own lock, held
        with pytest.raises(safevars.LockReentryError, match="Nothing was changed"):
            safevars.protect(model)
    assert len(safevars.unprotected_variables(model)) == 4


def test_protecting_after_a_plain_custom_step_was_traced_warns():
    model = make_model()
    opt = keras.optimizers.SGD(0.1)
    x, y = (tf.constant(a) for a in data(BATCH))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(
            zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        )

    step()
    with pytest.warns(UserWarning, match="Trace it again"):
        safevars.protect([model, opt])


def test_protect_under_a_mirrored_strategy(mirrored_strategy):
    x, y = data()
    with mirrored_strategy.scope():
        plain, model = compiled(make_model()), compiled(make_model())
    for m in (plain, model):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    with mirrored_strategy.scope():
        safevars.protect(model)
    for m in (plain, model):
        m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert len(locks_of(model)) == 1
    assert versions(model.trainable_variables) == [4] * 4
    for got, want in zip(model.weights, plain.weights):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)


# ---------------------------------------------------------------------- the check


def test_unprotected_variables_names_each_with_where_it_was_created():
    model = make_model()
    gaps = safevars.unprotected_variables(model)
    assert [g.path for g in gaps] == [w.path for w in model.weights]
    assert all(g.created_at.startswith(f"{__file__}:") for g in gaps)
    assert all("in make_model" in g.created_at for g in gaps)
    assert safevars.is_protected(safevars.SafeVariable(1.0))
    assert not safevars.is_protected(tf.Variable(1.0))
    with scope():
        assert safevars.is_protected(Lazy())  # unbuilt, but made in a block


@pytest.mark.parametrize("call", ["snapshot", "locked", "transaction"])
def test_snapshot_locked_and_transaction_refuse_an_unprotected_model(call):
    model = make_model()
    x, y = data(BATCH)
    before = [w.numpy() for w in model.weights]
    with pytest.raises(safevars.NotProtectedError) as raised:
        if call == "snapshot":
            safevars.snapshot(model)
        elif call == "locked":
            with safevars.locked(model):
                pass
        else:
            safevars.transaction(model, lambda: [w.assign(w * 0) for w in model.weights])
    message = str(raised.value)
    assert "4 of its 4 weights" in message and "safevars.protect(model)" in message
    assert re.search(r"sequential\w*/dense\w*/kernel \(created at ", message)
    assert f"{__file__}:" in message and "in make_model" in message
    assert not safevars.held_locks()
    for got, want in zip(model.weights, before):
        np.testing.assert_array_equal(got.numpy(), want)
    assert len(safevars.snapshot(model.weights)) == 4  # variables passed explicitly: wrapped
    del x, y


# ---------------------------------------------------------------------- the scope's gaps


def test_a_model_built_outside_and_trained_inside_the_scope_is_protected():
    """Built and compiled outside, fit inside a block: before, the optimizer's slots
    were safe and the weights plain."""
    x, y = data()
    model = compiled(make_model())
    with scope():
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert len(locks_of(model)) == 1
    assert versions(model.trainable_variables) == [4] * 4


@pytest.mark.parametrize("how", ["build", "call", "fit"])
def test_a_subclassed_model_made_in_the_scope_keeps_protection_when_built_outside(how):
    """Made in the block, built after it: by model.build (which, without a build()
    method, creates no weights and warns), by a first call, or by fit."""
    x, y = data()
    with scope():
        model = Lazy()
        if how == "build":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # Keras' "unbuilt state"
                model.build((None, 3))
        compiled(model)
    if how == "call":
        model(x[:1])
        assert len(locks_of(model)) == 1  # built by the call, outside the block
    model.fit(x, y, batch_size=BATCH, epochs=25, verbose=0)  # 100 steps
    assert len(locks_of(model)) == 1
    assert [s.version for s in safevars.snapshot(model)] == [100] * 4
