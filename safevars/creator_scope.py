"""``safevars.scope()``: every variable created inside is a SafeVariable, Keras' included.

The problem: real training code does not create its variables, Keras layers and
optimizers do. Wrapping each weight by hand misses the optimizer's slots, and writes that
Keras makes on the underlying ``tf.Variable`` (its optimizers update each replica's copy
of a mirrored variable through ``strategy.extended.update``) bypass a SafeVariable's lock
and version even when the weight itself is wrapped.

The fix, in three parts:

* :func:`scope` is a variable-creator scope (``tf.variable_creator_scope``) that wraps
  every ``tf.Variable`` created inside in a :class:`~safevars.SafeVariable`. A
  ``keras.Variable`` keeps its value in such a ``tf.Variable``, so a model built inside
  has SafeVariable-backed weights: ``layer.kernel.assign``, ``model.set_weights``,
  ``model.load_weights`` and every write Keras makes through ``variable.value`` go
  through the lock and count one version. The scope's creator runs before the one of a
  ``tf.distribute`` strategy whichever is entered first, so under ``MirroredStrategy`` it
  wraps the mirrored variable, not each replica's copy.
* ``tf.distribute.StrategyExtended.update(var, fn)`` on a SafeVariable (how Keras'
  optimizers write, with or without a strategy) runs as one critical section over the
  variable and its optimizer slots and counts **one** version per variable it wrote,
  however many replica copies ``fn`` touched.
* A Keras optimizer slot made for a SafeVariable-backed weight
  (``add_variable_from_reference``) is itself made safe, even when the optimizer is built
  outside the scope (Keras builds it in the first ``fit`` step); and
  ``keras.Variable.assign_add``/``assign_sub`` on a SafeVariable-backed variable (metrics,
  ``iterations``), which Keras implements as a read followed by an ``assign``, become one
  atomic :meth:`~safevars.SafeVariable.update` with Keras' own arithmetic.

The last two are patches of TensorFlow's and Keras' classes, installed when this module
is imported (with ``safevars``), as :mod:`safevars.sections` patches compiled calls; they
change nothing for variables that are not SafeVariables. A SafeVariable made by hand
(``safevars.SafeVariable`` or ``safevars.wrap``) benefits too: a plain Keras optimizer's
update of it under ``MirroredStrategy`` is locked and counted once, and its slots are safe.

What a version counts: one per ``assign*``/``scatter_*``/``update`` through the variable,
one per ``strategy.extended.update`` of it (a plain optimizer's step: AdamW's weight decay
is a second update, so 2 per step there), one per :class:`~safevars.SafeOptimizer` step.

NOTES:
  What is *not* covered:

  * Variables created outside the scope. Build the model inside it (a model whose
    weights are created lazily by its first call in ``fit`` gets plain weights: give it
    an ``Input`` or call ``model.build`` inside the scope). Create the optimizer inside
    it too if its ``iterations`` and learning rate are to be safe; its slots are safe
    either way.
  * Writes made directly on a replica's copy of a mirrored variable
    (``v.values[0].assign(...)``) or through ``v.__wrapped__``.
  * A plain optimizer updates one variable per critical section: a snapshot of several
    weights may fall between two of them. Use :class:`~safevars.SafeOptimizer` to make a
    whole step one section.
  * Under a strategy, a sync-on-read variable (Keras metrics) is written per replica:
    each replica's write of its own copy counts one version.
  * A SavedModel loaded inside the scope (``tf.saved_model.load``, Keras'
    ``TFSMLayer``): the variables the loader recreates are SafeVariables, so writes made
    through them (a Keras optimizer fine-tuning a ``TFSMLayer``) are locked and counted,
    and each version starts at 0 (a SavedModel holds none). The *loaded functions*,
    though, write through the handles they captured when they were saved: those writes
    take neither these variables' locks nor their versions (functions saved from
    safevars objects keep their own locks among themselves).

Tested with TensorFlow 2.21 and Keras 3.15.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from safevars._tf_internal import saved_model_loader
from safevars.distribute import check_strategy, merge_context
from safevars.locking import Guard, hold
from safevars.locking.saved_model import restores_without_versions, restoring_saved_model
from safevars.sections import graph_section
from safevars.variable import SafeVariable, _writes_to_count, writes_counted_by_caller

__all__ = ["scope"]

# Creators with a higher priority run first; a strategy's scope and the public
# tf.variable_creator_scope use 100, tf.function's variable lifting 50. Running first,
# the scope's creator wraps what the strategy's creator returns (the mirrored variable).
_PRIORITY = 200


def _creator(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
    check_strategy()  # as SafeVariable(...) does: an unsupported strategy entered inside
    variable = next_creator(**kwargs)
    if isinstance(variable, SafeVariable) or not isinstance(variable, tf.Variable):
        return variable  # an enclosing safevars.scope() wrapped it already
    return SafeVariable._from_variable(variable)


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Makes every variable created inside a :class:`~safevars.SafeVariable`.

    Example::

        strategy = tf.distribute.MirroredStrategy()      # optional
        with strategy.scope(), safevars.scope():
            model = make_model()                          # weights: SafeVariable-backed
            model.compile(optimizer=safevars.SafeOptimizer(keras.optimizers.Adam()),
                          loss="mse", jit_compile=False)
        model.fit(x, y)                                   # every write locked, counted
        snaps = safevars.snapshot(model)                  # from any thread, meanwhile
        serving_model.set_weights(snaps)

    Keras variables created inside keep being ``keras.Variable`` s (their class, path,
    dtype policy, saving format); the ``tf.Variable`` each stores its value in is a
    SafeVariable, so ``safevars.wrap(layer.kernel)`` returns it and
    ``safevars.snapshot(model)``, ``safevars.locked(model)`` and
    ``safevars.transaction(model, fn)`` use its lock and version.

    Thread safety: the scope applies to the calling thread (and to ``tf.function`` s it
    traces inside the block); the variables it creates may then be shared with any
    thread. Scopes nest (a variable is wrapped once).

    Modes: eager and inside ``tf.function`` (variables created while tracing are
    wrapped too). Under ``tf.distribute``, enter it inside or outside
    ``strategy.scope()``: the strategy's variable is wrapped, not its components.
    Unsupported strategies raise :class:`~safevars.UnsupportedStrategyError` when a
    variable is created.

    Raises:
      UnsupportedStrategyError: on entry, under a strategy safevars does not support.
    """
    check_strategy()
    install()
    graph = tf.compat.v1.get_default_graph()
    with graph._variable_creator_scope(_creator, priority=_PRIORITY):  # noqa: SLF001
        yield


