"""ParameterServerStrategy: eager calls on the coordinator run the section in a graph.

Under ``ParameterServerStrategy`` the variables, slots, counters and their locks live on
the parameter servers. A scheduled function's ``apply_gradients`` is traced like any
other and its section runs on the parameter server. An *eager* call on the coordinator
cannot take the parameter servers' mutexes eagerly (it deadlocks), so it runs the same
section inside a ``tf.function``, cached per set of variables, and turns the run-time
assertions of the ``"raise"`` policies back into their eager errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars.errors import NonFiniteGradientError, StaleGradientError, from_assertion
from safevars.optimizer.runtime import OptimizerPart, _Step


class CoordinatorPart(OptimizerPart):
    """SafeOptimizer's part for eager calls on a ParameterServerStrategy coordinator."""

    def _safevars_coordinator_function(
        self, key: Any, make: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """The cached ``tf.function`` ``make()`` for ``key`` (built once, thread-safely)."""
        runtime = self._safevars
        fn = runtime.coordinator_fns.get(key)
        if fn is None:
            with runtime.build_lock:
                fn = runtime.coordinator_fns.get(key)
                if fn is None:
                    fn = tf.function(make(), autograph=False)
                    runtime.coordinator_fns[key] = fn
        return fn

    def _safevars_section_on_coordinator(
        self, step: _Step, strategy: tf.distribute.Strategy | None
    ) -> None:
        """An eager call under ParameterServerStrategy: the same section, in a graph.

        Taking a parameter server's mutex with an eager ``MutexLock`` from the
        coordinator while scheduled functions use it deadlocks (observed with TF 2.21),
        so the coordinator runs the section inside a ``tf.function`` traced once per set
        of variables. The ``"raise"`` policies keep their eager error types.
        """
        self._safevars_refuse_future_versions(step)
        positions = tuple(self._get_variable_index(v) for v in step.variables)
        versions: Any = None
        shape: Any = None
        if step.versions is not None:
            kind, value = step.versions
            if kind == "global":
                versions, shape = tf.constant(value, tf.int64), "global"
            else:
                versions = [None if v is None else tf.constant(v, tf.int64) for v in value]
                shape = ("each", tuple(v is None for v in value))
        key = (
            "apply",
            positions,
            tuple(step.kept),
            len(step.keras_variables),
            shape,
            strategy is not None,
        )
        template = step

        def make() -> Callable[..., Any]:
            def run(grads: list[Any], versions: Any) -> None:
                rebuilt = None
                if versions is not None and template.versions is not None:
                    rebuilt = (template.versions[0], versions)
                self._safevars_section(
                    template._replace(grads=list(grads), versions=rebuilt), strategy
                )

            return run

        fn = self._safevars_coordinator_function(key, make)
        try:
            fn(list(step.grads), versions)
        except tf.errors.InvalidArgumentError as e:
            error = from_assertion(
                e,
                (StaleGradientError, NonFiniteGradientError),
                note=" (checked on the parameter server).",
            )
            if error is not None:
                raise error from None
            raise
