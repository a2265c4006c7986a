"""Scheduling: :func:`schedule` passes a token into every attempt of a step, and
:class:`ScheduledStep` says what a failed one applied and schedules it again."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.errors import InvalidArgumentError, NotCallableError
from safevars.exactly_once import state
from safevars.exactly_once.recording import _Trace, _wrapping
from safevars.exactly_once.state import _LOCK, _SECTION_BITS, _TOKENS, _USER_TOKENS, get_or_make

__all__ = ["ScheduledStep", "schedule"]


class _StepFunction:
    """The ``tf.function`` scheduled for a user's step: ``step(token, *args, **kwargs)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        python_fn = getattr(fn, "python_function", fn)
        self.name = getattr(python_fn, "__name__", repr(python_fn))
        self.key = (
            f"{getattr(python_fn, '__module__', '')}."
            f"{getattr(python_fn, '__qualname__', self.name)}"
        )
        self.python_fn = tf.autograph.to_graph(python_fn)
        self.traces: list[_Trace] = []
        signature = getattr(fn, "input_signature", None)
        if signature is not None:
            signature = [tf.TensorSpec([], tf.int64), *signature]
        self.function = tf.function(self._body, input_signature=signature, autograph=False)

    def _body(self, token: tf.Tensor, *args: Any, **kwargs: Any) -> Any:
        graph = tfi.default_graph()
        trace = _Trace(graph, token, self.name, self.key)
        with _wrapping(graph, trace.wrap):
            result = self.python_fn(*args, **kwargs)
        trace.verify()
        with _LOCK:
            self.traces.append(trace)
        return result

    def applied(self, token: int) -> tuple[int, int]:
        """(sections recorded for ``token``, sections of the trace that recorded them)."""
        with _LOCK:
            traces = [trace.sections for trace in self.traces if trace.sections]
        with tf.init_scope():
            for recorded in traces:
                found = sum(
                    int(r.table.lookup(tf.constant((token << _SECTION_BITS) + sid, tf.int64)))
                    != -1
                    for r, sid in recorded
                )
                if found:
                    return found, len(recorded)
        return 0, len(traces[0]) if traces else 0


_FUNCTIONS: weakref.WeakKeyDictionary[Any, _StepFunction] = weakref.WeakKeyDictionary()


def _step_function(fn: Callable[..., Any]) -> _StepFunction:
    return get_or_make(_FUNCTIONS, fn, lambda: _StepFunction(fn))


class ScheduledStep:
    """One call scheduled by :func:`schedule`: its token and its ``RemoteValue``.

    Attributes:
      token: The call's idempotency token (every attempt of the call carries it).
      remote_value: What ``ClusterCoordinator.schedule`` returned for this attempt.
    """

    def __init__(
        self,
        coordinator: Any,
        step: _StepFunction,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        token: int,
    ) -> None:
        self.token = token
        self._coordinator, self._step, self._args, self._kwargs = coordinator, step, args, kwargs
        self.remote_value = coordinator.schedule(
            step.function, args=(tf.constant(token, tf.int64), *args), kwargs=kwargs
        )

    def fetch(self) -> Any:
        """The step's result (blocks); raises what the step raised. See ``RemoteValue``."""
        return self.remote_value.fetch()

    def outcome(self) -> str:
        """What the step did, once it is over (blocks until then).

        Returns:
          ``"done"``: the result came back; every section applied exactly once.
          ``"applied"``: the result did not come back (``fetch()`` raises), but every
          section of the step was applied, once. ``"partly_applied"``: some were.
          ``"not_applied"``: none was (the step, or the part of it that ran, wrote
          nothing through safevars).

        Thread safety: read from the parameter servers' tables at the call. An attempt
        still running elsewhere (a worker cut off but alive) may apply more sections
        later; :meth:`reschedule` is safe in every case.

        Modes: eager, on the coordinator.
        """
        try:
            self.remote_value.fetch()
        except Exception:  # noqa: BLE001 - any failure: the tables say what happened
            found, total = self._step.applied(self.token)
        else:
            return "done"
        if found == 0:
            return "not_applied"
        return "applied" if found == total else "partly_applied"

    def reschedule(self) -> ScheduledStep:
        """Schedules the same call again with the same token.

        Sections the step already applied (in any earlier attempt) are discarded; the
        others run. Use it for steps whose ``fetch()`` raised (``CancelledError``
        after another step's error, or an error that is gone now).

        Returns:
          The new :class:`ScheduledStep` (same token).

        Raises:
          InvalidArgumentError: the token is below the watermark of
            :meth:`Tables.compact`.

        Thread safety: safe while earlier attempts may still run: every section is
        applied at most once in total.

        Modes: eager, on the coordinator.
        """
        _check_not_finished(self.token)
        return ScheduledStep(self._coordinator, self._step, self._args, self._kwargs, self.token)

    def __repr__(self) -> str:
        return f"<safevars.exactly_once.ScheduledStep {self._step.name} token={self.token}>"


