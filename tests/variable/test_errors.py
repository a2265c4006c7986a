"""Errors: every mistake raises what plain tf.Variable raises (and a SafeVarsError), and
changes nothing; what plain TensorFlow accepts, a SafeVariable accepts the same way.

Each case runs the same call on a plain ``tf.Variable`` and on a SafeVariable, eagerly and
inside ``tf.function``: the SafeVariable's error must be an instance of the class plain
TensorFlow raised, and leave value, version and lock as they were (plain TensorFlow's
scatter kernels write the rows before a bad index; a SafeVariable writes nothing).
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from safevars.errors import IndexOutOfRangeError


def state(v):
    """Everything a failed call must leave unchanged: value, version, lock and writes.

    (Not ``runtime_mode``: a function traced without error and failing only at run time
    has switched its variables to run-time mode for its later calls, as intended.)
    """
    stats = v.statistics()
    return (v.numpy().tolist(), v.version, stats.locked, stats.owner, stats.depth, stats.writes)


def _error_of(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return e
    return None


FLOAT4 = ([1.0, 2.0, 3.0, 4.0], tf.float32)
INT32 = (5, tf.int32)

# (id, initial value and dtype, the call on a variable v)
MISTAKES = [
    ("assign_shape", FLOAT4, lambda v: v.assign([1.0, 2.0])),
    ("assign_rank", FLOAT4, lambda v: v.assign([[1.0, 2.0, 3.0, 4.0]])),
    ("assign_add_shape", FLOAT4, lambda v: v.assign_add([1.0, 2.0])),
    ("assign_add_scalar", FLOAT4, lambda v: v.assign_add(1.0)),
    ("assign_sub_shape", FLOAT4, lambda v: v.assign_sub([1.0, 2.0, 3.0])),
    ("assign_strings", FLOAT4, lambda v: v.assign(tf.constant(["a", "b", "c", "d"]))),
    ("assign_int64_tensor", FLOAT4, lambda v: v.assign(tf.constant([1, 2, 3, 4], tf.int64))),
    (
        "assign_add_int64_tensor",
        FLOAT4,
        lambda v: v.assign_add(tf.constant([1, 2, 3, 4], tf.int64)),
    ),
    ("int32_assign_float", INT32, lambda v: v.assign(1.5)),
    ("int32_assign_2_64", INT32, lambda v: v.assign(2**64)),
    ("int32_assign_int64_tensor", INT32, lambda v: v.assign(tf.constant(2**40, tf.int64))),
    (
        "scatter_update_out_of_range",
        FLOAT4,
        lambda v: v.scatter_update(tf.IndexedSlices(tf.constant([9.0, 9.0]), tf.constant([1, 7]))),
    ),
    (
        "scatter_add_negative",
        FLOAT4,
        lambda v: v.scatter_add(tf.IndexedSlices(tf.constant([9.0]), tf.constant([-1]))),
    ),
    (
        "scatter_nd_update_out_of_range",
        FLOAT4,
        lambda v: v.scatter_nd_update([[1], [7]], [8.0, 8.0]),
    ),
    (
        "scatter_updates_shape",
        FLOAT4,
        lambda v: v.scatter_update(tf.IndexedSlices(tf.constant([9.0, 9.0]), tf.constant([1]))),
    ),
    ("scatter_not_indexed_slices", FLOAT4, lambda v: v.scatter_update(tf.constant([1.0]))),
]


@pytest.mark.parametrize("initial, call", [m[1:] for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_mistake_raises_what_plain_raises_and_changes_nothing(initial, call, mode):
    value, dtype = initial
    plain = tf.Variable(value, dtype=dtype)
    expected = _error_of(mode(lambda: call(plain)))
    assert expected is not None, "plain TensorFlow accepted the call: not a mistake"

    v = SafeVariable(value, dtype=dtype)
    before = state(v)
    got = _error_of(mode(lambda: call(v)))
    assert isinstance(got, type(expected)), (
        f"plain raised {type(expected).__mro__[:3]}, SafeVariable {type(got).__mro__[:4]}"
    )
    assert state(v) == before
    # (A kernel's own error, such as a scatter whose updates do not fit, is plain
    # TensorFlow's error, raised before the kernel writes anything.)


# (id, initial value and dtype, the call) that plain TensorFlow accepts.
ACCEPTED = [
    ("int32_assign_2_40_wraps", INT32, lambda v: v.assign(2**40)),
    ("int32_assign_2_31_wraps", INT32, lambda v: v.assign(2**31)),
    ("int32_assign_add_wraps", INT32, lambda v: v.assign_add(-(2**31) - 1)),
    ("int32_assign_sub_wraps", INT32, lambda v: v.assign_sub(2**40 + 3)),
    ("int32_assign_min_int64", INT32, lambda v: v.assign(-(2**63))),
    ("int32_assign_numpy_int64", INT32, lambda v: v.assign(np.int64(2**40 + 7))),
    ("int32_assign_bool", INT32, lambda v: v.assign(True)),
    ("float_assign_ints", FLOAT4, lambda v: v.assign([1, 2, 3, 4])),
    ("float_assign_float64_array", FLOAT4, lambda v: v.assign(np.arange(4.0))),
    ("float16_overflow_is_inf", (1.0, tf.float16), lambda v: v.assign(1e10)),
    ("uint8_wraps", (5, tf.uint8), lambda v: v.assign(300)),
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("initial, call", [a[1:] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_what_plain_accepts_is_accepted_alike(initial, call, mode):
    value, dtype = initial
    plain = tf.Variable(value, dtype=dtype)
    mode(lambda: call(plain))()
    v = SafeVariable(value, dtype=dtype)
    mode(lambda: call(v))()
    np.testing.assert_array_equal(v.numpy(), plain.numpy())
    assert v.dtype == plain.dtype and v.version == 1


@pytest.mark.parametrize("result", [-(2**63), 2**40, 2**31])
def test_update_wraps_an_int32_result_as_assign_does(result, mode):
    plain = tf.Variable(5, dtype=tf.int32)
    plain.assign(result)
    v = SafeVariable(5, dtype=tf.int32)
    out = mode(lambda: v.update(lambda x: result))()
    assert int(v.numpy()) == int(plain.numpy()) == int(out) and v.version == 1


def test_scatter_with_one_bad_index_writes_nothing_where_plain_writes_a_row():
    plain = tf.Variable([1.0, 2.0, 3.0, 4.0])
    v = SafeVariable([1.0, 2.0, 3.0, 4.0])
    delta = tf.IndexedSlices(tf.constant([9.0, 9.0]), tf.constant([1, 7]))
    with pytest.raises(tf.errors.InvalidArgumentError):
        plain.scatter_update(delta)
    assert plain.numpy().tolist() == [1.0, 9.0, 3.0, 4.0]  # plain: half written
    with pytest.raises(IndexOutOfRangeError, match=r"indices \[1, 7\].*\[0, 4\)"):
        v.scatter_update(delta)
    assert v.numpy().tolist() == [1.0, 2.0, 3.0, 4.0] and v.version == 0


def test_graph_scatter_with_bad_runtime_index_writes_nothing():
    v = SafeVariable([[1.0], [2.0]])

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def scatter(indices):
        updates = tf.ones([tf.size(indices), 1])
        return v.scatter_add(tf.IndexedSlices(updates, indices))

    with pytest.raises(tf.errors.InvalidArgumentError, match="IndexOutOfRangeError"):
        scatter(tf.constant([0, 2]))
    assert v.numpy().tolist() == [[1.0], [2.0]] and v.version == 0
    scatter(tf.constant([0, 1]))
    assert v.numpy().tolist() == [[2.0], [3.0]] and v.version == 1


@pytest.mark.parametrize(
    "method, args",
    [
        ("scatter_nd_add", ([[0, 2]], [1.0])),
        ("batch_scatter_update", (tf.IndexedSlices(tf.constant([[7.0]]), tf.constant([[2]])),)),
    ],
)
def test_every_scatter_checks_its_indices(method, args):
    v = SafeVariable([[1.0, 2.0], [3.0, 4.0]])
    before = state(v)
    with pytest.raises(IndexOutOfRangeError, match=method):
        getattr(v, method)(*args)
    assert state(v) == before


@pytest.mark.parametrize(
    "expected",
    [
        pytest.param(lambda: tf.constant(2.9), id="float_tensor"),
        pytest.param(lambda: tf.constant("1"), id="string_tensor"),
        pytest.param(lambda: tf.constant([0, 0]), id="vector"),
        pytest.param(lambda: tf.constant(True), id="bool_tensor"),
        pytest.param(lambda: 9.0, id="float"),
        pytest.param(lambda: True, id="bool"),
        pytest.param(lambda: "0", id="string"),
        pytest.param(lambda: None, id="none"),
        pytest.param(lambda: -1, id="negative"),
    ],
)
def test_versions_are_integers_only(expected, mode):
    v = SafeVariable(1.0)
    v.assign(2.0)  # version 1
    before = state(v)
    with pytest.raises(safevars.InvalidArgumentError, match="expected_version"):
        mode(lambda: v.compare_and_assign(9.0, expected()))()
    assert state(v) == before


def test_integer_version_tensors_of_any_width_are_accepted(mode):
    v = SafeVariable(1.0)
    for dtype in (tf.int32, tf.int64, tf.uint8):
        version = v.version
        assert bool(mode(lambda: v.compare_and_assign(2.0, tf.constant(version, dtype)))())
    assert v.version == 3 and bool(v.compare_and_assign(3.0, np.int64(3)))


def test_version_of_unknown_shape_is_checked_at_run_time():
    v = SafeVariable(1.0)

    @tf.function(input_signature=[tf.TensorSpec(None, tf.int64)])
    def cas(expected):
        return v.compare_and_assign(5.0, expected)

    with pytest.raises(tf.errors.InvalidArgumentError):
        cas(tf.constant([0, 0], tf.int64))
    assert float(v.numpy()) == 1.0 and v.version == 0
    assert bool(cas(tf.constant(0, tf.int64))) and v.version == 1


def test_error_classes_are_also_tensorflow_classes():
    assert issubclass(safevars.ShapeMismatchError, tf.errors.InvalidArgumentError)
    assert issubclass(safevars.ShapeMismatchError, ValueError)
    assert issubclass(safevars.DTypeMismatchError, (TypeError)) and issubclass(
        safevars.DTypeMismatchError, ValueError
    )
    assert issubclass(safevars.InvalidArgumentError, tf.errors.InvalidArgumentError)
    assert issubclass(IndexOutOfRangeError, IndexError)
    for cls in (safevars.ShapeMismatchError, IndexOutOfRangeError):
        assert issubclass(cls, safevars.SafeVarsError)


def test_tensorflow_error_attributes_and_pickling():
    error = safevars.ShapeMismatchError("value has shape [3]")
    assert str(error) == error.message == "value has shape [3]"
    assert error.error_code == tf.errors.INVALID_ARGUMENT
    assert error.node_def is None and error.op is None and error.experimental_payloads == {}
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is safevars.ShapeMismatchError and str(again) == str(error)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda v: v.assign_add([1.0]), safevars.ShapeMismatchError),
        (
            lambda v: v.compare_and_assign([1.0, 1.0], tf.constant(0.5)),
            safevars.InvalidArgumentError,
        ),
    ],
)
def test_tensorflow_classed_errors_keep_their_type_through_autograph(call, error):
    v = SafeVariable([1.0, 2.0])

    @tf.function  # AutoGraph on
    def f():
        call(v)

    with pytest.raises(error) as info:
        f()
    assert isinstance(info.value, tf.errors.InvalidArgumentError)
    assert v.version == 0
