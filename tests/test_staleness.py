"""safevars.staleness: the policy shared by GradientAccumulator and SafeOptimizer.

Exact values eagerly and inside tf.function; refusals raise eagerly and fail at graph
run time with a message that errors.from_assertion turns back into StaleGradientError.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.errors import InvalidArgumentError, StaleGradientError, from_assertion
from safevars.staleness import (
    STALE_POLICIES,
    check_stale_policy,
    refuse_stale,
    scale_stale,
    stale_error,
    stale_scale_factor,
    version_lag,
)

MESSAGE = (
    "The gradients are 5 updates stale, more than max_staleness=2; nothing was "
    "accumulated. Recompute them from the current parameters, or pass on_stale=drop or "
    "on_stale=scale"
)


def graph(fn):
    return tf.function(fn, autograph=False)


def i64(value: int) -> tf.Tensor:
    return tf.constant(value, tf.int64)


# ---------------------------------------------------------------------- the policy


def test_policies():
    assert STALE_POLICIES == ("drop", "raise", "scale")


@pytest.mark.parametrize("policy", ["drop", "raise", "scale"])
def test_check_stale_policy_accepts_and_normalises(policy):
    assert check_stale_policy(None, policy) == (None, policy)
    checked = check_stale_policy(np.int64(3), policy)
    assert checked == (3, policy) and type(checked[0]) is int
    assert check_stale_policy(0, policy) == (0, policy)


@pytest.mark.parametrize(
    "max_staleness, on_stale, match",
    [
        (-1, "drop", r"max_staleness must be None or an int >= 0, got -1\."),
        (1.5, "drop", r"max_staleness .* got 1\.5 of type float"),
        (True, "drop", r"max_staleness .* got True"),
        ("2", "drop", r"max_staleness .* got '2'"),
        (2, "ignore", r"on_stale must be one of 'drop', 'raise', 'scale', got 'ignore'"),
        (2, None, r"on_stale .* got None"),
    ],
)
def test_check_stale_policy_refuses(max_staleness, on_stale, match):
    with pytest.raises(InvalidArgumentError, match=match):
        check_stale_policy(max_staleness, on_stale)


# ---------------------------------------------------------------------- lag


def test_lag_eager_ints():
    assert version_lag(5, 3) == 2
    assert version_lag(3, 3) == 0
    assert version_lag(3, 5) == 0  # from the future: clamped, never stale


def test_lag_eager_tensors_are_read():
    lag = version_lag(i64(7), tf.constant(4, tf.int32))
    assert lag == 3 and type(lag) is int
    assert version_lag(i64(4), 9) == 0


def test_lag_refuses_future_versions_eagerly():
    assert version_lag(5, 5, refuse_future=True) == 0
    with pytest.raises(InvalidArgumentError, match=r"^version is 2 update\(s\) ahead .*\(3\)"):
        version_lag(3, 5, refuse_future=True)
    with pytest.raises(InvalidArgumentError, match=r"^version\[1\] is 1 update"):
        version_lag(i64(3), i64(4), refuse_future=True, argument="version[1]")


def test_lag_in_a_graph():
    lag = graph(lambda c, v: version_lag(c, v))
    out = lag(i64(9), i64(2))
    assert out.dtype == tf.int64 and int(out) == 7
    assert int(lag(i64(2), i64(9))) == 0
    # One Python int: still a tensor; refuse_future cannot raise in a graph: clamped.
    assert int(graph(lambda v: version_lag(4, v, refuse_future=True))(i64(6))) == 0
    assert int(graph(lambda c: version_lag(c, 1))(tf.constant(4, tf.int32))) == 3


def test_lag_of_two_ints_in_a_graph_is_an_int():
    seen = []
    graph(lambda: seen.append(version_lag(6, 1)))()
    assert seen == [5] and type(seen[0]) is int


# ---------------------------------------------------------------------- scale


def test_scale_factor():
    assert stale_scale_factor(0) == 1.0
    assert stale_scale_factor(2) == 1.0 / 3.0 and type(stale_scale_factor(2)) is float
    factor = graph(lambda s: stale_scale_factor(s))(i64(2))
    assert factor.dtype == tf.float32
    assert factor.numpy().tobytes() == (np.float32(1) / np.float32(3)).tobytes()
    wide = graph(lambda s: stale_scale_factor(s, tf.float64))(i64(4))
    assert wide.dtype == tf.float64 and float(wide) == 0.2


def test_scale_divides(mode):
    values = np.array([5.0, 7.0, -3.0, 0.0], np.float32)
    expected = values / np.float32(3)
    # Dividing is not multiplying by the factor: 5 / 3 and 7 / 3 differ in the last bit.
    assert (expected != values * (np.float32(1) / np.float32(3)))[:2].all()
    out = mode(lambda v, s: scale_stale(v, s))(tf.constant(values), i64(2))
    assert np.asarray(out).tobytes() == expected.tobytes()
    assert np.asarray(scale_stale(tf.constant(values), 2)).tobytes() == expected.tobytes()


def test_scale_where(mode):
    values = tf.constant([6.0, 6.0], tf.float16)
    assert scale_stale(values, None, where=False) is values
    picked = mode(lambda v, w: scale_stale(v, i64(1), where=w))(values, tf.constant(False))
    assert np.asarray(picked).tolist() == [6.0, 6.0]
    picked = mode(lambda v, w: scale_stale(v, i64(1), where=w))(values, tf.constant(True))
    assert picked.dtype == tf.float16 and np.asarray(picked).tolist() == [3.0, 3.0]
    mask = tf.constant([True, False])
    assert np.asarray(scale_stale(values, 2, where=mask)).tolist() == [2.0, 6.0]


# ---------------------------------------------------------------------- refusal


def test_stale_error_text():
    error = stale_error(5, 2, "accumulated")
    assert isinstance(error, StaleGradientError) and isinstance(error, ValueError)
    assert str(error) == MESSAGE + "."
    assert "nothing was applied." in str(stale_error(3, 0, "applied"))


def test_refuse_eagerly():
    assert refuse_stale(2, 2, "accumulated") is None
    assert refuse_stale(i64(0), 0, "accumulated") is None
    with pytest.raises(StaleGradientError) as raised:
        refuse_stale(5, 2, "accumulated")
    assert str(raised.value) == MESSAGE + "."
    with pytest.raises(StaleGradientError, match="^The gradients are 3 updates stale"):
        refuse_stale(i64(3), 2, "accumulated")


def test_refuse_in_a_graph_fails_at_run_time():
    def step(staleness):
        check = refuse_stale(staleness, 2, "accumulated")
        assert isinstance(check, tf.Operation)
        with tf.control_dependencies([check]):
            return tf.identity(staleness)

    step = graph(step)
    assert int(step(i64(2))) == 2
    with pytest.raises(tf.errors.InvalidArgumentError, match="safevars StaleGradientError") as e:
        step(i64(5))
    error = from_assertion(e.value, (StaleGradientError,), note=" (noted).")
    assert isinstance(error, StaleGradientError)
    assert str(error) == MESSAGE + " (noted)."


def test_refuse_of_an_int_in_a_graph_is_decided_at_trace_time():
    assert graph(lambda: refuse_stale(1, 1, "applied"))() is None
    with pytest.raises(StaleGradientError, match="2 updates stale"):
        graph(lambda: refuse_stale(2, 1, "applied"))()