# ---------------------------------------------------------------------- optimizer slots

# Guard of a weight -> guards of the optimizer variables made for it (slots, Keras'
# gradient accumulators, EMA copies), which the weight's updates lock with it.
_SLOTS: weakref.WeakKeyDictionary[Guard, weakref.WeakSet[Guard]] = weakref.WeakKeyDictionary()
_SLOTS_LOCK = threading.Lock()


def _safe_backing(variable: Any) -> SafeVariable | None:
    """The SafeVariable a variable is or is backed by (a Keras variable made in a scope)."""
    if isinstance(variable, SafeVariable):
        return variable
    backing = getattr(variable, "_value", None)
    return backing if isinstance(backing, SafeVariable) else None


def _slots_of(guard: Guard) -> list[Guard]:
    with _SLOTS_LOCK:
        return list(_SLOTS.get(guard, ()))


def _add_variable_from_reference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``Optimizer.add_variable_from_reference``: a slot of a safe weight is
    created inside :func:`scope` and recorded as the weight's."""

    def add_variable_from_reference(
        self: Any, reference_variable: Any, *args: Any, **kwargs: Any
    ) -> Any:
        reference = _safe_backing(reference_variable)
        if reference is None:
            return original(self, reference_variable, *args, **kwargs)
        with scope():
            slot = original(self, reference_variable, *args, **kwargs)
        safe = _safe_backing(slot)
        if safe is not None:
            with _SLOTS_LOCK:
                _SLOTS.setdefault(reference.guard, weakref.WeakSet()).add(safe.guard)
        return slot

    add_variable_from_reference.__wrapped__ = original  # type: ignore[attr-defined]
    add_variable_from_reference._safevars = True  # type: ignore[attr-defined]
    return add_variable_from_reference


# ---------------------------------------------------------------------- strategy updates


def _cross_replica() -> bool:
    """Whether ``StrategyExtended.update`` runs its update here (not via a merge_call)."""
    return not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context()


def locked_update(guards: Sequence[Guard], call: Callable[[], Any]) -> Any:
    """Runs ``call()`` (one logical update of ``guards[0]``'s variable) as one critical
    section over ``guards`` and counts one version per variable it wrote.

    ``guards[0]`` (the updated variable, whose replica copies ``call`` may write
    directly) is counted always; each other guard if ``call`` wrote it through its
    SafeVariable. A guard that an enclosing :func:`~safevars.variable.
    writes_counted_by_caller` counts (a :class:`~safevars.SafeOptimizer` step) is left
    to it.

    Thread safety: atomic with respect to every safevars operation on the variables.

    Modes: eagerly under the locks; in a ``tf.function`` inside their mutexes, the
    versions added once every op ``call`` created has run.
    """
    guards = list(guards)

    def counts(written: set[Guard]) -> list[tuple[Guard, int]]:
        named = [guards[0], *(g for g in guards[1:] if g in written)]
        return [(g, n) for g in named if (n := _writes_to_count(g, 1))]

    if tf.executing_eagerly():
        with hold(guards):
            with writes_counted_by_caller(guards) as written:
                result = call()
            for guard, n in counts(written):
                guard.bump_eager(n)
        return result

    def body() -> Any:
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        with writes_counted_by_caller(guards) as written:
            result = call()
        with tf.control_dependencies(graph.get_operations()[first:]):
            done = tf.no_op(name="safevars_update_done")
        for guard, n in counts(written):
            guard.bump_graph(done, n)
        return result

    return graph_section(guards, body)


