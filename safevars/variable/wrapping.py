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
from safevars.errors import InvalidArgumentError, NotProtectedError
from safevars.locking import Guard
from safevars.variable.safe_variable import _GUARDS, SafeVariable


def _backing(variable: Any) -> Any:
    """The ``tf.Variable`` a variable-like object stores its value in, or None."""
    if isinstance(variable, tf.Variable):
        return variable
    for attribute in ("_value", "value"):  # keras.Variable under the TensorFlow backend
        backing = getattr(variable, attribute, None)
        if isinstance(backing, tf.Variable):
            return backing
    return None


CREATED_AT_ATTRIBUTE = "_safevars_created_at"
"""Where a plain Keras variable was created (``file:line in function``): set by
:mod:`safevars.creator_scope.marks`, read here for :class:`~safevars.NotProtectedError`."""

_SHOWN = 8  # unprotected variables a NotProtectedError names one by one


def _check_protected(layer: Any, weights: list[Any], argument: str) -> None:
    """Raises NotProtectedError if a weight of a Keras layer or model is plain."""
    plain = [w for w in weights if not isinstance(_backing(w), SafeVariable)]
    if not plain:
        return
    shown = [
        f"{getattr(w, 'path', None) or w.name} (created at "
        f"{getattr(w, CREATED_AT_ATTRIBUTE, None) or 'an unrecorded place'})"
        for w in plain[:_SHOWN]
    ]
    more = f", and {len(plain) - _SHOWN} more" if len(plain) > _SHOWN else ""
    kind = "model" if hasattr(layer, "train_function") else "layer"
    raise NotProtectedError(
        f"{argument}: {kind} {layer.name!r} has {len(plain)} of its {len(weights)} weights "
        "unprotected (plain tf.Variables: Keras' writes of them take no safevars lock and "
        f"count no version, so this would guarantee nothing): {', '.join(shown)}{more}. "
        f"Protect the {kind} once, before sharing it: safevars.protect({kind}) (or build it "
        "inside safevars.scope()). To lock or read those variables anyway, pass them "
        f"explicitly ({kind}.weights): they are then wrapped on the fly."
    )


def _weights_of(obj: Any, argument: str = "structure") -> list[Any] | None:
    """The variables of a Keras layer or model (``weights``) or a ``tf.Module``, or None.

    Raises:
      NotProtectedError: a Keras layer or model with a weight that is not protected.
    """
    keras = sys.modules.get("keras")
    if keras is not None and isinstance(obj, keras.layers.Layer):
        weights = list(obj.weights)
        _check_protected(obj, weights, argument)
        return weights
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
      NotProtectedError: a Keras layer or model in it has weights that are not
        protected (built outside ``safevars.scope()`` and not ``safevars.protect`` -ed).
    """
    if type(structure) is SafeVariable:
        return structure, [structure]
    if type(structure) in (list, tuple) and all(type(v) is SafeVariable for v in structure):
        # The common case (``locked(a, b)``), without ``tf.nest``: besides its cost, a
        # Ctrl-C landing in its C code can come out as another error (seen once with
        # TensorFlow 2.21: an interrupt inside ``IsTypeSpec``'s import became a
        # ``SystemError``, then an ``AttributeError``), not a ``KeyboardInterrupt``.
        if structure:
            return structure, list(structure)

    def expand(leaf: Any) -> Any:
        weights = None if _backing(leaf) is not None else _weights_of(leaf, argument)
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


def existing_guard(variable: tf.Variable) -> Guard | None:
    """The guard of a ``tf.Variable`` wrapped before (by :func:`wrap`, a SafeOptimizer
    step or ``safevars.locked``), or None: a new wrap then makes one."""
    return _GUARDS.get(id(variable))


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
