"""wrap() and as_safe_variables(): existing variables, Keras variables and models in,
SafeVariables out.

:func:`wrap` wraps one ``tf.Variable`` (or a Keras variable's backing variable); two
wraps of one variable share a lock and a version. :func:`as_safe_variables` turns the
``variables`` argument of :func:`safevars.locked`, :func:`safevars.transaction` and
:func:`safevars.snapshot` (variables, layers, models, nested structures) into
SafeVariables.
"""

from __future__ import annotations

import sys
from typing import Any

import tensorflow as tf

from safevars._validation import short
from safevars.errors import InvalidArgumentError
from safevars.variable.safe_variable import SafeVariable


def _backing(variable: Any) -> Any:
    """The ``tf.Variable`` a variable-like object stores its value in, or None."""
    if isinstance(variable, tf.Variable):
        return variable
    for attribute in ("_value", "value"):  # keras.Variable under the TensorFlow backend
        backing = getattr(variable, attribute, None)
        if isinstance(backing, tf.Variable):
            return backing
    return None


def _weights_of(obj: Any) -> list[Any] | None:
    """The variables of a Keras layer or model (``weights``) or a ``tf.Module``, or None."""
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(obj, keras.layers.Layer):
        return list(obj.weights)
    if isinstance(obj, tf.Module) and not isinstance(obj, tf.Variable):
        return list(obj.variables)
    return None


def as_safe_variables(structure: Any, argument: str) -> tuple[Any, list[SafeVariable]]:
    """``structure`` with every variable a SafeVariable and every layer its weights.

    Args:
      structure: A SafeVariable, ``tf.Variable``, ``keras.Variable``, Keras layer or
        model, ``tf.Module``, or a (nested) list, tuple or dict of them. A plain or
        Keras variable is wrapped with :func:`wrap` (so it gets the lock every other
        ``wrap`` of it shares); a layer, model or module becomes the list of its
        weights (``layer.weights``, the order of ``get_weights``/``set_weights``).
      argument: The argument's name, for error messages.

    Returns:
      The structure with those replacements, and its leaves (SafeVariables) in order.

    Raises:
      InvalidArgumentError: a leaf is something else, or the structure holds no
        variable at all (an unbuilt model has no weights yet).
    """
    if type(structure) is SafeVariable:
        return structure, [structure]

    def expand(leaf: Any) -> Any:
        weights = None if _backing(leaf) is not None else _weights_of(leaf)
        return leaf if weights is None else weights

    expanded = tf.nest.map_structure(expand, structure)
    leaves = tf.nest.flatten(expanded)
    if not leaves:
        raise InvalidArgumentError(
            f"{argument} holds no variable (an empty structure, or a Keras model that is "
            "not built yet: build it, for example by calling it once or giving it an "
            "Input, before locking or snapshotting it)."
        )
    converted = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, SafeVariable):
            converted.append(leaf)
            continue
        if _backing(leaf) is None:
            raise InvalidArgumentError(
                f"{argument}[{index}] is {type(leaf).__name__}, not a variable. Pass "
                "SafeVariables, tf.Variables or keras.Variables (wrapped on the fly with "
                "safevars.wrap), or a Keras layer or model (its weights)."
            )
        converted.append(wrap(leaf))
    return tf.nest.pack_sequence_as(expanded, converted), converted


def wrap(variable: tf.Variable | Any) -> SafeVariable:
    """Wraps an existing ``tf.Variable`` (or a Keras variable's backing variable).

    Args:
      variable: A ``tf.Variable`` (resource or distributed), a ``keras.Variable`` (its
        backing ``tf.Variable`` is wrapped; a Keras variable created inside
        :func:`safevars.scope` returns the SafeVariable it is backed by) or a
        SafeVariable (returned as is).

    Returns:
      A :class:`SafeVariable` sharing the variable's storage. Wrapping the same variable
      twice gives proxies that share one lock and one version.

    Raises:
      InvalidArgumentError: ``variable`` is not a variable.

    Thread safety: writes made through the original object (not the returned proxy) are
    neither locked nor counted.
    """
    if type(variable) is SafeVariable:
        return variable
    backing = getattr(variable, "_value", None)  # a keras.Variable made in safevars.scope()
    if type(backing) is SafeVariable:
        return backing
    if isinstance(variable, SafeVariable):
        return variable
    backing = _backing(variable)
    if isinstance(backing, SafeVariable):
        return backing  # a keras.Variable created inside safevars.scope()
    if backing is not None:
        variable = backing  # a keras.Variable under the TensorFlow backend
    if not isinstance(variable, tf.Variable):
        raise InvalidArgumentError(
            f"wrap(variable) needs a tf.Variable or keras.Variable, got {short(variable)}. "
            "To create a new variable use safevars.SafeVariable(initial_value)."
        )
    return SafeVariable._from_variable(variable)
