"""A model built in safevars.scope() trains with one lock per step, whatever its size.

Every variable made in one ``scope()`` block shares one lock, and every training step
over them (a :class:`~safevars.SafeOptimizer` step, and a plain Keras optimizer's step
too) is one critical section: its traced form holds one ``MutexLock`` and a constant
number of version adds however many variables the model has (the work safevars adds does
not grow with the model), and steps run by several threads at once are serializable:
the result is bitwise that of the same steps run one after another, every weight's
version counts every step.
"""

from __future__ import annotations

import collections
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.creator_scope import scope
from tests.support.threading_harness import JOIN_TIMEOUT, run_threads

BATCH = 16


def make_model(layers: int) -> keras.Model:
    """``layers`` Dense(4) layers (2 variables each), seeded: alike whenever built."""
    return keras.Sequential(
        [keras.Input((4,))]
        + [
            keras.layers.Dense(
                4, activation="tanh", kernel_initializer=keras.initializers.GlorotUniform(seed=i)
            )
            for i in range(layers)
        ]
    )


class Scales(keras.layers.Layer):
    """``count`` scalar weights, each scaling its input: many variables, few ops."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.scales = [self.add_weight(shape=(), initializer="ones") for _ in range(count)]

    def call(self, x):
        return x * tf.add_n([tf.convert_to_tensor(s) for s in self.scales])


def many_variables_model(variables: int) -> keras.Model:
    """A Dense(4) layer (2 variables) and ``variables - 2`` scalar scales."""
    stack = [keras.Input((4,)), keras.layers.Dense(4, activation="tanh")]
    if variables > 2:
        stack.append(Scales(variables - 2))
    return keras.Sequential(stack)


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    return x, np.tanh(x[:, ::-1]).astype(np.float32)


def optimizer(kind: str) -> keras.optimizers.Optimizer:
    adam = keras.optimizers.Adam(1e-2)
    return safevars.SafeOptimizer(adam) if kind == "safe" else adam


def versions(variables) -> list[int]:
    return [safevars.wrap(v).version for v in variables]


def custom_step(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def all_ops(graph) -> list[tf.Operation]:
    """The ops of ``graph`` and of every function it calls (nested bodies included)."""
    ops, seen, pending = [], set(), [graph]
    while pending:
        current = pending.pop()
        for op in current.get_operations():
            ops.append(op)
            for attr in ("f", "then_branch", "else_branch", "body", "cond"):
                try:
                    name = op.get_attr(attr).name
                except (ValueError, TypeError, AttributeError):
                    continue
                function = graph._get_function(name)  # noqa: SLF001 (test introspection)
                if name not in seen and function is not None:
                    seen.add(name)
                    pending.append(function.graph)
    return ops


def traced_step_ops(how: str, kind: str, variables: int) -> collections.Counter:
    """The op types of one traced training step of a model of ``variables`` variables
    built in the scope (``how``: a custom ``tf.function`` step, or ``model.fit``'s)."""
    with scope():
        model = many_variables_model(variables)
        opt = optimizer(kind) if how != "fit_compiled_outside" else None
        if how.startswith("fit") and opt is not None:
            model.compile(optimizer=opt, loss="mse", jit_compile=False)
    if how == "fit_compiled_outside":
        model.compile(optimizer=optimizer(kind), loss="mse", jit_compile=False)
    x, y = batch()
    if how == "custom":
        step = custom_step(model, opt)
        step(x, y)
        graph = step.get_concrete_function(x, y).graph
    else:
        graph = train_graph(model, lambda: model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0))
    return collections.Counter(op.type for op in all_ops(graph))


def train_graph(model, train):
    """The graph of ``model``'s train step as ``train()`` traces it (the last trace: fit
    traces again with a relaxed input shape)."""
    graphs = []
    train_step = model.train_step

    def recording(data):
        graphs.append(tf.compat.v1.get_default_graph())
        return train_step(data)

    model.train_step = recording
    train()
    return graphs[-1]


SAFEVARS_OPS = ("MutexLock", "ConsumeMutexLock", "AssignAddVariableOp")
# The larger model's variables: anything safevars added per variable would show as 14
# more ops (tracing a step costs about a second per variable on a busy 2-core machine).
LARGE = 16


@pytest.mark.parametrize("kind", ["safe", "plain"])
@pytest.mark.parametrize("how", ["custom", "fit", "fit_compiled_outside"])
def test_a_traced_step_takes_one_lock_whatever_the_model_size(how, kind):
    """The lock ops and version adds of a step at 2 variables and at LARGE are the same:
    one MutexLock and one release for the whole step (``fit``'s includes the loss
    tracker's update, a metric made in the scope when the model is compiled there), and
    besides Adam's own ``AssignAdd`` s (two moments per variable) the same number of
    version adds at both sizes."""
    small, large = (traced_step_ops(how, kind, variables) for variables in (2, LARGE))
    assert small["MutexLock"] == large["MutexLock"] == 1
    assert small["ConsumeMutexLock"] == large["ConsumeMutexLock"] == 1
    # Adam adds to its two moments of each variable (AssignAddVariableOp) and to
    # iterations; everything above that is safevars' and must not depend on the size.
    assert small["AssignAddVariableOp"] - 2 * 2 == large["AssignAddVariableOp"] - 2 * LARGE


