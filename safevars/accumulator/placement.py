"""Where a GradientAccumulator's state lives, and how calls reach it.

The state (and its critical section) lives with the first variable. Under
``ParameterServerStrategy`` it must live where every worker reaches it: the first
variable's parameter server, else ``/job:ps/task:0`` (:func:`_state_device`); functions
scheduled on any worker then add to it under one lock, and the coordinator's eager
calls run as ``tf.function`` calls whose critical section executes on the parameter server
too (:meth:`_Placement._run_remote`). Which strategies are supported at all is
:mod:`safevars.distribute`'s; contributions from replicas are :mod:`.replicas`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars.accumulator.state import _AccumulatorBase, _Part
from safevars.distribute import (
    SUPPORTED_STRATEGIES,
    check_strategy,
    is_parameter_server,
    on_parameter_server,
)
from safevars.errors import (
    AccumulatorFullError,
    AccumulatorTimeoutError,
    InvalidArgumentError,
    NonFiniteGradientError,
    StaleGradientError,
    UnsupportedStrategyError,
    from_assertion,
)

# The errors the run-time assertions of the graph path stand for (errors.assertion_text).
_RUNTIME_ERRORS = (
    AccumulatorFullError,
    StaleGradientError,
    NonFiniteGradientError,
    AccumulatorTimeoutError,
    InvalidArgumentError,
)


class _Placement(_AccumulatorBase):
    """The strategy check and the coordinator's way to state on a parameter server."""

    def _strategy(self) -> tf.distribute.Strategy | None:
        """The current strategy (None outside any), checked for this accumulator.

        Raises:
          UnsupportedStrategyError: the strategy is not supported, or it is a
            ``ParameterServerStrategy`` and the state is not on a parameter server.
        """
        if not tf.distribute.has_strategy():
            return None
        strategy = check_strategy()
        if is_parameter_server(strategy) and not on_parameter_server(self._state.device):
            raise UnsupportedStrategyError(
                f"GradientAccumulator {self.name!r} keeps its state on "
                f"{self._state.device or 'this process'}, which ParameterServerStrategy "
                "workers cannot reach. Create it in strategy.scope() on the coordinator "
                "(or for variables that live on a parameter server): its state then "
                "lives on a parameter server, where every worker adds to it under one "
                f"lock. Supported: {', '.join(SUPPORTED_STRATEGIES)}."
            )
        return strategy

    def _run_remote(self, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs ``fn(*args)`` as a ``tf.function``: how eager calls reach state on a PS.

        The coordinator cannot take a parameter server's mutex eagerly (a ``MutexLock``
        sent from the coordinator while scheduled steps take the same mutex was seen to
        hang; :class:`~safevars.locking.Guard` refuses it), so it runs the graph path,
        whose critical section executes on the parameter server like the workers'. The
        run-time checks of that path come back as the safevars errors they name.
        """
        functions = self._helpers.remote_functions
        function = functions.get(key)
        if function is None:
            function = functions.setdefault(
                key, tf.function(fn, autograph=False, reduce_retracing=True)
            )
        try:
            return function(*args)
        except tf.errors.InvalidArgumentError as e:
            error = from_assertion(
                e,
                _RUNTIME_ERRORS,
                note=" (checked on the parameter server; nothing of the call took effect).",
            )
            if error is not None:
                raise error from None
            raise


def _state_device(first: Any) -> str:
    """Where the state lives: with the first variable, or on a parameter server.

    Under ``ParameterServerStrategy`` (created in its scope, or for variables on a
    parameter server) the state must be where every worker reaches it: the first
    variable's parameter server, else ``/job:ps/task:0``.
    """
    device = getattr(first, "device", "") or ""
    if on_parameter_server(device):
        return device
    if tf.distribute.has_strategy() and is_parameter_server(tf.distribute.get_strategy()):
        return "/job:ps/replica:0/task:0/device:CPU:0"
    return device


def _as_tensors(parts: list[_Part]) -> list[tuple]:
    """Eager parts as tensors, to pass to a ``tf.function`` (Python values would make
    it retrace for every new version number)."""
    out = []
    for part in parts:
        finite = (
            part.finite if isinstance(part.finite, tf.Tensor) else tf.constant(bool(part.finite))
        )
        version = part.version
        if part.version_kind == "int":
            version = tf.constant(version, tf.int64)
        elif part.version_kind == "each":
            version = tuple(tf.constant(v, tf.int64) for v in version)
        out.append((part.elements, part.values, finite, part.version_kind, version))
    return out