def schedule(
    coordinator: Any,
    fn: Callable[..., Any],
    args: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    *,
    token: int | None = None,
) -> ScheduledStep:
    """``coordinator.schedule(fn, args, kwargs)`` whose safevars writes take effect once.

    Example::

        @tf.function
        def step(batch):
            counter.update(lambda x: x + 1.0)
            opt.apply_gradients(zip(grads_of(batch), model.trainable_variables))

        steps = [safevars.exactly_once.schedule(coordinator, step, args=(it,))
                 for _ in range(300)]
        coordinator.join()        # counter == 300, even if workers died and steps retried

    Args:
      coordinator: A ``tf.distribute.coordinator.ClusterCoordinator``.
      fn: The step: a ``tf.function`` or a Python function. Its Python code is traced
        (with AutoGraph) in a ``tf.function`` that also takes the token; pass the same
        object each time so the trace is reused.
      args: Positional arguments, as for ``ClusterCoordinator.schedule`` (per-worker
        values such as iterators included).
      kwargs: Keyword arguments, likewise.
      token: The call's idempotency key, an ``int`` in ``[0, 2**42)``; calls of ``fn``
        with the same token (and arguments of the same types and shapes) take effect
        once in all. Pass the step number, for instance, to schedule again every step
        not known to be done after the coordinator reported an error. None (the
        default) draws a new token, never equal to one you choose.

    Returns:
      A :class:`ScheduledStep` (``fetch()``, ``outcome()``, ``reschedule()``).

    Raises:
      NotCallableError: ``fn`` is not callable.
      InvalidArgumentError: ``coordinator`` has no ``schedule`` method, ``token`` is
        not an ``int`` in range, or it is below the watermark of
        :meth:`Tables.compact` (that step was declared finished).
      UnsupportedStrategyError: when the step is traced: a section inside a loop, a
        nested ``tf.function`` or an XLA-compiled function (see the module notes).
      Exception: whatever ``coordinator.schedule`` raises (an earlier step's error:
        ClusterCoordinator then cancels every queued step, this one included).

    Thread safety: each section the step traces is applied at most once over every
    attempt of every call with this token, and exactly once if a result is fetched;
    concurrent steps exclude each other through the variables' locks as usual.

    Modes: call it eagerly on the coordinator. Outside a step scheduled this way safevars
    writes work as before, at no extra cost.
    """
    if not callable(fn):
        raise NotCallableError(
            f"schedule(coordinator, fn) needs a tf.function or a function as fn, got {fn!r}."
        )
    if not callable(getattr(coordinator, "schedule", None)):
        raise InvalidArgumentError(
            f"coordinator must be a tf.distribute.coordinator.ClusterCoordinator, got "
            f"{coordinator!r}."
        )
    if token is None:
        token = next(_TOKENS)
    elif (
        isinstance(token, bool)
        or not isinstance(token, (int, np.integer))
        or not 0 <= token < _USER_TOKENS
    ):
        raise InvalidArgumentError(
            f"token must be an int in [0, 2**{_USER_TOKENS.bit_length() - 1}) (for example "
            f"the step number), got {token!r}. Pass token=None to draw one."
        )
    _check_not_finished(int(token))
    return ScheduledStep(
        coordinator, _step_function(fn), tuple(args or ()), dict(kwargs or {}), int(token)
    )


def _check_not_finished(token: int) -> None:
    """Refuses a token below the watermark :meth:`Tables.compact` set."""
    floor = state.TABLES._known_floor() if state.TABLES is not None else 0
    if token < floor:
        raise InvalidArgumentError(
            f"token {token} is below the exactly-once watermark {floor}: "
            "Tables.compact declared every step below it finished and removed their "
            "entries, so whether this one was applied is no longer known. Schedule "
            "new steps with tokens at or above the watermark."
        )