@pytest.mark.parametrize("kind", ["safe", "plain"])
def test_threads_training_a_scope_model_equal_the_same_steps_in_one_thread(kind):
    """4 threads x 6 steps of a traced step on one batch: bitwise the weights of 24 steps
    in one thread (each step, forward pass to last write, is one section, so the steps
    are serializable, and here every order gives one result), and every weight's and
    slot's version is 24."""
    threads, calls = 4, 6
    x, y = batch()
    with scope():
        model = make_model(3)
        opt = optimizer(kind)
    reference_model = make_model(3)
    reference = keras.optimizers.Adam(1e-2)
    reference_step = custom_step(reference_model, reference)
    for _ in range(threads * calls):
        reference_step(x, y)
    step = custom_step(model, opt)
    step.get_concrete_function(x, y)  # traced once, before the threads

    run_threads(threads, lambda _: [step(x, y) for _ in range(calls)])
    for got, want in zip(model.weights, reference_model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(model.trainable_variables) == [threads * calls] * len(model.weights)
    assert int(opt.iterations.numpy()) == threads * calls


@pytest.mark.parametrize("kind", ["safe", "plain"])
@pytest.mark.parametrize("compiled", ["inside", "outside"])
def test_threads_running_fit_steps_equal_the_same_steps_in_one_thread(kind, compiled):
    """4 threads x 4 ``train_on_batch`` calls (``fit``'s traced step) on one batch:
    bitwise the weights of 16 calls in one thread, versions and ``iterations`` 16."""
    threads, calls = 4, 4
    x, y = batch()
    with scope():
        model = make_model(3)
        if compiled == "inside":
            model.compile(optimizer=optimizer(kind), loss="mse", jit_compile=False)
    if compiled == "outside":
        model.compile(optimizer=optimizer(kind), loss="mse", jit_compile=False)
    reference_model = make_model(3)
    reference_model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    for _ in range(threads * calls + 1):
        reference_model.train_on_batch(x, y)
    model.train_on_batch(x, y)  # builds the optimizer and the train function first

    run_threads(threads, lambda _: [model.train_on_batch(x, y) for _ in range(calls)])
    total = threads * calls + 1
    for got, want in zip(model.weights, reference_model.weights):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert versions(model.trainable_variables) == [total] * len(model.trainable_variables)
    assert int(model.optimizer.iterations.numpy()) == total


@pytest.mark.parametrize("metrics", [[], ["mae"]], ids=["loss", "loss and mae"])
def test_a_reader_never_sees_the_metrics_half_reset(monkeypatch, metrics):
    """``train_on_batch`` resets the metrics before every step: under their lock at
    once. A thread snapshotting the metric variables while the reset is about to write
    the last of them sees every one reset (it waited for the whole reset), never some
    reset and some not (the reset of one variable after another, each under the lock
    by itself)."""
    from keras.src.backend.tensorflow import core

    with scope():
        model = make_model(2)
        model.compile(optimizer="adam", loss="mse", metrics=metrics, jit_compile=False)
    x, y = batch()
    model.train_on_batch(x, y)  # (the lock is now in run-time mode: the common case)
    variables = model.metrics_variables
    safe = [safevars.wrap(v) for v in variables]
    assert len({v.guard.lock for v in safe}) == 1
    assert all(float(v.numpy()) != 0.0 for v in variables)  # (the step's loss and count)
    seen: list[list[float]] = []
    reader = threading.Thread(
        target=lambda: seen.append([float(s.value) for s in safevars.snapshot(safe)]),
        daemon=True,  # (if it hangs, the failed assertion below says so; pytest exits)
    )
    original = core.Variable._direct_assign

    def direct_assign(self, value):
        if self is variables[-1] and not reader.is_alive() and not seen:
            reader.start()
            reader.join(0.5)  # (it has read by now, unless it waits for the locks)
        return original(self, value)

    monkeypatch.setattr(core.Variable, "_direct_assign", direct_assign)
    model.reset_metrics()
    reader.join(JOIN_TIMEOUT)
    assert not reader.is_alive()
    assert seen == [[0.0] * len(variables)]


def test_variables_of_one_scope_share_one_lock():
    with scope():
        model = make_model(2)
        model.compile(optimizer="adam", loss="mse", metrics=["mae"], jit_compile=False)
    with scope():
        other = make_model(1)
    model.fit(*batch(), verbose=0)
    tracker = [v for m in model.metrics if m.name == "loss" for v in m.variables]
    made_inside = model.weights + model.optimizer.variables + tracker
    locks = {safevars.wrap(v).guard.lock for v in made_inside}
    assert tracker and len(locks) == 1
    assert {safevars.wrap(v).guard.lock for v in other.weights}.isdisjoint(locks)


def test_slots_of_an_optimizer_made_outside_join_the_weights_lock():
    with scope():
        model = make_model(2)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    (lock,) = {safevars.wrap(v).guard.lock for v in model.weights}
    slots = [v for v in opt.variables if "momentum" in v.path]
    assert slots and {safevars.wrap(v).guard.lock for v in slots} == {lock}
