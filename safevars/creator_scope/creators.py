"""The variable creators of :func:`safevars.scope`, and the one lock per block.

A creator scope (``tf.variable_creator_scope``) wraps every ``tf.Variable`` created inside
in a SafeVariable. All the variables one ``scope()`` block creates share one lock
(:class:`ScopeLocks`; each keeps its own version): a model's weights, its optimizer's
variables, its metrics. A step over them therefore takes one lock however many there
are, and a snapshot of the model validates one sequence number. On a parameter-server
cluster there is one lock per parameter-server task, since a section's ops run on its
lock's device. An optimizer slot made for a safe weight joins that weight's lock
(:func:`joining`).

TensorFlow keeps creator scopes on the default graph, which
``tf.compat.v1.reset_default_graph`` (and so ``keras.backend.clear_session()``) replaces:
the blocks open in the calling thread are entered again on the new graph
(:func:`reenter_after_reset`), so a reset inside a block does not end it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from safevars.distribute import check_strategy, on_parameter_server
from safevars.locking import SectionLock
from safevars.variable import SafeVariable

__all__ = ["ScopeLocks", "creating", "current_block", "joining", "reenter_after_reset"]

# Creators with a higher priority run first; a strategy's scope and the public
# tf.variable_creator_scope use 100, tf.function's variable lifting 50. Running first,
# the scope's creator wraps what the strategy's creator returns (the mirrored variable).
_PRIORITY = 200


class ScopeLocks:
    """The locks of one :func:`safevars.scope` block, made with its first variables.

    Thread safety: a block may create variables from the threads a ``tf.distribute``
    strategy traces in; the first variable per key makes the lock under a mutex.
    """

    __slots__ = ("_locks", "_mutex", "__weakref__")

    def __init__(self) -> None:
        self._locks: dict[str | None, SectionLock] = {}
        self._mutex = threading.Lock()

    def adopt(self, variable: tf.Variable, lock: SectionLock) -> None:
        """Makes ``lock`` the block's lock for ``variable``'s device (after
        :func:`safevars.protect` joined the block's lock and the locks its variables
        already had into ``lock``)."""
        with self._mutex:
            self._locks[self.key(variable)] = lock

    def lock_for(self, variable: tf.Variable) -> SectionLock | None:
        """The block's lock for ``variable``'s device, None before its first variable."""
        with self._mutex:
            return self._locks.get(self.key(variable))

    @staticmethod
    def key(variable: tf.Variable) -> str | None:
        """Which of the block's locks ``variable`` takes: its parameter-server device,
        or None (one lock) anywhere else."""
        device = getattr(variable, "device", "") or ""
        return device if on_parameter_server(device) else None

    def wrap(self, variable: tf.Variable) -> SafeVariable:
        """``variable`` as a SafeVariable under the block's lock for its device."""
        key = self.key(variable)
        with self._mutex:
            lock = self._locks.get(key)
            safe = SafeVariable._from_variable(variable, lock=lock)
            if lock is None:
                self._locks[key] = safe.guard.lock
        return safe


def _creator(wrap: Callable[[tf.Variable], SafeVariable]) -> Callable[..., Any]:
    def creator(next_creator: Callable[..., Any], **kwargs: Any) -> Any:
        check_strategy()  # as SafeVariable(...) does: an unsupported strategy entered inside
        variable = next_creator(**kwargs)
        if isinstance(variable, SafeVariable) or not isinstance(variable, tf.Variable):
            return variable  # an enclosing safevars.scope() wrapped it already
        return wrap(variable)

    return creator


# The creator scopes open in this thread, outermost first:
# [creator, entered context, the block's ScopeLocks (None for joining)].
_open = threading.local()


def _enter(creator: Callable[..., Any]) -> Any:
    graph = tf.compat.v1.get_default_graph()
    context = graph._variable_creator_scope(creator, priority=_PRIORITY)  # noqa: SLF001
    context.__enter__()
    return context


@contextlib.contextmanager
def creating(locks: ScopeLocks) -> Iterator[None]:
    """Inside, every variable created is wrapped under ``locks``."""
    with _open_creator(_creator(locks.wrap), locks):
        yield


@contextlib.contextmanager
def joining(lock: SectionLock) -> Iterator[None]:
    """Inside, every variable created is wrapped under ``lock`` (an optimizer slot made
    for a safe weight, under the weight's lock)."""
    with _open_creator(_creator(lambda v: SafeVariable._from_variable(v, lock=lock))):
        yield


@contextlib.contextmanager
def _open_creator(creator: Callable[..., Any], block: ScopeLocks | None = None) -> Iterator[None]:
    stack = _open.__dict__.setdefault("stack", [])
    record = [creator, _enter(creator), block]
    stack.append(record)
    try:
        yield
    finally:
        stack.remove(record)
        record[1].__exit__(None, None, None)


def current_block() -> ScopeLocks | None:
    """The innermost :func:`safevars.scope` block open in this thread, if any."""
    for record in reversed(getattr(_open, "stack", ())):
        if record[2] is not None:
            block: ScopeLocks = record[2]
            return block
    return None


def reenter_after_reset() -> None:
    """Enters this thread's open creator scopes again on the new default graph (called
    after ``reset_default_graph``; the old graph's scopes are dropped with it)."""
    for record in getattr(_open, "stack", ()):
        record[1] = _enter(record[0])
