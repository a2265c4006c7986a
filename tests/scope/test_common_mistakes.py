"""Common mistakes a new user makes, each working with the guarantees (issue 36).

* A SafeVariable passed as an *argument* of a ``tf.function`` (not captured): locked and
  counted inside, as when captured, used by the function or not, also after a
  SafeVariable was created while tracing.
* An optimizer made safe after ``fit`` traced its plain step: the next ``fit`` traces the
  step again (the SafeOptimizer's step runs and counts), and the call warns about
  functions the user traced.
* ``keras.backend.clear_session()`` inside ``safevars.scope()``: the block stays open.
* A checkpoint of the optimizer without ``opt.safevars_state``, with gradients pending
  under ``accumulate_steps``: they are saved with the optimizer, and training resumes
  bitwise.
* A model built in the scope, trained by ``fit`` with a plain optimizer, compiled again
  with a SafeOptimizer and trained again: no ``LockOrderError``, one lock per step.
* ``opt.iterations`` read at the start of a traced step: the step's own number.
"""

from __future__ import annotations

import os
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars.creator_scope import scope
from tests.support import forked
from tests.support.deadlines import scaled
from tests.support.threading_harness import run_threads


def make_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])


def data(n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return x, x.sum(axis=1, keepdims=True).astype(np.float32)


def versions(variables) -> list[int]:
    return [safevars.wrap(v).version for v in variables]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_safe_variable_passed_as_an_argument_is_locked_and_counted(jit_compile):
    v = safevars.SafeVariable(0.0)
    w = safevars.SafeVariable(10.0)

    @tf.function(jit_compile=jit_compile)
    def add(variable, amount):
        variable.assign_add(amount)

    for _ in range(5):
        add(v, 1.0)
    add(w, 2.0)  # another SafeVariable: traced for it, its own lock and version
    assert float(v.numpy()) == 5.0 and v.version == 5
    assert float(w.numpy()) == 12.0 and w.version == 1
    run_threads(4, lambda _: [add(v, 1.0) for _ in range(25)])
    assert float(v.numpy()) == 105.0 and v.version == 105


def test_a_safe_variable_argument_the_function_does_not_use():
    v = safevars.SafeVariable(1.0)

    @tf.function
    def double(variable, amount):
        return amount * 2.0

    assert float(double(v, 3.0)) == 6.0 and float(double(v, 4.0)) == 8.0
    assert v.version == 0


_ARGUMENT_AFTER_TRACED_CREATION = """
import tensorflow as tf, safevars
holder = []

@tf.function
def create():  # a SafeVariable created while tracing: TensorFlow's first look at one
    if not holder:
        holder.append(safevars.SafeVariable(1.0))
    return holder[0].assign_add(1.0)

create()

@tf.function
def add(variable, amount):
    variable.assign_add(amount)

v = safevars.SafeVariable(0.0)
for _ in range(3):
    add(v, 1.0)
add(holder[0], 1.0)
print(float(v.numpy()), v.version, float(holder[0].numpy()), holder[0].version)
"""


def test_a_safe_variable_argument_works_after_one_was_created_while_tracing():
    """TensorFlow's C++ "is a resource variable" check caches its answer per Python
    type, and all SafeVariables share one: the first one TensorFlow looked at decided
    for all. After a SafeVariable created inside a tf.function (not a ResourceVariable
    underneath), every SafeVariable argument failed ("Tensor.op is undefined"). A fresh
    process, since the cache lives as long as the process."""
    result = forked.run(
        ["-c", _ARGUMENT_AFTER_TRACED_CREATION],
        timeout=scaled(300),
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3.0", "3", "3.0", "2"]


def test_an_optimizer_made_safe_between_two_fits_runs_its_safe_step():
    model = make_model()
    optimizer = keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    x, y = data()
    model.fit(x, y, batch_size=4, verbose=0)
    with pytest.warns(UserWarning, match="made safe after a tf.function traced"):
        safevars.SafeOptimizer(optimizer)
    model.fit(x, y, batch_size=4, verbose=0)
    assert optimizer.statistics().calls == 4  # the second fit's steps, in the section
    assert versions(model.trainable_variables) == [4] * len(model.trainable_variables)


def test_an_optimizer_made_safe_before_any_step_does_not_warn():
    optimizer = keras.optimizers.Adam(1e-2)
    model = make_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        safevars.SafeOptimizer(optimizer)


def test_clear_session_inside_the_scope_keeps_it_open():
    with scope():
        before = keras.Variable(1.0)
        keras.backend.clear_session()
        after = keras.Variable(2.0)
        model = make_model()
    assert isinstance(before.value, safevars.SafeVariable)
    assert isinstance(after.value, safevars.SafeVariable)
    assert all(isinstance(w.value, safevars.SafeVariable) for w in model.weights)
    outside = keras.Variable(3.0)
    assert not isinstance(outside.value, safevars.SafeVariable)  # and it closed after


def test_a_checkpoint_of_the_optimizer_alone_keeps_pending_gradients(tmp_path):
    grads = [np.full((2,), g, np.float32) for g in (1.0, 2.0, 4.0, 8.0)]
    v = keras.Variable(np.zeros(2, np.float32))
    opt = safevars.SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=3)
    opt.apply_gradients([(grads[0], v)])  # pending: 1
    path = tf.train.Checkpoint(v=v, optimizer=opt).save(os.fspath(tmp_path / "ck"))
    v2 = keras.Variable(np.full(2, 9.0, np.float32))
    opt2 = safevars.SafeOptimizer(keras.optimizers.SGD(1.0), accumulate_steps=3)
    tf.train.Checkpoint(v=v2, optimizer=opt2).restore(path)  # before it is built
    for g in grads[1:]:
        opt.apply_gradients([(g, v)])
        opt2.apply_gradients([(g, v2)])
    np.testing.assert_array_equal(v2.numpy(), v.numpy())
    assert opt2.statistics().pending == opt.statistics().pending == 1


def test_a_scope_model_recompiled_with_a_safe_optimizer_trains_in_one_section():
    with scope():
        model = make_model()
    x, y = data()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=4, verbose=0)
    safe = safevars.SafeOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=safe, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=4, verbose=0)  # raised LockOrderError before
    assert safe.statistics().calls == 4
    assert versions(model.trainable_variables) == [8] * len(model.trainable_variables)
    slots = [v for v in safe.variables if isinstance(v.value, safevars.SafeVariable)]
    locks = {safevars.wrap(v).guard.lock for v in model.weights + slots}
    # Adam's two moments per weight, its iterations and learning rate: compiling a model
    # made in the scope protects the optimizer it is given.
    assert len(slots) == len(safe.variables) == 2 * len(model.weights) + 2
    assert locks == {safevars.wrap(safe.safevars_state.statistics).guard.lock}  # one, shared


@pytest.mark.parametrize("kind", ["safe", "plain"])
def test_iterations_read_at_the_start_of_a_traced_step_is_the_steps_number(kind):
    """4 threads x 25 traced steps each return ``opt.iterations`` read before the forward
    pass: inside the step's section, so the 100 numbers are 0..99 (distinct)."""
    with scope():
        model = make_model()
        opt = keras.optimizers.SGD(1e-3)
        if kind == "safe":
            opt = safevars.SafeOptimizer(opt)
    x, y = (tf.constant(a) for a in data(4))

    @tf.function
    def step():
        number = tf.identity(opt.iterations)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return number

    opt.build(model.trainable_variables)
    step()  # 0, and traced before the threads
    numbers: list[int] = []
    run_threads(4, lambda _: numbers.extend(int(step()) for _ in range(25)))
    assert sorted(numbers) == list(range(1, 101))
