"""The tf.Variable contract: a SafeVariable passes wherever a tf.Variable is expected.

Parametrized over every way of getting one (``SafeVariable(...)`` and ``wrap(tf.Variable)``)
and, where it applies, run eagerly and under ``tf.function`` (the ``mode`` fixture).
"""

from __future__ import annotations

import copy
import inspect
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import safevars
from tests.support.graphs import kept_with

FACTORIES = {
    "SafeVariable": lambda value, **kw: safevars.SafeVariable(value, **kw),
    "wrap": lambda value, **kw: safevars.wrap(tf.Variable(value, **kw)),
}


@pytest.fixture(params=sorted(FACTORIES))
def make(request):
    return FACTORIES[request.param]


def test_isinstance_and_attributes(make):
    v = make([1.0, 2.0], name="w", trainable=True)
    assert isinstance(v, tf.Variable)
    assert v.dtype == tf.float32 and v.shape == (2,) and v.name == "w:0"
    assert v.trainable and v.ref().deref() is v
    assert {v.ref(): 1}[v.ref()] == 1


def test_signature_is_tf_variables():
    """inspect.signature (notebooks, IDEs) shows tf.Variable's parameters, which
    SafeVariable(...) takes; it raised ValueError (the proxy class's __wrapped__)."""
    signature = inspect.signature(safevars.SafeVariable)
    plain = inspect.signature(tf.Variable.__init__)
    assert list(signature.parameters.values()) == list(plain.parameters.values())[1:]
    assert signature.parameters["initial_value"].default is None
    assert signature.parameters["validate_shape"].default is True
    assert signature.bind([1.0], name="w", trainable=False).arguments["name"] == "w"


def test_repr_is_plain_tensorflows(make):
    """TensorFlow's own tests compare a variable's repr; the version is v.version."""
    v = make(1, name="r")
    assert repr(v) == "<tf.Variable 'r:0' shape=() dtype=int32, numpy=1>"
    assert repr(v) == repr(tf.Variable(1, name="r"))
    v.__wrapped__.read_value = lambda: 1 / 0  # as TensorFlow's testReprUnavailable
    assert repr(v) == "<tf.Variable 'r:0' shape=() dtype=int32, numpy=<unavailable>>"


