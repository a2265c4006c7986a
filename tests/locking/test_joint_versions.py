"""Joint versions: a step that writes every model variable counts them with one add.

Each variable's version must still count exactly its own writes, whatever mixes of joint
steps, partial steps and single writes run, eagerly, traced, from several threads, and
through checkpoints (whose entries stay those of a plain version variable).
"""

from __future__ import annotations

import threading

import keras
import pytest
import tensorflow as tf

import safevars
from safevars import SafeOptimizer, SafeVariable
from safevars.locking import join_versions, share_lock
from tests.support.threading_harness import run_threads
from tests.support.traced_step import traced_step


def _model_and_optimizer(seed: int = 0, scoped: bool = False):
    """A small model and its SafeOptimizer; ``scoped``: made in ``safevars.scope()``, so
    its variables are SafeVariables whose versions checkpoints hold."""
    keras.utils.set_random_seed(seed)
    if scoped:
        with safevars.scope():
            return _model_and_optimizer(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    opt = SafeOptimizer(keras.optimizers.SGD(0.1))
    opt.build(model.trainable_variables)
    return model, opt


def _versions(model):
    return [safevars.wrap(v).version for v in model.trainable_variables]


def _traced_step(model, opt, skip: int | None = None):
    return traced_step(model, opt, skip=skip)


def test_the_optimizer_gives_its_model_variables_one_joint_counter():
    model, _ = _model_and_optimizer()
    guards = [safevars.wrap(v).guard for v in model.trainable_variables]
    counter = guards[0].joint
    assert counter is not None
    assert all(g.joint is counter for g in guards)
    assert counter.size == len(guards)


def test_joint_steps_partial_steps_and_single_writes_each_count_their_own_writes():
    model, opt = _model_and_optimizer()
    full = _traced_step(model, opt)
    partial = _traced_step(model, opt, skip=1)  # variable 1 gets no gradient
    kernel = safevars.wrap(model.trainable_variables[0])

    @tf.function(autograph=False)
    def single_write():
        kernel.assign_add(tf.zeros_like(kernel))

    @tf.function(autograph=False)
    def read_versions():
        return [safevars.wrap(v).version for v in model.trainable_variables]

    for _ in range(3):
        full()
    with pytest.warns(UserWarning, match="Gradients do not exist"):  # Keras', at trace
        partial()
    single_write()
    single_write()
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    opt.apply_gradients(zip(grads, model.trainable_variables))  # eager, every variable
    expected = [3 + 1 + 2 + 1, 3 + 0 + 0 + 1, 3 + 1 + 1, 3 + 1 + 1]
    assert _versions(model) == expected
    assert [int(t) for t in read_versions()] == expected
    snapshots = safevars.snapshot(model.trainable_variables)
    assert [s.version for s in snapshots] == expected


def test_a_joint_step_adds_once_to_the_counter_and_nothing_to_the_version_variables():
    model, opt = _model_and_optimizer()
    guards = [safevars.wrap(v).guard for v in model.trainable_variables]
    step = _traced_step(model, opt)
    step()
    step()
    assert guards[0].joint.value() == 2
    assert [int(g.version_var.numpy()) for g in guards] == [0, 0, 0, 0]
    assert _versions(model) == [2, 2, 2, 2]


def test_four_threads_of_joint_steps_and_single_writes_stay_exact():
    model, opt = _model_and_optimizer()
    step = _traced_step(model, opt)
    bias = safevars.wrap(model.trainable_variables[1])

    @tf.function(autograph=False)
    def single_write():
        bias.assign_add(tf.zeros_like(bias))

    calls = 25

    def worker(index):
        for _ in range(calls):
            (step if index % 2 == 0 else single_write)()

    run_threads(4, worker)
    steps, writes = 2 * calls, 2 * calls
    assert _versions(model) == [steps, steps + writes, steps, steps]
    assert int(opt.iterations.numpy()) == steps


def test_a_checkpoint_holds_each_version_and_restores_it(tmp_path):
    model, opt = _model_and_optimizer(scoped=True)
    step = _traced_step(model, opt)
    for _ in range(3):
        step()
    safevars.wrap(model.trainable_variables[0]).assign_add(tf.zeros([4, 3]))
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    saved = {
        name: int(tf.train.load_variable(path, name))
        for name, _ in tf.train.list_variables(path)
        if "safevars_version" in name and "_trainable_variables" in name
    }
    # The entries hold the versions themselves, as a plain version variable's do.
    assert sorted(saved.values()) == [3, 3, 3, 4]

    for _ in range(2):
        step()
    assert _versions(model) == [6, 5, 5, 5]
    checkpoint.read(path).assert_consumed()
    assert _versions(model) == [4, 3, 3, 3]
    step()
    assert _versions(model) == [5, 4, 4, 4]

    # Into a model whose variables count their versions alone: the same versions.
    other, other_opt = _model_and_optimizer(seed=1, scoped=True)
    for v in other.trainable_variables:
        safevars.wrap(v).guard.joint = None
    tf.train.Checkpoint(model=other, optimizer=other_opt).read(path).assert_consumed()
    assert _versions(other) == [4, 3, 3, 3]


def test_join_versions_refuses_what_it_cannot_count_and_changes_nothing():
    a, b, c = SafeVariable(1.0), SafeVariable(2.0), SafeVariable(3.0)
    assert not join_versions([a.guard])  # one variable: nothing to join
    assert not join_versions([a.guard, b.guard])  # two locks
    assert a.guard.joint is None and b.guard.joint is None
    assert share_lock([a.guard, b.guard, c.guard])

    @tf.function(autograph=False)
    def read():
        return c.version

    read()  # a traced graph reads c's version without a counter
    assert not join_versions([a.guard, c.guard])
    assert a.guard.joint is None and c.guard.joint is None
    assert int(read()) == 0


def test_a_guard_keeps_its_first_joint_counter():
    a, b, c = SafeVariable(1.0), SafeVariable(2.0), SafeVariable(3.0)
    assert share_lock([a.guard, b.guard, c.guard])
    assert join_versions([a.guard, b.guard])
    counter = a.guard.joint
    assert not join_versions([b.guard, c.guard])
    assert b.guard.joint is counter and c.guard.joint is None


@pytest.mark.parametrize("traced", [False, True])
def test_a_partial_step_counts_per_variable(traced):
    model, opt = _model_and_optimizer()
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    pairs = list(zip(grads, model.trainable_variables))[:2]
    apply = tf.function(lambda: opt.apply_gradients(pairs)) if traced else None
    for _ in range(2):
        apply() if traced else opt.apply_gradients(pairs)
    assert _versions(model) == [2, 2, 0, 0]


def test_the_counter_counts_only_its_exact_set_of_members():
    model, _ = _model_and_optimizer()
    guards = [safevars.wrap(v).guard for v in model.trainable_variables]
    counter = guards[0].joint
    assert counter.counts_exactly(list(reversed(guards)))
    assert not counter.counts_exactly(guards[:-1])
    assert not counter.counts_exactly([guards[0], *guards[:-1]])  # a member twice
    assert not counter.counts_exactly([*guards[:-1], SafeVariable(0.0).guard])


def test_restores_racing_joint_steps_keep_each_value_with_its_version(tmp_path):
    """SGD(1.0) on gradients of ones: every step lowers each weight by 1 and adds 1 to
    its version (one joint add), so ``weight + version`` is the same in every state that
    existed (101: the ``assign`` that set 100 counted one). Restores of a checkpoint race two threads of traced steps; a restore that
    wrote the version without subtracting the joint counter would break the sum."""
    with safevars.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        opt = SafeOptimizer(keras.optimizers.SGD(1.0))
    kernel, bias = model.trainable_variables
    kernel.assign([[100.0]])
    bias.assign([100.0])
    opt.build(model.trainable_variables)
    ones = [tf.ones([1, 1]), tf.ones([1])]

    @tf.function(autograph=False)
    def step():
        opt.apply_gradients(zip(ones, model.trainable_variables))

    for _ in range(3):
        step()
    checkpoint = tf.train.Checkpoint(model=model)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    stop = threading.Event()

    def role(index):
        if index == 0:
            for _ in range(10):
                checkpoint.read(path).assert_consumed()
            stop.set()
        else:
            while not stop.is_set():
                step()

    run_threads(3, role)
    for v in model.trainable_variables:
        value = float(tf.reshape(v, [-1])[0])
        assert value + safevars.wrap(v).version == 101.0, (value, safevars.wrap(v).version)
