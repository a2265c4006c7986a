"""The staleness policy shared by GradientAccumulator and SafeOptimizer.

Asynchronous workers compute gradients from parameters that may have been updated since
they read them. A caller that passes the version it read (an ``int`` counter, a
SafeVariable's ``.version`` or a :class:`~safevars.Snapshot`'s) lets safevars measure how
far behind the gradients are, and apply one policy to those too far behind:

* ``max_staleness``: ``None`` (no check) or an int >= 0, the largest lag accepted as is.
* ``on_stale``: what happens to gradients lagging by more than ``max_staleness``:

  ``"drop"``: they are skipped (and counted by the caller).
  ``"raise"``: :class:`~safevars.StaleGradientError`; nothing of the call takes effect.
  ``"scale"``: they are multiplied by ``1 / (staleness + 1)``, after Zhang et al.,
  "Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016 (with
  ``max_staleness=0`` every late gradient is scaled, which is their rule).

The *lag* (staleness) is ``current version - given version``, clamped at 0: a version
from the future is never stale. Eagerly, :func:`version_lag` can refuse it instead
(``refuse_future=True``); a graph cannot raise, so there it is clamped.

Every function works on Python ``int``s (eagerly: decisions are made at once) and on
int64 graph tensors (inside ``tf.function``: decisions are tensors and a refusal is a
``tf.debugging.Assert`` that fails when the graph runs). A refused call's run-time
message is tagged with :func:`safevars.errors.assertion_text`, so
:func:`safevars.errors.from_assertion` turns it back into a
:class:`~safevars.StaleGradientError` where the call returns to Python.

Used by :class:`safevars.GradientAccumulator` (``effect="accumulated"``) and
:class:`safevars.SafeOptimizer` (``effect="applied"``). The decision around these
functions (what is counted, how a dropped contribution is masked) stays with each caller.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars._validation import check_choice, check_int
from safevars.errors import InvalidArgumentError, StaleGradientError, assertion_text

__all__ = [
    "STALE_POLICIES",
    "check_stale_policy",
    "refuse_stale",
    "scale_stale",
    "stale_error",
    "stale_scale_factor",
    "version_lag",
]

STALE_POLICIES: tuple[str, ...] = ("drop", "raise", "scale")
"""The values ``on_stale`` accepts."""

# No quotes: a graph's assertion message shows them escaped, as \'.
_FIX = "Recompute them from the current parameters, or pass on_stale=drop or on_stale=scale"


def check_stale_policy(max_staleness: Any, on_stale: Any) -> tuple[int | None, str]:
    """Checks a ``(max_staleness, on_stale)`` pair given to a constructor.

    Args:
      max_staleness: ``None`` or an int >= 0 (Python or NumPy).
      on_stale: One of :data:`STALE_POLICIES`.

    Returns:
      ``(max_staleness, on_stale)`` normalised: a Python ``int`` (or ``None``) and the
      policy name.

    Raises:
      InvalidArgumentError: either is out of range (naming the argument and the value).
    """
    max_staleness = check_int(
        max_staleness,
        "max_staleness",
        0,
        optional=True,
        fix="It is the largest number of updates gradients may lag behind (None: no check).",
    )
    on_stale = check_choice(on_stale, "on_stale", STALE_POLICIES)
    return max_staleness, on_stale


def version_lag(
    current: int | tf.Tensor,
    version: int | tf.Tensor,
    *,
    refuse_future: bool = False,
    argument: str = "version",
) -> int | tf.Tensor:
    """How many versions ``version`` lags behind ``current``, clamped at 0.

    Args:
      current: The version now (an ``int``, or an integer scalar tensor).
      version: The version the gradients were computed from (same kinds).
      refuse_future: Raise instead of clamping when ``version`` is ahead of
        ``current`` (decided only when both are known now: eagerly, or two ``int``s).
      argument: The argument's name in that error message.

    Returns:
      ``max(current - version, 0)``: a Python ``int`` when both are ``int``s or when
      executing eagerly (tensors are read); otherwise an int64 scalar tensor.

    Raises:
      InvalidArgumentError: ``refuse_future`` and ``version > current``.
    """
    if tf.executing_eagerly() or (isinstance(current, int) and isinstance(version, int)):
        if isinstance(current, int) and isinstance(version, int):
            now, given = current, version
        else:
            now, given = _as_int(current), _as_int(version)
        if refuse_future and given > now:
            raise InvalidArgumentError(
                f"{argument} is {given - now} update(s) ahead of the current version "
                f"({now}): it must be a version read before the gradients were computed "
                "(optimizer.iterations, accumulator.version, v.version or a snapshot's)."
            )
        return max(now - given, 0)
    return tf.maximum(tf.cast(current, tf.int64) - tf.cast(version, tf.int64), 0)


def stale_scale_factor(staleness: int | tf.Tensor, dtype: tf.DType = tf.float32) -> Any:
    """The ``"scale"`` policy's factor ``1 / (staleness + 1)``, for callers that multiply.

    Args:
      staleness: A lag from :func:`version_lag` (``int`` or integer tensor).
      dtype: The floating dtype of the tensor result.

    Returns:
      A Python ``float`` (computed in float64) for an ``int``; otherwise a ``dtype``
      scalar tensor computed in ``dtype`` (one rounding: ``1`` divided by the exact
      ``staleness + 1``).
    """
    if isinstance(staleness, int):
        return 1.0 / (float(staleness) + 1.0)
    return tf.constant(1, dtype) / (tf.cast(staleness, dtype) + tf.constant(1, dtype))


def scale_stale(
    values: tf.Tensor, staleness: int | tf.Tensor | None, where: Any = True
) -> tf.Tensor:
    """``values / (staleness + 1)`` where ``where`` holds: the ``"scale"`` policy.

    Divides (one rounding per element), which is not always bitwise equal to multiplying
    by :func:`stale_scale_factor` (two roundings) unless ``staleness + 1`` is a power of
    two.

    Args:
      values: A floating tensor.
      staleness: A lag from :func:`version_lag` (``int`` or integer tensor); may be
        ``None`` when ``where`` is ``False``.
      where: ``True``, ``False`` (``values`` returned as they are) or a bool tensor
        (broadcast against ``values``) choosing which to scale.

    Returns:
      A tensor of ``values``' dtype and shape.
    """
    if where is False:
        return values
    divided = values / (tf.cast(staleness, values.dtype) + tf.constant(1, values.dtype))
    return tf.where(where, divided, values) if isinstance(where, tf.Tensor) else divided


def stale_error(staleness: int, max_staleness: int, effect: str) -> StaleGradientError:
    """The error ``on_stale="raise"`` raises eagerly.

    Args:
      staleness: The lag of the refused gradients.
      max_staleness: The policy's bound.
      effect: What did not happen, as a participle: ``"accumulated"``, ``"applied"``.

    Returns:
      A :class:`~safevars.StaleGradientError` naming the lag, the bound and the fix.
    """
    return StaleGradientError(f"{_text(staleness, max_staleness, effect)}.")


def refuse_stale(
    staleness: int | tf.Tensor, max_staleness: int, effect: str
) -> tf.Operation | None:
    """Refuses gradients lagging by more than ``max_staleness`` (``on_stale="raise"``).

    Args:
      staleness: A lag from :func:`version_lag`.
      max_staleness: The policy's bound.
      effect: What does not happen to refused gradients: ``"accumulated"``, ``"applied"``.

    Returns:
      ``None`` when the decision can be made now (an ``int``, or eagerly) and the
      gradients pass. Inside a ``tf.function`` for a tensor ``staleness``: a
      ``tf.debugging.Assert`` op; make the state change depend on it. It fails when
      the graph runs with a ``tf.errors.InvalidArgumentError`` whose message is
      tagged ``safevars StaleGradientError`` (see :func:`safevars.errors.from_assertion`)
      and holds the same text as :func:`stale_error`, the lag included.

    Raises:
      StaleGradientError: the decision is made now and the gradients are too stale.

    Modes:
      Eagerly the check happens here; inside a ``tf.function`` at graph run time.
    """
    if isinstance(staleness, int) or tf.executing_eagerly():
        lag = staleness if isinstance(staleness, int) else _as_int(staleness)
        if lag > max_staleness:
            raise stale_error(lag, max_staleness, effect)
        return None
    head, tail = _text(None, max_staleness, effect).split(" {} ")
    return tf.debugging.Assert(
        tf.logical_not(staleness > max_staleness),
        [assertion_text(StaleGradientError, head), staleness, tail],
    )


def _text(staleness: int | None, max_staleness: int, effect: str) -> str:
    """The message, without its final period; ``{}`` in place of an unknown lag."""
    lag = "{}" if staleness is None else str(staleness)
    return (
        f"The gradients are {lag} updates stale, more than max_staleness={max_staleness}; "
        f"nothing was {effect}. {_FIX}"
    )


def _as_int(value: Any) -> int:
    """An eager integer scalar (Python, NumPy or tensor) as a Python ``int``."""
    return int(value.numpy()) if hasattr(value, "numpy") else int(value)