def _update_under_lock(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``tf.distribute.StrategyExtended.update`` for SafeVariables."""

    def update(
        self: Any,
        var: Any,
        fn: Callable[..., Any],
        args: Any = (),
        kwargs: Any = None,
        group: bool = True,
    ) -> Any:
        guard = getattr(var, "_self_guard", None)
        if not isinstance(guard, Guard) or not _cross_replica():
            return original(self, var, fn, args, kwargs, group)
        return locked_update(
            [guard, *_slots_of(guard)], lambda: original(self, var, fn, args, kwargs, group)
        )

    update.__wrapped__ = original  # type: ignore[attr-defined]
    update._safevars = True  # type: ignore[attr-defined]
    return update


# ---------------------------------------------------------------------- Keras RMW writes


def _keras_read_modify_write(original: Callable[..., Any], op_name: str) -> Callable[..., Any]:
    """Wraps ``keras.Variable.assign_add``/``assign_sub`` (a read, then ``assign``): on a
    SafeVariable-backed variable, one atomic ``update`` with Keras' own arithmetic."""

    def method(self: Any, value: Any) -> Any:
        backing = getattr(self, "_value", None)
        if not isinstance(backing, SafeVariable) or _keras_internal.in_stateless_scope():
            return original(self, value)
        if backing._self_mirrored and merge_context(backing.__wrapped__) is not None:
            # Inside strategy.run the write is merged by the variable's aggregation, as
            # Keras' own assign does; keep its semantics (locked and counted already).
            return original(self, value)
        combine = getattr(_keras_internal.ops, op_name)

        def fn(current: tf.Tensor) -> tf.Tensor:
            new = combine(self._maybe_autocast(current), value)  # Keras' self + value
            new = self._convert_to_tensor(new, dtype=self._dtype)
            return tf.cast(new, backing.dtype)  # as Keras' _direct_assign

        return backing.update(fn)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method._safevars = True  # type: ignore[attr-defined]
    return method


# ---------------------------------------------------------------------- installing


class _KerasInternal:
    """The Keras classes and functions the patches reach (Keras 3, TensorFlow backend)."""

    def __init__(self) -> None:
        import keras

        from safevars._tf_internal import keras_internal

        self.ops = keras.ops
        self.in_stateless_scope = keras_internal(
            "backend.common.stateless_scope"
        ).in_stateless_scope
        self.variable_class = keras_internal("backend.tensorflow.core").Variable
        self.optimizer_class = keras_internal("backend.tensorflow.optimizer").TFOptimizer


_keras_internal: Any = None
_INSTALL_LOCK = threading.Lock()


def _keras_checkpoint_children(original: Callable[..., Any]) -> Callable[..., Any]:
    """A SafeVariable-backed ``keras.Variable`` checkpoints its version, as a SafeVariable does.

    Keras' variable saves and restores its value through the ``tf.Variable`` it holds, but
    ``tf.train.Checkpoint`` asks the Keras variable, not that ``tf.Variable``, for its
    dependencies: without this, a restore brought the value back and left the version
    where it was.
    """

    def _trackable_children(self: Any, save_type: str = "checkpoint", **kwargs: Any) -> Any:
        children = original(self, save_type, **kwargs)
        guard = getattr(getattr(self, "_value", None), "_self_guard", None)
        if not isinstance(guard, Guard) or save_type != "checkpoint" or restoring_saved_model():
            return children
        guard.sync_version_var()
        return {**children, "safevars_version": guard.version_var}

    _trackable_children._safevars = True  # type: ignore[attr-defined]
    return _trackable_children


def _patch(
    owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    current = getattr(owner, name)  # may be inherited: the patch then overrides it on owner
    if not getattr(current, "_safevars", False):
        setattr(owner, name, make(current))


def install() -> None:
    """Installs the patches of TensorFlow's and Keras' classes (idempotent).

    Called at import and by :func:`scope`; without Keras, only the
    ``StrategyExtended.update`` one.
    """
    global _keras_internal
    with _INSTALL_LOCK:
        _patch(tf.distribute.StrategyExtended, "update", _update_under_lock)
        _patch(saved_model_loader(), "_restore_checkpoint", restores_without_versions)
        if _keras_internal is not None:
            return
        try:
            internal = _KerasInternal()
        except ImportError:  # pragma: no cover - Keras is not installed
            return
        _patch(
            internal.optimizer_class, "add_variable_from_reference", _add_variable_from_reference
        )
        _patch(
            internal.variable_class,
            "assign_add",
            lambda original: _keras_read_modify_write(original, "add"),
        )
        _patch(
            internal.variable_class,
            "assign_sub",
            lambda original: _keras_read_modify_write(original, "subtract"),
        )
        _patch(internal.variable_class, "_trackable_children", _keras_checkpoint_children)
        _keras_internal = internal


install()
