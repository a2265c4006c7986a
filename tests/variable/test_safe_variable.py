"""SafeVariable: locked writes, versions, update, compare_and_assign and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable


def state(v):
    """Everything a failed call must leave unchanged."""
    return (v.numpy().tolist(), v.version, v.statistics())


class TestWritesAndVersions:
    def test_each_write_adds_one_version(self, mode):
        v = SafeVariable([1.0, 2.0, 3.0])

        def writes():
            v.assign([0.0, 0.0, 0.0])
            v.assign_add([1.0, 1.0, 1.0])
            v.assign_sub([0.5, 0.5, 0.5])
            v.scatter_add(tf.IndexedSlices(tf.constant([10.0]), tf.constant([1])))
            v.scatter_nd_update([[2]], [7.0])
            v[0].assign(4.0)
            return v.update(lambda x: x * 2)

        result = mode(writes)()
        np.testing.assert_allclose(v.numpy(), [8.0, 21.0, 14.0])
        np.testing.assert_allclose(result, [8.0, 21.0, 14.0])
        assert v.version == 7

    def test_version_is_int_eagerly_and_int64_tensor_in_graph(self):
        v = SafeVariable(1.0)
        assert isinstance(v.version, int) and v.version == 0

        @tf.function
        def bump_and_read():
            v.assign_add(1.0)
            return v.version

        out = bump_and_read()
        assert out.dtype == tf.int64 and int(out) == 1
        assert v.version == 1 and isinstance(v.version, int)

    def test_update_returns_written_value(self, mode):
        v = SafeVariable(3.0)
        out = mode(lambda: v.update(lambda x: x * x + 1.0))()
        assert float(out) == 10.0 and float(v.numpy()) == 10.0 and v.version == 1

    def test_compare_and_assign(self, mode):
        v = SafeVariable(1.0)
        v.assign(2.0)  # version 1
        cas = mode(lambda expected: v.compare_and_assign(5.0, expected))
        assert not bool(cas(0))
        assert float(v.numpy()) == 2.0 and v.version == 1
        assert bool(cas(1))
        assert float(v.numpy()) == 5.0 and v.version == 2

    def test_read_value_return_of_eager_write_is_a_safe_view(self):
        """As plain TensorFlow: an unread variable, not the variable itself; a
        SafeVariable sharing its guard, made once and reused."""
        v = SafeVariable(1.0)
        out = v.assign_add(1.0)
        assert isinstance(out, SafeVariable) and out.guard is v.guard
        assert out.name == tf.Variable(1.0).assign_add(1.0).name != v.name
        assert out.assign_add(1.0) is out is v.assign_add(0.0)
        assert v.version == 3 and float(out.numpy()) == 3.0
        assert v.assign(0.0, read_value=False) is None

    @pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
    def test_graph_write_without_read_value_returns_an_op_ordered_after_the_release(self, method):
        """As plain TensorFlow: an op, and no read of the variable (a read made the next
        write of a large variable copy its buffer); what depends on the op sees the write
        and its version."""
        v = SafeVariable(1.0)

        @tf.function(autograph=False)
        def write_then_look():
            op = getattr(v, method)(2.0, read_value=False)
            assert isinstance(op, tf.Operation)
            with tf.control_dependencies([op]):
                return v.read_value(), v.snapshot().version

        value, version = write_then_look()
        expected = {"assign": 2.0, "assign_add": 3.0, "assign_sub": -1.0}[method]
        assert float(value) == expected and int(version) == 1 == v.version
        reads = [
            op.type
            for op in write_then_look.get_concrete_function().graph.get_operations()
            if op.type == "ReadVariableOp"
        ]
        assert len(reads) == 3  # the caller's read and the snapshot's value and version

    def test_wrap_shares_storage_and_guard(self):
        plain = tf.Variable(1.0)
        a, b = safevars.wrap(plain), safevars.wrap(plain)
        assert a.guard is b.guard
        assert safevars.wrap(a) is a
        a.assign_add(1.0)
        assert b.version == 1 and float(plain.numpy()) == 2.0

    def test_wrap_keras_variable_wraps_backing_variable(self):
        import keras

        kv = keras.Variable(np.ones((2,), np.float32))
        sv = safevars.wrap(kv)
        sv.assign_add([1.0, 1.0])
        np.testing.assert_allclose(kv.numpy(), [2.0, 2.0])
        assert sv.version == 1

    def test_statistics_is_frozen_record(self):
        v = SafeVariable(0.0)
        v.assign_add(1.0)
        stats = v.statistics()
        assert stats.writes == 1 and not stats.locked and stats.owner is None
        with pytest.raises(AttributeError):
            stats.writes = 5  # type: ignore[misc]
        with safevars.locked(v):
            inside = v.statistics()
        assert inside.locked and inside.depth == 1


class TestBadInput:
    def test_wrong_shape(self, mode):
        v = SafeVariable([1.0, 2.0])
        before = state(v)
        with pytest.raises(safevars.ShapeMismatchError, match=r"value has shape \[3\]"):
            mode(lambda: v.assign([1.0, 2.0, 3.0]))()
        with pytest.raises(ValueError):  # plain tf.Variable code catches ValueError
            mode(lambda: v.assign_add([[1.0, 2.0]]))()
        assert state(v) == before

    def test_wrong_dtype(self, mode):
        v = SafeVariable([1.0, 2.0])
        before = state(v)
        with pytest.raises(safevars.DTypeMismatchError, match="dtype float32"):
            mode(lambda: v.assign(tf.constant(["a", "b"])))()
        with pytest.raises(TypeError):
            mode(lambda: v.assign_sub(tf.constant([1, 2], tf.int64)))()
        assert state(v) == before

    def test_update_not_callable(self):
        v = SafeVariable(1.0)
        before = state(v)
        with pytest.raises(safevars.NotCallableError, match="update"):
            v.update(3.0)  # type: ignore[arg-type]
        assert state(v) == before

    def test_update_fn_result_wrong_shape(self, mode):
        v = SafeVariable([1.0, 2.0])
        before = state(v)
        with pytest.raises(safevars.ShapeMismatchError, match="the result of fn"):
            mode(lambda: v.update(lambda x: tf.concat([x, x], 0)))()
        assert state(v) == before

    def test_update_fn_exception_propagates_unchanged(self):
        v = SafeVariable(1.0)
        before = state(v)

        class Boom(Exception):
            pass

        def fn(x):
            raise Boom("from fn")

        with pytest.raises(Boom, match="from fn"):
            v.update(fn)
        assert state(v) == before

    @pytest.mark.parametrize("expected", [-1, 1.5, "0", True, None])
    def test_compare_and_assign_bad_expected_version(self, expected):
        v = SafeVariable(1.0)
        before = state(v)
        with pytest.raises(safevars.InvalidArgumentError, match="expected_version"):
            v.compare_and_assign(2.0, expected)
        assert state(v) == before

    def test_wrap_rejects_non_variable(self):
        with pytest.raises(safevars.InvalidArgumentError, match="wrap"):
            safevars.wrap(tf.constant(1.0))

    def test_errors_share_base_and_builtin(self):
        assert issubclass(safevars.ShapeMismatchError, (safevars.SafeVarsError, ValueError))
        assert issubclass(safevars.DTypeMismatchError, TypeError)
        assert issubclass(safevars.LockReentryError, RuntimeError)
        assert issubclass(safevars.NotCallableError, TypeError)


@pytest.mark.parametrize(
    "dtype, delta",
    [
        (tf.float64, 1.0),
        (tf.float64, 1),
        (tf.int64, 1),
        (tf.int32, 1),
        (tf.float16, 1.0),
        (tf.float32, 1),
    ],
)
def test_python_number_writes_keep_the_variable_dtype(dtype, delta, mode):
    v = SafeVariable(tf.constant(5, dtype))
    mode(lambda: (v.assign_add(delta), v.assign_sub(delta), v.assign_add(delta)))()
    assert v.dtype == dtype and float(v.numpy()) == 6.0 and v.version == 3


def test_unknown_shape_variable_accepts_any_shape(mode):
    v = SafeVariable([1.0], shape=tf.TensorShape(None))
    mode(lambda: v.assign([1.0, 2.0, 3.0]))()
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0])
    assert v.version == 1


@pytest.mark.parametrize("made", ["eagerly", "while tracing"])
def test_eager_writes_call_the_write_kernels_themselves(made, monkeypatch):
    """An eager write of a SafeVariable over a plain resource variable runs the kernel
    and the version count as one chain of C calls (``Guard.write_counted``), not
    ``tf.Variable.assign`` then a second count: faster, and an interrupt lands before
    both or after both. Also for a variable created while tracing (an
    ``UnliftedInitializerVariable``, as Keras' lazily built metrics and layers are)."""
    made_here: list[SafeVariable] = []

    @tf.function(autograph=False)
    def make():
        if not made_here:
            made_here.append(SafeVariable(1.0))
        return made_here[0].read_value()

    if made == "eagerly":
        v = SafeVariable(1.0)
    else:
        make()
        v = made_here[0]
    wrapped_class = type(v.__wrapped__).__name__
    assert wrapped_class == (
        "ResourceVariable" if made == "eagerly" else "UnliftedInitializerVariable"
    )

    def python_write(*args, **kwargs):
        raise AssertionError(f"{wrapped_class}'s Python write method ran")

    classes = type(v.__wrapped__).__mro__
    for cls in classes[: classes.index(tf.Variable)]:
        for method in ("assign", "assign_add", "assign_sub"):
            if method in vars(cls):
                monkeypatch.setattr(cls, method, python_write)
    v.assign(5.0)
    v.assign_add(2.0)
    v.assign_sub(1.0, read_value=False)
    assert v.numpy() == 6.0 and v.version == 3


def test_errors_keep_their_type_through_autograph():
    v = SafeVariable([1.0, 2.0])

    @tf.function  # AutoGraph on: errors raised while tracing must keep their type
    def write_wrong_shape():
        v.assign([1.0])

    with pytest.raises(safevars.ShapeMismatchError):
        write_wrong_shape()
    assert v.version == 0


class TestGraphWritesWaitForFn:
    """Inside tf.function the write of update(fn) runs only once every op fn created has
    succeeded; in a transaction each write waits for the ops traced before it."""

    def test_failed_assertion_in_update_writes_nothing(self):
        v = SafeVariable(1.0)

        @tf.function(autograph=False)
        def bump(allowed):
            def fn(x):
                tf.debugging.assert_equal(allowed, True, message="not allowed")
                return x + 1.0  # the result does not depend on the assertion

            return v.update(fn)

        with pytest.raises(tf.errors.InvalidArgumentError, match="not allowed"):
            bump(tf.constant(False))
        assert float(v.numpy()) == 1.0 and v.version == 0
        assert float(bump(tf.constant(True))) == 2.0 and v.version == 1

    def test_failed_assertion_stops_the_writes_after_it_in_a_transaction(self):
        a, b = SafeVariable(10.0), SafeVariable(0.0)

        @tf.function(autograph=False)
        def move(amount):
            def fn():
                a.assign_sub(1.0)  # before the check: made, with its version
                tf.debugging.assert_less_equal(amount, 5.0, message="too much")
                a.assign_sub(amount)
                b.assign_add(amount + 1.0)

            return safevars.transaction([a, b], fn)

        with pytest.raises(tf.errors.InvalidArgumentError, match="too much"):
            move(tf.constant(7.0))
        assert (float(a.numpy()), float(b.numpy())) == (9.0, 0.0)
        assert (a.version, b.version) == (1, 0)  # each version follows its value
        move(tf.constant(2.0))
        assert (float(a.numpy()), float(b.numpy())) == (6.0, 3.0)
        assert (a.version, b.version) == (3, 1)


class TestPickle:
    def test_round_trip_keeps_value_and_version_with_a_new_lock(self):
        import pickle

        v = SafeVariable([1.0, 2.0], name="weights", trainable=False)
        v.assign_add([1.0, 1.0])
        with safevars.locked(v):  # held here: the copy's lock is its own
            clone = pickle.loads(pickle.dumps(v))
            assert not clone.statistics().locked
        assert isinstance(clone, SafeVariable) and clone.guard is not v.guard
        assert clone.numpy().tolist() == [2.0, 3.0] and clone.version == 1
        assert clone.name == v.name and clone.trainable is False and clone.dtype == v.dtype
        clone.assign([0.0, 0.0])
        assert v.numpy().tolist() == [2.0, 3.0] and (v.version, clone.version) == (1, 2)

    # A SafeVariable pickled by safevars before safevars.variable became a package (its
    # value a list, not a NumPy array, so that the bytes do not depend on NumPy).
    PICKLED_BEFORE_THE_SPLIT = (
        b"\x80\x02cfunctools\npartial\nq\x00csafevars.variable\n_unpickle\nq\x01\x85q\x02Rq"
        b"\x03(h\x01)}q\x04(X\r\x00\x00\x00initial_valueq\x05]q\x06(G@\x08\x00\x00\x00\x00"
        b"\x00\x00G\xbf\xe0\x00\x00\x00\x00\x00\x00eX\x07\x00\x00\x00versionq\x07K\x02X\t"
        b"\x00\x00\x00trainableq\x08\x88X\x04\x00\x00\x00nameq\tX\x0e\x00\x00\x00pickled_bef"
        b"oreq\nX\x05\x00\x00\x00dtypeq\x0bctensorflow.python.framework.dtypes\nas_dtype\nq"
        b"\x0cX\x07\x00\x00\x00float32q\r\x85q\x0eRq\x0fX\n\x00\x00\x00constraintq\x10NuNt"
        b"q\x11b)Rq\x12."
    )

    def test_a_pickle_made_before_the_package_split_loads_and_new_ones_name_it_alike(self):
        import pickle

        v = pickle.loads(self.PICKLED_BEFORE_THE_SPLIT)
        assert isinstance(v, SafeVariable) and v.version == 2
        assert v.numpy().tolist() == [3.0, -0.5] and v.name == "pickled_before:0"
        assert v.trainable and v.dtype == tf.float32
        # A pickle made now names the same function, so older releases load it too.
        assert b"csafevars.variable\n_unpickle\n" in pickle.dumps(v, protocol=2)

    def test_plain_variables_pickle_the_same_way(self):
        import pickle

        plain, safe = tf.Variable(np.arange(3.0)), SafeVariable(np.arange(3.0))
        a, b = pickle.loads(pickle.dumps(plain)), pickle.loads(pickle.dumps(safe))
        assert a.numpy().tolist() == b.numpy().tolist() and a.dtype == b.dtype
        assert a.shape == b.shape and a.trainable == b.trainable
