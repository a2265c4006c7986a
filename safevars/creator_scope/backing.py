"""Which variables a Keras model built in :func:`safevars.scope` stores in SafeVariables.

A ``keras.Variable`` made in the scope keeps its value in a SafeVariable (its ``_value``
under the TensorFlow backend); every patch of this package starts by asking for it, and
leaves anything else to the code it wraps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from safevars.locking import Guard
from safevars.variable import SafeVariable

__all__ = ["guard_of_backing", "guards_of_backings", "safe_backing"]


def safe_backing(variable: Any) -> SafeVariable | None:
    """The SafeVariable a variable is or is backed by (a Keras variable made in a scope)."""
    if isinstance(variable, SafeVariable):
        return variable
    backing = getattr(variable, "_value", None)
    return backing if isinstance(backing, SafeVariable) else None


def guard_of_backing(variable: Any) -> Guard | None:
    """The guard of :func:`safe_backing`, or None for a variable that is not safe."""
    backing = safe_backing(variable)
    return None if backing is None else backing.guard


def guards_of_backings(variables: Iterable[Any]) -> dict[int, Guard]:
    """The distinct guards of the safe ones among ``variables``, keyed by ``id``, in the
    order of their first variable (a scope's variables share one guard)."""
    return {id(g): g for g in map(guard_of_backing, variables) if g is not None}
