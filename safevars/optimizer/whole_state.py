"""Keras' calls on the whole optimizer state, run under every lock of the optimizer.

``set_weights``, the saving hooks (``save_own_variables`` / ``load_own_variables``) and
EMA's ``finalize_variable_values`` read or write every variable at once: eagerly they
hold all of the optimizer's locks, so they never see or leave half of an update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from safevars.locking import Guard, hold
from safevars.optimizer.runtime import OptimizerPart
from safevars.optimizer.validation import for_keras


class WholeStatePart(OptimizerPart):
    """SafeOptimizer's part for Keras' whole-state calls."""

    def _safevars_all_guards(self) -> list[Guard]:
        """Every guard of the optimizer, for eager whole-state calls (none before build).

        None on parameter servers: the coordinator cannot take their mutexes eagerly
        (see :meth:`_safevars_section_on_coordinator`); Keras' own calls run unlocked.
        """
        runtime = self._safevars
        if not runtime.ready or self._safevars_on_parameter_servers():
            return []
        return runtime.guards + runtime.fixed_guards

    def finalize_variable_values(self, var_list: Sequence[Any]) -> None:
        """Keras' ``finalize_variable_values`` (EMA), under the optimizer's locks.

        Thread safety: atomic with respect to ``apply_gradients`` (eagerly).

        Modes: Keras calls it eagerly at the end of ``fit``; in a graph, no lock.
        """
        variables = [for_keras(v) for v in var_list]
        if tf.executing_eagerly():
            with hold(self._safevars_all_guards()):
                super().finalize_variable_values(variables)
        else:
            super().finalize_variable_values(variables)

    def set_weights(self, weights: Sequence[Any]) -> None:
        """Keras' ``set_weights`` (the layout of :attr:`variables`), under the locks.

        Thread safety: atomic with respect to ``apply_gradients`` (eagerly).

        Modes: eager.
        """
        with hold(self._safevars_all_guards()):
            super().set_weights(weights)

    def save_own_variables(self, store: Any) -> None:
        """Keras' saving hook: the optimizer's variables, read under the locks."""
        with hold(self._safevars_all_guards()):
            super().save_own_variables(store)

    def load_own_variables(self, store: Any) -> None:
        """Keras' loading hook: the optimizer's variables, written under the locks."""
        with hold(self._safevars_all_guards()):
            super().load_own_variables(store)