def test_convert_operators_and_slicing(make, mode):
    v = make([[1.0, 2.0], [3.0, 4.0]])

    def compute():
        t = tf.convert_to_tensor(v)
        return (t, v + 1.0, 2.0 * v, v @ v, -v, v[1, 0], v[:, 1], tf.reduce_sum(v))

    t, plus, times, matmul, neg, item, column, total = mode(compute)()
    np.testing.assert_array_equal(t, [[1.0, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(plus, [[2.0, 3.0], [4.0, 5.0]])
    np.testing.assert_array_equal(times, [[2.0, 4.0], [6.0, 8.0]])
    np.testing.assert_array_equal(matmul, [[7.0, 10.0], [15.0, 22.0]])
    np.testing.assert_array_equal(neg, [[-1.0, -2.0], [-3.0, -4.0]])
    assert float(item) == 3.0 and float(total) == 10.0
    np.testing.assert_array_equal(column, [2.0, 4.0])


def test_slice_assignment_is_locked_and_counted(make, mode):
    v = make([1.0, 2.0, 3.0])
    mode(lambda: v[1:].assign([5.0, 6.0]))()
    np.testing.assert_array_equal(v.numpy(), [1.0, 5.0, 6.0])
    assert v.version == 1


def test_gradient_tape(make, mode):
    v = make(3.0)

    def grads():
        with tf.GradientTape(persistent=True) as tape:
            y = v * v
            tape.watch(v)
            z = 2.0 * v
        return tape.gradient(y, v), tape.gradient(z, v)

    dy, dz = mode(grads)()
    assert float(dy) == 6.0 and float(dz) == 2.0


def test_captured_in_tf_function(make):
    v = make(1.0)

    @tf.function
    def step(x):
        v.assign_add(x)
        return v.read_value()

    assert float(step(tf.constant(2.0))) == 3.0
    assert float(step(tf.constant(2.0))) == 5.0
    assert v.version == 2


def test_checkpoint_restores_value_and_version(make, tmp_path, mode):
    v = make([1.0, 2.0])
    mode(lambda: v.assign_add([1.0, 1.0]))()
    mode(lambda: v.assign_add([1.0, 1.0]))()
    ckpt = tf.train.Checkpoint(v=v)
    path = ckpt.save(os.fspath(tmp_path / "ckpt"))
    v.assign([9.0, 9.0])
    assert v.version == 3
    ckpt.restore(path).assert_consumed()
    np.testing.assert_array_equal(v.numpy(), [3.0, 4.0])
    assert v.version == 2
    # A fresh variable restores both too.
    fresh = make([0.0, 0.0])
    tf.train.Checkpoint(v=fresh).restore(path).assert_consumed()
    np.testing.assert_array_equal(fresh.numpy(), [3.0, 4.0])
    assert fresh.version == 2


def test_plain_checkpoint_restores_into_safe_variable(make, tmp_path):
    plain = tf.Variable([4.0, 5.0])
    path = tf.train.Checkpoint(v=plain).save(os.fspath(tmp_path / "plain"))
    v = make([0.0, 0.0])
    tf.train.Checkpoint(v=v).restore(path)
    np.testing.assert_array_equal(v.numpy(), [4.0, 5.0])


def test_saved_model_round_trip(make, tmp_path):
    module = tf.Module()
    module.v = make([1.0, 2.0])
    module.v.assign_add([1.0, 1.0])

    @tf.function(input_signature=[tf.TensorSpec([2], tf.float32)])
    def scale(x):
        return module.v * x

    module.scale = scale
    tf.saved_model.save(module, os.fspath(tmp_path / "sm"))
    loaded = tf.saved_model.load(os.fspath(tmp_path / "sm"))
    np.testing.assert_array_equal(loaded.v.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(loaded.scale(tf.constant([2.0, 2.0])), [4.0, 6.0])


def test_deepcopy_is_independent(make):
    v = make([1.0, 2.0])
    v.assign_add([1.0, 1.0])
    twin = copy.deepcopy(v)
    assert isinstance(twin, safevars.SafeVariable) and twin.guard is not v.guard
    assert twin.version == 1
    twin.assign([0.0, 0.0])
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
    assert v.version == 1 and twin.version == 2
    assert copy.copy(v) is v


def test_keras_optimizer_target(make, mode):
    v = make([1.0, 2.0])
    optimizer = keras.optimizers.SGD(learning_rate=0.5)
    grads = tf.constant([1.0, 1.0])
    mode(lambda: optimizer.apply_gradients([(grads, v)]))()
    np.testing.assert_allclose(v.numpy(), [0.5, 1.5])
    assert v.version == 1


def test_keras_optimizer_sparse_target(make):
    v = make([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    optimizer = keras.optimizers.SGD(learning_rate=1.0)
    grad = tf.IndexedSlices(tf.constant([[1.0, 1.0]]), tf.constant([1]), tf.constant([3, 2]))
    optimizer.apply_gradients([(grad, v)])
    np.testing.assert_allclose(v.numpy(), [[1.0, 1.0], [1.0, 1.0], [3.0, 3.0]])
    assert v.version == 1


@pytest.mark.parametrize("runtime_mode", [False, True], ids=["eager_locks", "runtime_mode"])
def test_pickle_round_trip(make, runtime_mode):
    """Pickles as a plain variable does (value, name, dtype, trainable); the version is
    kept and the copy has a lock of its own."""
    import pickle

    v = make([1.0, 2.0], name="p")
    if runtime_mode:
        kept_with(v, tf.function(lambda: v.assign_add([1.0, 1.0])))()
    else:
        v.assign_add([1.0, 1.0])
    plain = tf.Variable([2.0, 3.0], name="p")
    twin, plain_twin = pickle.loads(pickle.dumps(v)), pickle.loads(pickle.dumps(plain))
    assert isinstance(twin, safevars.SafeVariable) and twin.guard is not v.guard
    assert twin.version == 1 and not twin.statistics().runtime_mode
    for attribute in ("name", "dtype", "shape", "trainable"):
        assert getattr(twin, attribute) == getattr(plain_twin, attribute), attribute
    np.testing.assert_array_equal(twin.numpy(), plain_twin.numpy())
    twin.assign_add([1.0, 1.0])
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
    assert (v.version, twin.version) == (1, 2)


def test_pickle_of_a_mirrored_variable_fails_as_plain_does(mirrored_strategy):
    import pickle

    with mirrored_strategy.scope():
        plain, safe = tf.Variable(1.0), safevars.SafeVariable(1.0)
    with pytest.raises(Exception) as expected:
        pickle.dumps(plain)
    with pytest.raises(type(expected.value)):
        pickle.dumps(safe)


# ------------------------------------------------- what a write returns, as TensorFlow


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub", "scatter_add"])
def test_a_write_returns_the_variable_unread_as_plain_tensorflow(make, mode, method):
    """With read_value=True a write returns what tf.Variable's returns, an unread
    variable (eagerly named "UnreadVariable", not the variable's name), read when used:
    here after the write. It is a SafeVariable sharing the variable's lock and version,
    so writes chained on it are locked and counted."""
    v, plain = make([1.0, 2.0]), tf.Variable([1.0, 2.0])
    scatter = method.startswith("scatter")
    arg = tf.IndexedSlices(tf.constant([3.0]), tf.constant([1])) if scatter else [3.0, 3.0]
    names = []

    def write_twice(variable):
        out = getattr(variable, method)(arg)
        assert isinstance(out, safevars.SafeVariable) == (variable is v)
        names.append(out.name)
        return tf.convert_to_tensor(getattr(out, method)(arg))

    def run():
        return write_twice(v), write_twice(plain)

    got, expected = mode(run)()
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(v.numpy(), plain.numpy())
    assert v.version == 2
    if mode.name == "eager":
        assert names == ["UnreadVariable", "UnreadVariable"] and v.name != names[0]


def test_a_function_that_only_assigns_reads_nothing(make):
    """As plain TensorFlow's testUnreadVariableInsideFunction: no ReadVariableOp in a
    function that assigns without using the result (safevars read the value after
    every write: one more op per write, and the next write of a large variable copied
    its buffer). Using the result reads it after the write."""
    v = make(1.0)

    @tf.function
    def assign():
        v.assign(2.0)
        v.assign_add(1.0)

    graph = assign.get_concrete_function().graph
    assert not [op for op in graph.get_operations() if op.type == "ReadVariableOp"]
    assign()
    assert float(v.numpy()) == 3.0 and v.version == 2

    @tf.function
    def assign_and_use():
        return v.assign_add(1.0) * 2.0

    assert float(assign_and_use()) == 8.0 and v.version == 3


@pytest.mark.parametrize(
    "method, value, pattern",
    [
        ("assign", np.zeros([2, 2]), r"value has shape \[2, 2\].*shape.*and.*are incompatible"),
        ("assign_add", 1.0, r"delta has shape \[\].*shapes must be equal"),
        ("assign_sub", [1.0], r"delta has shape \[1\].*shapes must be equal"),
    ],
)
def test_shape_errors_keep_tensorflows_words(make, mode, method, value, pattern):
    """TensorFlow's tests (and code) match "shape ... and ... are incompatible" for an
    assign and "shapes must be equal" for an assign_add; safevars' message keeps those
    words besides naming the argument and the fix. The failed write changes nothing."""
    v, plain = make(np.ones([1, 4])), tf.Variable(np.ones([1, 4]))
    with pytest.raises(Exception, match=pattern.split(".*")[-1]) as plain_error:
        getattr(plain, method)(value)
    with pytest.raises(safevars.ShapeMismatchError, match=pattern) as error:
        mode(lambda: getattr(v, method)(value))()
    assert isinstance(error.value, (ValueError, tf.errors.InvalidArgumentError))
    assert isinstance(error.value, type(plain_error.value)) or method == "assign"
    np.testing.assert_array_equal(v.numpy(), np.ones([1, 4]))
    assert v.version == 0


def test_custom_gradient_of_a_function_that_writes_its_variable_argument(make):
    """As TensorFlow's testCustomGradientVariableOutput: the write's unread result must
    not record an access of the wrapped variable, which tf.custom_gradient would take
    for a variable its function used besides its argument ("grad_fn must accept keyword
    argument 'variables'")."""

    @tf.custom_gradient
    def add_three(x):
        x.assign_add(3.0)
        return x, lambda dy: 2.0 * dy

    v = make(2.0)
    with tf.GradientTape() as tape:
        out = add_three(v)
    assert float(tape.gradient(out, v)) == 2.0
    assert float(out) == 5.0 and v.version == 1
