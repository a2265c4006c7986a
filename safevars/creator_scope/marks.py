"""Which block a Keras object belongs to, so the variables it creates later join it.

Keras creates many variables long after the object that owns them: a subclassed
model's weights at its first call (often in ``fit``, outside the ``safevars.scope()``
block it was made in), an optimizer's slots at its first step, the compiled metrics at
the first train step. A creator scope sees only the variables created while it is open,
so each Keras layer, optimizer and metric constructed inside a block is *marked* with
that block (:func:`mark`; :func:`safevars.protect` marks the objects of a model it
protects), and a Keras variable created later for a marked object is wrapped under the
block's lock as if the block were open (:func:`initialize`).

How a variable finds its owner: Keras creates every variable with its owner's name scope
open (``backend.name_scope(name, caller=owner)``: ``add_weight`` inside a layer's
``build``, an optimizer's ``add_variable``, a metric's), and a layer's ``__call__`` and
``build`` open the layer's. The innermost marked object among the callers of the open
scopes owns the variable, so a sublayer that a marked model makes in its own ``build``
(outside any block) still gets protected weights.

A Keras variable created outside any block and for no marked owner stays plain; it
records where it was created (:func:`created_at`), which :func:`safevars.unprotected_variables`
reports.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from safevars._tf_internal import keras_name_scope_callers
from safevars.creator_scope.creators import ScopeLocks, current_block
from safevars.distribute import check_strategy
from safevars.variable import SafeVariable
from safevars.variable.wrapping import CREATED_AT_ATTRIBUTE

__all__ = ["block_of", "constructed", "created_at", "entered", "initialize", "mark"]

# Keras layer, optimizer or metric -> the block whose lock its variables share.
_MARKS: weakref.WeakKeyDictionary[Any, ScopeLocks] = weakref.WeakKeyDictionary()
_MARKS_LOCK = threading.Lock()
# Frames of these packages are not "where a variable was created": the user's line is.
_LIBRARY_PREFIXES = (
    "keras.",
    "keras_hub.",
    "tensorflow.",
    "tf_keras.",
    "safevars.",
    "wrapt.",
    "absl.",
    "contextlib",
    "functools",
    "threading",
    "_pytest.",
    "pluggy.",
)


def mark(obj: Any, block: ScopeLocks) -> ScopeLocks:
    """Marks ``obj`` (a Keras layer, optimizer or metric) as ``block``'s, unless it is
    marked already; returns its block."""
    with _MARKS_LOCK:
        found = _MARKS.get(obj)
        if found is None:
            _MARKS[obj] = found = block
        return found


def block_of(obj: Any) -> ScopeLocks | None:
    """The block ``obj`` was made in or protected by, or None."""
    try:
        return _MARKS.get(obj)
    except TypeError:  # not weak-referenceable: never marked
        return None


_entered = threading.local()  # .blocks: the blocks of the marked models whose calls run


@contextlib.contextmanager
def entered(block: ScopeLocks) -> Iterator[None]:
    """Inside, this thread runs a training call of a model marked with ``block``: the
    Keras objects it constructs (compiled metrics, built lazily) are marked with it, and
    the variables they create join it."""
    stack = _entered.__dict__.setdefault("blocks", [])
    stack.append(block)
    try:
        yield
    finally:
        stack.pop()


def _entered_block() -> ScopeLocks | None:
    stack = getattr(_entered, "blocks", None)
    return stack[-1] if stack else None


def _owner_block() -> ScopeLocks | None:
    """The block of the innermost marked object whose Keras name scope is open, or of
    the marked model whose training call runs."""
    for caller in reversed(keras_name_scope_callers()):
        if caller is not None:
            block = block_of(caller)
            if block is not None:
                return block
    return _entered_block()


def _creation_site() -> str:
    """``file:line in function`` of the innermost frame outside Keras, TensorFlow and
    safevars: the user's line that made a variable be created."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_LIBRARY_PREFIXES) and module not in ("keras", "tensorflow"):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>"


def created_at(variable: Any) -> str | None:
    """Where a plain Keras variable was created (recorded since safevars was imported)."""
    site = getattr(variable, CREATED_AT_ATTRIBUTE, None)
    return site if isinstance(site, str) else None


def initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' TensorFlow-backend ``Variable._initialize``: a variable made for a
    marked owner outside its block is wrapped under the block's lock; any other plain
    one records where it was made."""

    def _initialize(self: Any, value: Any) -> Any:
        result = original(self, value)
        backing = self.__dict__.get("_value")
        if isinstance(backing, SafeVariable) or not isinstance(backing, tf.Variable):
            return result  # made inside a block (the creator wrapped it), or deferred
        block = _owner_block()
        if block is None:
            setattr(self, CREATED_AT_ATTRIBUTE, _creation_site())
            return result
        check_strategy()  # as the scope's creator does
        self._value = block.wrap(backing)
        return result

    _initialize.__wrapped__ = original  # type: ignore[attr-defined]
    _initialize._safevars = True  # type: ignore[attr-defined]
    return _initialize


def constructed(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps the ``__init__`` of Keras' ``Layer``, ``BaseOptimizer`` and ``Metric``: an
    object made inside a block is marked with it."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        block = current_block() or _entered_block()
        if block is not None:
            mark(self, block)
        original(self, *args, **kwargs)

    # Keras' Operation.__new__ reads the arguments of cls.__init__ with
    # inspect.getfullargspec, which does not follow __wrapped__ but honours
    # __signature__: the original's, so a class that inherits this __init__ still
    # records its configuration as before.
    __init__.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    __init__._safevars = True  # type: ignore[attr-defined]
    return __init__
