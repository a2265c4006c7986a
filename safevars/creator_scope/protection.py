"""``safevars.protect``: the model you already have, protected in place; and the check.

A Keras model built outside :func:`safevars.scope` has plain ``tf.Variable`` s: its
writes take no lock and count no version, and a thread reading it may see half a step.
:func:`protect` turns it (or an optimizer, a metric, a layer, variables, or a list of
them) into what the scope would have built: every Keras variable it owns (weights,
optimizer variables, metric variables) keeps its ``tf.Variable`` but is backed by a
SafeVariable under one lock (the same storage, so values and optimizer state are
untouched), its layers, optimizer and metrics are marked so the variables they create
later join that lock (:mod:`~safevars.creator_scope.marks`), and the functions Keras
traced over the plain variables are traced again.

:func:`is_protected` and :func:`unprotected_variables` say whether something is protected
and which of its variables are not, with where each was created.

Keras' training entry points (``compile``, ``fit``, ``train_on_batch``, ``evaluate``,
``test_on_batch``, ``predict``, ``predict_on_batch``) are patched
(:func:`protecting_entry`): called inside a scope block on a model that is not
protected, they protect it under that block first (without this, the optimizer and
metric variables Keras made there were safe and the weights plain); on a protected model
they first protect whatever it owns that is still plain (the optimizer a ``compile``
outside the block was given), and run with the model's block *entered*
(:func:`~safevars.creator_scope.marks.entered`): the Keras objects made during the call
(the compiled metrics Keras builds at the first step) belong to the block, and the
variables they create join its lock. ``*_on_batch`` calls do that only while their
traced function is still to be made (nothing is created after).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from safevars.creator_scope.creators import ScopeLocks, current_block
from safevars.creator_scope.keras_classes import keras_classes
from safevars.creator_scope.marks import block_of, created_at, entered, mark
from safevars.creator_scope.optimizer_steps import forget_step_guards, traced_by_user
from safevars.creator_scope.slots import record_built_slots
from safevars.errors import InvalidArgumentError, LockReentryError
from safevars.locking import _guards_of_lock, share_lock
from safevars.variable import SafeVariable
from safevars.variable.wrapping import existing_guard

__all__ = [
    "UnprotectedVariable",
    "is_protected",
    "protect",
    "protecting_entry",
    "unprotected_variables",
]

_NOT_RECORDED = (
    "not recorded (made before safevars was imported, or a tf.Variable made outside Keras)"
)
_PROTECT_LOCK = threading.RLock()  # protect() of one model from two threads: one at a time
_FUNCTIONS = ("train_function", "test_function", "predict_function")


class UnprotectedVariable(NamedTuple):
    """A variable whose writes take no safevars lock and count no version.

    Attributes:
      path: The Keras path of the variable (``"sequential/dense/kernel"``, an optimizer
        slot's ``"adam/sequential_dense_kernel_momentum"``), or a ``tf.Variable`` 's name.
      created_at: Where it was created: ``"file.py:12 in build"``, the first line outside
        Keras, TensorFlow and safevars, or why that is not known.
      variable: The variable itself.
    """

    path: str
    created_at: str
    variable: Any


class _Found:
    """What a structure holds: the Keras objects to mark, the variables to protect, and
    the Keras models among them (whose traced functions are reset)."""

    __slots__ = ("owners", "variables", "models", "optimizers")

    def __init__(self) -> None:
        self.owners: list[Any] = []
        self.variables: list[Any] = []
        self.models: list[Any] = []
        self.optimizers: list[Any] = []


def _is_keras_variable(obj: Any) -> bool:
    keras = keras_classes()
    return keras is not None and isinstance(obj, keras.variable_class)


def _add_optimizer(found: _Found, optimizer: Any) -> None:
    while optimizer is not None and optimizer not in found.optimizers:
        found.optimizers.append(optimizer)
        found.owners.append(optimizer)
        found.variables.extend(optimizer.variables)
        optimizer = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer


def _collect(structure: Any, argument: str) -> _Found:
    """Every Keras object and variable of ``structure``, or InvalidArgumentError."""
    keras = keras_classes()
    found = _Found()
    for index, leaf in enumerate(tf.nest.flatten(structure)):
        if keras is not None and isinstance(leaf, keras.layer_class):
            layers = list(leaf._flatten_layers(include_self=True, recursive=True))
            found.owners.extend(layers)
            found.variables.extend(leaf.variables)
            found.variables.extend(getattr(leaf, "metrics_variables", ()))
            for metric in getattr(leaf, "metrics", ()):
                found.owners.append(metric)
            if hasattr(leaf, "train_function"):  # a Keras model (a Trainer)
                found.models.append(leaf)
                _add_optimizer(found, getattr(leaf, "optimizer", None))
        elif keras is not None and isinstance(leaf, keras.base_optimizer_class):
            _add_optimizer(found, leaf)
        elif keras is not None and isinstance(leaf, keras.metric_class):
            found.owners.append(leaf)
            found.variables.extend(leaf.variables)
        elif isinstance(leaf, tf.Variable) or _is_keras_variable(leaf):
            found.variables.append(leaf)
        else:
            where = argument if structure is leaf else f"{argument}[{index}]"
            raise InvalidArgumentError(
                f"{where} is {type(leaf).__name__}, which safevars cannot protect. Pass a "
                "Keras model, layer, optimizer or metric, a tf.Variable or keras.Variable, "
                "or a (nested) list, tuple or dict of them."
            )
    unique = {id(v): v for v in found.variables}
    found.variables = list(unique.values())
    found.owners = list({id(o): o for o in found.owners}.values())
    return found


def _plain_backing(variable: Any) -> tf.Variable | None:
    """The plain ``tf.Variable`` behind ``variable``, None if it is protected."""
    if isinstance(variable, SafeVariable):
        return None
    backing = variable.__dict__.get("_value") if _is_keras_variable(variable) else variable
    if isinstance(backing, SafeVariable) or not isinstance(backing, tf.Variable):
        return None  # a SafeVariable-backed Keras variable, or one not initialized yet
    return backing


def unprotected_variables(structure: Any) -> list[UnprotectedVariable]:
    """The variables of ``structure`` that are not protected, with where each was made.

    Example::

        for gap in safevars.unprotected_variables(model):
            print(gap.path, "created at", gap.created_at)

    Args:
      structure: A Keras model, layer, optimizer or metric (every variable it owns: for
        a model its weights, seed states, metrics' and optimizer's variables), a
        ``tf.Variable``, ``keras.Variable`` or SafeVariable, or a (nested) list, tuple or
        dict of them.

    Returns:
      One :class:`UnprotectedVariable` per variable that is neither a SafeVariable nor
      a Keras variable backed by one, in the order of ``model.variables``, then the
      metrics' and the optimizer's.

    Raises:
      InvalidArgumentError: a leaf is something else.

    Thread safety: reads the objects as they are; variables created meanwhile may be
    missed.

    Modes: eager and inside ``tf.function`` (it reads Python objects only).
    """
    gaps = []
    for variable in _collect(structure, "structure").variables:
        if _plain_backing(variable) is None:
            continue
        path = getattr(variable, "path", None) or getattr(variable, "name", "?")
        gaps.append(
            UnprotectedVariable(str(path), created_at(variable) or _NOT_RECORDED, variable)
        )
    return gaps


def is_protected(structure: Any) -> bool:
    """Whether every variable of ``structure`` is protected, now and when it grows.

    True when no variable is plain (see :func:`unprotected_variables`) and each Keras
    model, layer, optimizer or metric in it either has variables or belongs to a
    :func:`safevars.scope` block or :func:`protect` call (so the variables it creates
    later are protected too). A model made outside any block and not built yet is
    therefore not protected: the weights it will create would be plain.

    Args:
      structure: As for :func:`unprotected_variables`.

    Raises:
      InvalidArgumentError: a leaf is not a Keras model, layer, optimizer, metric or
        variable.

    Thread safety and modes: as :func:`unprotected_variables`.
    """
    if unprotected_variables(structure):
        return False
    keras = keras_classes()
    for leaf in tf.nest.flatten(structure):
        owner = keras is not None and isinstance(
            leaf, (keras.layer_class, keras.base_optimizer_class, keras.metric_class)
        )
        if owner and block_of(leaf) is None and not leaf.variables:
            return False
    return True


def protect(structure: Any) -> Any:
    """Protects an existing Keras model (or optimizer, layer, metric, variables) in place.

    Example::

        model = keras.models.load_model("model.keras")   # built anywhere, plain
        safevars.protect(model)          # as if built inside safevars.scope()
        assert safevars.is_protected(model)
        threading.Thread(target=model.fit, args=(x, y)).start()
        snaps = safevars.snapshot(model)  # meanwhile, between two steps

    The model ends up as :func:`safevars.scope` would have built it: every variable it
    owns (weights, optimizer variables and slots, metric variables) is backed by a
    SafeVariable under one lock, each counting its own version from 0 (a variable
    protected before keeps its lock's place and its version); a training step takes that
    lock once, and a plain Keras optimizer's step counts the versions of the weights and
    their slots with one add, whether the optimizer was built before or not (a
    :class:`~safevars.SafeOptimizer` built before ``protect`` counts its slots apart);
    weights, slots and metrics Keras creates later (a model built by its first
    call, an optimizer built by its first step) join the lock. The values are not
    touched: each SafeVariable wraps the variable's own storage, so training continues
    bitwise as it would have. Keras' traced train, test and predict functions are traced
    again at their next use. Calling it again, or on a model built in the scope, changes
    nothing.

    Args:
      structure: A Keras model (Sequential, functional or subclassed; built or not;
        compiled or not), layer, optimizer or metric, a ``tf.Variable`` or
        ``keras.Variable``, or a (nested) list, tuple or dict of them: everything in one
        call shares one lock. A Keras object is protected in place.

    Returns:
      ``structure``, with each plain ``tf.Variable`` in it replaced by its SafeVariable
      (a ``tf.Variable`` cannot be changed in place; a Keras variable is, and stays
      itself).

    Raises:
      InvalidArgumentError: a leaf cannot be protected, or the call is made while
        tracing a ``tf.function``. Nothing is changed.
      LockReentryError: a lock of these variables is held (by this or another thread,
        inside ``safevars.locked``) or used by several traced functions, so they cannot
        be joined into one lock. Nothing is changed.

    Thread safety: make the call before sharing the model between threads. A step that
    another thread runs *during* the call may still be the plain, unlocked one; every
    step started after it returns is protected. Two calls on the same objects take turns.

    Modes: eager only (it changes Python objects). Under a ``tf.distribute`` strategy
    call it as you would build the model (the strategy's variables are wrapped whole,
    as in the scope); :class:`~safevars.UnsupportedStrategyError` under one safevars
    does not support.

    A ``tf.function`` of your own traced before the call keeps the plain variables it
    captured: trace it again (a new ``tf.function``); a ``UserWarning`` says so when a
    plain optimizer step was traced into one.
    """
    if not tf.executing_eagerly():
        raise InvalidArgumentError(
            "safevars.protect() changes Python objects and works eagerly only: call it "
            "before tracing, outside tf.function."
        )
    found = _collect(structure, "structure")
    with _PROTECT_LOCK:
        block = _block_for(found)
        proxies = _protect_found(found, block, "protect")
    if not proxies:
        return structure
    return tf.nest.map_structure(
        lambda leaf: (
            proxies.get(id(leaf), leaf)
            if isinstance(leaf, tf.Variable) and not _is_keras_variable(leaf)
            else leaf
        ),
        structure,
    )


def _block_for(found: _Found) -> ScopeLocks:
    """The block the objects already belong to (the first marked), else a new one."""
    for owner in found.owners:
        block = block_of(owner)
        if block is not None:
            return block
    return ScopeLocks()


def _protect_found(found: _Found, block: ScopeLocks, caller: str) -> dict[int, SafeVariable]:
    """Marks ``found``'s owners with ``block`` and wraps its plain variables under the
    block's lock; returns {id(plain tf.Variable): its SafeVariable}. Validates first:
    on error nothing is changed."""
    plain = [(v, b) for v in found.variables if (b := _plain_backing(v)) is not None]
    _join_existing_locks(block, [b for _, b in plain], caller)
    wrapped = [(variable, block.wrap(backing)) for variable, backing in plain]
    for owner in found.owners:
        mark(owner, block)
    proxies: dict[int, SafeVariable] = {}
    for variable, safe in wrapped:
        if _is_keras_variable(variable):
            variable._value = safe
        else:
            proxies[id(variable)] = safe
    if wrapped:
        for optimizer in found.optimizers:  # built before: its slots were made plain
            record_built_slots(optimizer)
        _retrace(found)
    return proxies


def _join_existing_locks(block: ScopeLocks, backings: list[tf.Variable], caller: str) -> None:
    """Variables wrapped before (``safevars.wrap``, a SafeOptimizer of a plain model)
    keep their guard, version and lock: their locks and the block's are joined into one
    (:func:`~safevars.locking.share_lock`), per device of a parameter-server cluster,
    and that lock becomes the block's."""
    groups: dict[str | None, list[tuple[tf.Variable, Any]]] = {}
    for backing in backings:
        guard = existing_guard(backing)
        if guard is not None and guard.lock is not block.lock_for(backing):
            groups.setdefault(block.key(backing), []).append((backing, guard))
    for members in groups.values():
        backing = members[0][0]
        guards = [guard for _, guard in members]
        target = block.lock_for(backing)
        if target is not None:
            guards += _guards_of_lock(target)[:1]
        if not share_lock(guards):
            names = ", ".join(sorted({g.name for g in guards})[:5])
            raise LockReentryError(
                f"safevars.{caller}() cannot put {names} under one lock: a lock of theirs "
                "is held (inside safevars.locked or a running step) or is used by "
                "several traced functions already. Call it before the variables are "
                "locked or traced, outside safevars.locked. Nothing was changed."
            )
        block.adopt(backing, guards[0].lock)


def _retrace(found: _Found) -> None:
    """Keras' traced functions of the models and the optimizers' cached step plans were
    made over plain variables: dropped, so they are made again at the next use."""
    for model in found.models:
        for name in _FUNCTIONS:
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
    for optimizer in found.optimizers:
        forget_step_guards(optimizer)
        if traced_by_user(optimizer):
            warnings.warn(
                f"Optimizer {optimizer.name!r} had its plain (unlocked) step traced into a "
                "tf.function before it was protected: that function keeps writing the "
                "plain variables. Trace it again (create a new tf.function) so its steps "
                "are protected.",
                UserWarning,
                stacklevel=4,
            )


def protecting_entry(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a Keras training entry point (``compile``, ``fit``, ``train_on_batch``,
    ``evaluate``, ``test_on_batch``, ``predict``, ``predict_on_batch``); see the module
    docstring."""
    per_batch = name.endswith("_on_batch")
    function = {
        "train_on_batch": "train_function",
        "test_on_batch": "test_function",
        "predict_on_batch": "predict_function",
    }.get(name)

    @functools.wraps(original)  # its attributes too: Keras tells its own methods by them
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        block = block_of(self)
        if block is None:
            block = current_block()
            if block is None:
                return original(self, *args, **kwargs)  # a plain model outside any block
        elif per_batch and getattr(self, function or "", None) is not None:
            return original(self, *args, **kwargs)  # traced already: nothing to create
        with _PROTECT_LOCK:
            _protect_found(_collect(self, "model"), block, name)
        with entered(block):
            result = original(self, *args, **kwargs)
        if name == "compile":  # a new optimizer and new metrics: theirs too
            with _PROTECT_LOCK:
                _protect_found(_collect(self, "model"), block, name)
        return result

    method._safevars = True  # type: ignore[attr-defined]
    return method
