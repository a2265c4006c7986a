"""Error classes raised by safevars.

Every error derives from :class:`SafeVarsError` *and* from every exception class that
plain ``tf.Variable`` code would catch for the same mistake, so existing handlers keep
working after a drop-in switch. Plain TensorFlow is not uniform here: a shape mismatch
is a ``ValueError`` from ``assign`` but a ``tf.errors.InvalidArgumentError`` from an eager
``assign_add``; a value of the wrong dtype is a ``TypeError`` (``"a"`` into ``float32``)
or a ``ValueError`` (an ``int64`` tensor into ``float32``). So :class:`ShapeMismatchError`
is both a ``ValueError`` and a ``tf.errors.InvalidArgumentError``, and
:class:`DTypeMismatchError` both a ``TypeError`` and a ``ValueError``
(``tests/variable/test_errors.py`` checks each mistake against plain TensorFlow).

Classes that also derive from a ``tf.errors`` class keep ``Exception``'s own
``__init__`` (one message argument), not ``tf.errors.OpError``'s ``(node_def, op,
message)``: AutoGraph re-raises an error from a converted ``tf.function`` with its
original type only for such classes. The ``OpError`` attributes (``message``,
``error_code``, ``node_def``, ``op``, ``experimental_payloads``) still answer.

A safevars call that raises one of these leaves every variable it touched exactly as it
was: value, version, statistics and lock state.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = [
    "AccumulatorFullError",
    "AccumulatorTimeoutError",
    "DTypeMismatchError",
    "IndexOutOfRangeError",
    "InvalidArgumentError",
    "LockOrderError",
    "LockReentryError",
    "LockTimeoutError",
    "NonFiniteGradientError",
    "NotCallableError",
    "NotProtectedError",
    "RaceDetectedError",
    "SafeVarsError",
    "ShapeMismatchError",
    "StaleGradientError",
    "UnsupportedStrategyError",
]


class SafeVarsError(Exception):
    """Base class of every error safevars raises on purpose."""

    # AutoGraph re-raises an error from a converted tf.function with its original type
    # only when the type keeps Exception's own __init__; otherwise it becomes a
    # StagingError and `except ValueError` no longer catches it.
    __init__ = Exception.__init__


class _TFErrorMixin:
    """Makes a :class:`SafeVarsError` subclass a valid ``tf.errors.OpError`` as well.

    ``OpError.__init__`` is never called (see the module docstring), so the attributes
    it would set are answered here from the message; pickling and ``str`` are those of
    an ordinary exception.
    """

    _error_code: int = 3  # error_codes_pb2.INVALID_ARGUMENT
    _node_def = None
    _op = None

    @property
    def _message(self) -> str:
        args = self.args  # type: ignore[attr-defined]
        return str(args[0]) if args else ""

    @property
    def _experimental_payloads(self) -> dict[str, Any]:
        return {}

    __str__ = Exception.__str__
    __reduce__ = Exception.__reduce__


class LockReentryError(SafeVarsError, RuntimeError):
    """A lock was re-entered in a way that would deadlock.

    Eagerly, safevars locks are re-entrant for the thread that holds them. Inside a
    ``tf.function`` the run-time lock is a ``tf.CriticalSection``, which cannot be
    entered twice from one graph execution; safevars raises this at trace time instead
    of building a graph that would hang.
    """


class LockOrderError(SafeVarsError, RuntimeError):
    """A thread holding some safevars locks tried to take another one out of order.

    safevars takes locks in one global order (creation order of the variables), which is
    what makes multi-variable locking deadlock-free. Taking a lock that sorts *before* one
    you already hold could deadlock, so it is refused. Fix: name every variable up front,
    ``safevars.locked(a, b)`` or ``safevars.transaction([a, b], fn)``.
    """


class LockTimeoutError(SafeVarsError, TimeoutError):
    """A lock was not free within the ``timeout`` a call was given.

    The message names the variables, the thread holding the lock and the ``file:line``
    where it took it (see also :func:`safevars.held_locks`). Nothing of the refused call
    was done: values, versions and locks are as they were.
    """


class ShapeMismatchError(_TFErrorMixin, SafeVarsError, ValueError, tf.errors.InvalidArgumentError):
    """A value written to a variable has a shape the variable cannot hold.

    Also a ``ValueError`` (what plain ``assign`` raises) and a
    ``tf.errors.InvalidArgumentError`` (what plain eager ``assign_add``/``assign_sub``
    and the ``scatter_*`` kernels raise).
    """


class DTypeMismatchError(SafeVarsError, TypeError, ValueError):
    """A value written to a variable cannot be converted to the variable's dtype.

    Also a ``TypeError`` and a ``ValueError``: plain TensorFlow raises the first for a
    Python value it cannot convert (``1.5`` into ``int32``) and the second for a tensor
    of another dtype or an integer out of the 64-bit range.
    """


class NotCallableError(SafeVarsError, TypeError):
    """An argument that must be callable (``update(fn)``, ``transaction(..., fn)``) is not."""


class InvalidArgumentError(
    _TFErrorMixin, SafeVarsError, ValueError, tf.errors.InvalidArgumentError
):
    """An argument has a value outside what the function accepts.

    Also a ``ValueError`` and a ``tf.errors.InvalidArgumentError``, the class TensorFlow
    raises for an argument its kernels refuse.
    """


class IndexOutOfRangeError(InvalidArgumentError, IndexError):
    """A ``scatter_*`` index lies outside the variable (checked before anything is written).

    Plain TensorFlow raises ``tf.errors.InvalidArgumentError`` for the same mistake, after
    writing the rows that came before the bad index; safevars writes nothing.
    """


class NotProtectedError(SafeVarsError, ValueError):
    """A Keras model, layer or optimizer passed to ``safevars.snapshot``,
    ``safevars.locked`` or ``safevars.transaction`` has variables that are not protected.

    Their writes (Keras' optimizer steps, ``set_weights``) take no safevars lock and
    count no version, so a snapshot or a section over them guarantees nothing. The
    message names each such variable and where it was created. Fix:
    ``safevars.protect(model)`` (or build the model inside ``safevars.scope()``). A
    ``ValueError``: the argument is the mistake.
    """


class StaleGradientError(SafeVarsError, ValueError):
    """Gradients were computed from parameters more than ``max_staleness`` versions old.

    Raised only with ``on_stale="raise"``; nothing of the refused call is applied.
    """


class NonFiniteGradientError(SafeVarsError, ValueError):
    """A gradient holds NaN or Inf and the policy is ``nonfinite="raise"``."""


class AccumulatorFullError(SafeVarsError, RuntimeError):
    """An ``add`` would leave more than ``max_pending`` contributions pending.

    Nothing of the refused ``add`` is accumulated and no statistic changes; a ``take``
    or ``reset`` makes room.
    """


class AccumulatorTimeoutError(SafeVarsError, TimeoutError):
    """``take(timeout=...)`` ran out of time before ``num_required`` contributions arrived.

    The contributions already added are kept; a later ``take`` still sees them.
    """


class UnsupportedStrategyError(SafeVarsError, NotImplementedError):
    """A ``tf.distribute`` strategy or combination that safevars does not support.

    The message names the strategies that are supported; safevars never falls back
    silently to an unsafe path.
    """


class RaceDetectedError(SafeVarsError, AssertionError):
    """``safevars.audit(raise_on_race=True)`` found unsynchronized variable access.

    Subclasses ``AssertionError`` so that test runners report it as a failed check.
    """


# ------------------------------------------------------- run-time assertion messages
#
# Checks that can only be made when a graph runs (a tf.function's staleness test, a
# parameter server's bounds check) are ``tf.debugging.Assert`` ops, which fail with a
# ``tf.errors.InvalidArgumentError`` whose message holds the assertion's text. The text
# starts with a tag naming the safevars error it stands for; ``from_assertion`` turns
# such a failure back into that error where the call returns to Python.


def assertion_text(error_class: type[SafeVarsError], text: str) -> str:
    """The message of a run-time assertion that stands for ``error_class``."""
    return f"safevars {error_class.__name__}: {text}"


def from_assertion(
    error: tf.errors.InvalidArgumentError,
    classes: tuple[type[SafeVarsError], ...],
    note: str = "",
) -> SafeVarsError | None:
    """The safevars error that a failed run-time assertion stands for, or ``None``.

    Args:
      error: What running the graph raised.
      classes: The safevars errors the caller's assertions may stand for.
      note: Appended to the assertion's own text (for example where it was checked).

    Returns:
      An instance of the first of ``classes`` whose tag is in the message, carrying the
      assertion's text (up to the end of its line) and ``note``; ``None`` if the failure
      is not one of safevars' assertions.
    """
    message = getattr(error, "message", str(error))
    for error_class in classes:
        tag = f"safevars {error_class.__name__}"
        if tag in message:
            text = message[message.index(tag) + len(tag) :].split("\n")[0]
            text = text.replace("] [", " ").strip(" :[]")
            return error_class(f"{text}{note}")
    return None
