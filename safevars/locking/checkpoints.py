"""Checkpoints that are states which existed: saving and restoring under the locks.

A checkpoint reads its variables one after another. Without care, a checkpoint taken
while threads run ``safevars.transaction([a, b], move)`` can hold ``a`` from before a
transaction and ``b`` from after it (a sum invariant broken: measured 986-997 instead of
1,000 in 4 of 4 runs), or a value with the version of a neighbouring write.

safevars therefore makes the savers take the locks of what they save:

* ``tf.train.Checkpoint`` (``save``, ``write``, ``restore``, ``read``, and
  ``tf.train.CheckpointManager``, which call them): the object graph is walked, the
  guards of every protected variable in it are found (SafeVariables, their version
  variables, and state registered with :func:`safevars.locking.protect`, such as a
  ``GradientAccumulator``'s), and all their locks are held, in the global order, while
  the values are read and written (save) or assigned (restore).
* Keras ``model.save`` / ``model.save_weights`` / ``model.load_weights`` (the
  ``.keras`` and ``.weights.h5`` formats): the same for the model's and its optimizer's
  variables.

Consequences, documented in docs/guide/locks.md:

* A save waits for the sections in progress on those variables, and writers wait for
  the save (including its file I/O) to finish.
* A restore is one section over everything it restores: a concurrent reader sees all
  of the old state or all of the restored one, and a concurrent writer's update lands
  either before the restore (and is overwritten) or after it (and applies to the
  restored values); versions follow the values they were saved with.

NOTES:
  Variables on parameter servers that are in run-time mode are not locked by a save
  from the coordinator (an eager lock there cannot be taken safely; see
  :mod:`safevars.locking`): call ``ClusterCoordinator.join()`` before saving.
  Restorations deferred until a variable is created happen when it is created, under
  its own lock.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from safevars import _tf_internal as tfi
from safevars.distribute import on_parameter_server
from safevars.locking.guard import Guard, guard_of
from safevars.locking.holding import hold

__all__ = ["guards_in", "install"]


def guards_in(objects: Iterable[Any]) -> list[Guard]:
    """The guards of every protected variable among ``objects`` (distinct)."""
    found: dict[int, Guard] = {}
    for obj in objects:
        for candidate in (obj, getattr(obj, "value", None)):  # keras.Variable -> tf
            guard = guard_of(candidate) if candidate is not None else None
            if guard is not None:
                found[id(guard)] = guard
                break
    return [
        g for g in found.values() if not (g.lock.mutexed and on_parameter_server(g.lock.device))
    ]


def _holding(find: Callable[..., Iterable[Any]]) -> Callable[[Any], Any]:
    """Decorator factory: run the wrapped method holding the guards ``find`` returns."""

    def decorate(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def locked_io(*args: Any, **kwargs: Any) -> Any:
            if not tfi.executing_eagerly():
                return original(*args, **kwargs)
            guards = guards_in(find(*args, **kwargs))
            if not guards:
                return original(*args, **kwargs)
            with hold(guards):
                return original(*args, **kwargs)

        locked_io._safevars_checkpointing = True  # type: ignore[attr-defined]
        return locked_io

    return decorate


def _checkpoint_objects(saver: Any, *args: Any, **kwargs: Any) -> list[Any]:
    objects, _ = saver._graph_view.breadth_first_traversal()
    return list(objects)


def _keras_objects(model: Any, *args: Any, **kwargs: Any) -> list[Any]:
    objects = list(getattr(model, "variables", []))
    optimizer = getattr(model, "optimizer", None)
    objects.extend(getattr(optimizer, "variables", []) or [])
    return objects


def install() -> None:
    """Wraps TensorFlow's and Keras' savers once (idempotent)."""
    for owner, name, find in tfi.checkpoint_entry_points(_checkpoint_objects, _keras_objects):
        current = getattr(owner, name)
        if not getattr(current, "_safevars_checkpointing", False):
            setattr(owner, name, _holding(find)(current))


install()
