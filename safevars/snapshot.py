"""``safevars.snapshot``: variables, layers and models read together, at one instant.

:func:`snapshot` takes plain and Keras variables (wrapped on the fly with
:func:`safevars.wrap`) and Keras layers and models: ``safevars.snapshot(model)`` is the
list of snapshots of ``model.weights``, which ``other_model.set_weights`` accepts as it
is (a :class:`Snapshot` has ``shape`` and ``dtype`` and converts to a tensor and to NumPy).
How a snapshot is read (optimistically, or under the locks) is
:mod:`safevars.variable.snapshots`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars.errors import InvalidArgumentError
from safevars.locking import check_timeout, guards_of
from safevars.variable import SafeVariable, as_safe_variables
from safevars.variable.snapshots import Snapshot, scope_weights, take_snapshots

__all__ = ["Snapshot", "snapshot"]


def snapshot(structure: Any, timeout: float | None = None) -> Any:
    """Snapshots of variables, layers or models, all taken at one instant.

    Example::

        snaps = safevars.snapshot(model)      # one Snapshot per model.weights entry
        serving_model.set_weights(snaps)      # a consistent copy, while training goes on

    Args:
      structure: A SafeVariable, ``tf.Variable``, ``keras.Variable``, Keras layer or
        model, ``tf.Module``, or a (nested) list, tuple or dict of them. Plain and Keras
        variables are wrapped with :func:`safevars.wrap` (the lock every ``wrap`` of them
        shares); a layer, model or module stands for the list of its weights
        (``layer.weights``, in the order of ``get_weights``/``set_weights``).
      timeout: Eagerly, seconds to wait at most when a writer holds a lock (None: no
        limit).

    Returns:
      The same structure with a :class:`Snapshot` in place of each variable, and a list
      of snapshots in place of each layer, model or module.

    Raises:
      InvalidArgumentError: a leaf is not a variable, layer or module, or the structure
        holds no variable (an empty list, an unbuilt model).
      LockTimeoutError: a writer held a lock longer than ``timeout``.

    Thread safety: the snapshots are consistent with every ``safevars.transaction`` and
    ``safevars.locked`` section on those variables, and with every
    :class:`~safevars.SafeOptimizer` step: a section is seen whole or not at all.
    Eagerly, with no writer in, readers take no lock and never wait; with a writer in, a
    snapshot takes the locks as a locked read does, and a snapshot waiting for a lock is
    let in before a thread that enters it next: under a writer that never pauses, each
    snapshot waits for about one of its sections (a locked read races for the lock as
    ``threading.Lock`` waiters do). Writes that bypass safevars (through a plain variable
    that was wrapped on the fly) are not excluded.

    Modes: in a ``tf.function``, values and versions are tensors read inside the
    variables' critical sections, taken in the global lock order.
    """
    timeout = check_timeout(timeout)
    if type(structure) is list and structure:  # The common case, without tf.nest.
        if all(type(v) is SafeVariable for v in structure):
            return take_snapshots(structure, timeout, guards_of(structure, "structure"))
    weights = scope_weights(structure)  # A model built in safevars.scope(), without tf.nest.
    if weights is not None:
        return take_snapshots(weights, timeout, guards_of(weights, "structure"))
    if isinstance(structure, (list, tuple, dict)) and not structure:
        raise InvalidArgumentError(
            "snapshot(structure) needs at least one variable, got an empty structure."
        )
    converted, leaves = as_safe_variables(structure, "structure")
    snaps = take_snapshots(leaves, timeout, guards_of(leaves, "structure"))
    return tf.nest.pack_sequence_as(converted, snaps)
