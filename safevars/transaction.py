"""Critical sections over several SafeVariables: ``locked`` and ``transaction``.

Both take the variables' locks in the global order (deadlock-free) and are re-entrant
for the thread that holds them; writes made inside through the variables' own methods
do not lock again but still count one version each.

Both accept SafeVariables, plain ``tf.Variable`` s and ``keras.Variable`` s (wrapped on
the fly with :func:`safevars.wrap`, so they take the lock every other ``wrap`` of them
shares, :class:`~safevars.SafeOptimizer` included) and Keras layers or models (their
weights). Writes made inside through a *plain* object are locked out from other safevars
writers but not counted in its version; a Keras model built inside
:func:`safevars.scope` is backed by SafeVariables, so its writes are counted too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import tensorflow as tf

from safevars.errors import InvalidArgumentError, NotCallableError
from safevars.locking import Guard, check_timeout, guards_of, hold
from safevars.sections import graph_section
from safevars.variable import as_safe_variables, program_order

__all__ = ["locked", "transaction"]

T = TypeVar("T")


def _variables_argument(variables: Any, argument: str) -> list[Any]:
    """The SafeVariables named by ``variables`` (see :func:`as_safe_variables`)."""
    if isinstance(variables, (list, tuple)) and not variables:
        raise InvalidArgumentError(
            f"{argument} must name at least one variable, got an empty sequence."
        )
    return as_safe_variables(variables, argument)[1]


def locked(*variables: Any, timeout: float | None = None) -> hold:
    """Holds the locks of ``variables`` for a multi-statement critical section (eager).

    Example::

        with safevars.locked(v):
            v.assign(v.read_value() + 1)   # no lost update

    Args:
      *variables: SafeVariables, ``tf.Variable`` s, ``keras.Variable`` s or Keras
        layers or models (their weights), in any order (they are locked in the global
        order). Plain and Keras variables are wrapped with :func:`safevars.wrap`.
      timeout: Seconds to wait for the locks at most (None: no limit).

    Returns:
      A context manager; entering it takes the locks, leaving it releases them.

    Raises:
      InvalidArgumentError: no variable, or something that is not one (at the call).
      LockOrderError: the thread already holds a lock that sorts after one of these.
      LockTimeoutError: the locks were not all free within ``timeout``; none is held.
      RuntimeError (InvalidArgumentError): used while tracing a ``tf.function``, where a
        Python lock would only guard tracing; use :func:`transaction` there.

    Thread safety: no other safevars write, transaction or snapshot of these variables
    runs while the block runs. Re-entrant for the holding thread. Writes made inside the
    block stay made if the block raises (use :func:`transaction` for all-or-nothing).
    An interrupt (``KeyboardInterrupt``, an asynchronous exception) anywhere in entering
    or leaving never leaves a lock held; a context that is entered and never left
    (entered by hand, then dropped) releases its locks when it is garbage-collected, and
    one whose thread ended is taken back by the next thread that waits. Any thread may
    leave a context another thread entered; all its locks are released.

    Modes: eager only. In run-time mode (a variable written inside a ``tf.function``)
    the block also holds the variables' ``tf.CriticalSection`` mutexes, so running graphs
    wait for it.
    """
    if not tf.executing_eagerly():
        raise InvalidArgumentError(
            "safevars.locked() is for eager code: inside a tf.function a Python lock only "
            "guards tracing, not execution. Use safevars.transaction(variables, fn) there."
        )
    guards = guards_of(_variables_argument(list(variables), "variables"), "variables")
    return hold(guards, check_timeout(timeout))


def transaction(variables: Sequence[Any], fn: Callable[[], T], timeout: float | None = None) -> T:
    """Runs ``fn()`` atomically over ``variables``, eagerly or inside a ``tf.function``.

    Args:
      variables: Every variable ``fn`` writes: a SafeVariable, ``tf.Variable``,
        ``keras.Variable``, Keras layer or model (its weights), or a list, tuple or dict
        of them. Plain and Keras variables are wrapped with :func:`safevars.wrap`.
      fn: A callable with no arguments. It reads and writes the variables through their
        methods (``assign``, ``update``, ``snapshot``...).
      timeout: Eagerly, seconds to wait for the locks at most (None: no limit).

    Returns:
      Whatever ``fn`` returns (in a graph, its tensors are ordered after the locks are
      released, so they reflect the finished transaction).

    Raises:
      InvalidArgumentError: ``variables`` is empty or holds something else.
      NotCallableError: ``fn`` is not callable.
      LockOrderError: the thread already holds a lock that sorts after one of these.
      LockTimeoutError: the locks were not all free within ``timeout``; ``fn`` did not run.
      Exception: whatever ``fn`` raises eagerly propagates unchanged, after every
        variable's value and version are rolled back to what they were before ``fn``.

    Thread safety: ``fn`` runs while no other safevars operation touches any of the
    variables; :func:`safevars.snapshot` sees all of its writes or none.

    Modes: eagerly, the variables' locks are held around ``fn`` and an exception rolls
    the writes back. In a ``tf.function``, ``fn`` is traced inside the variables'
    ``tf.CriticalSection`` s (nested in the global order) and the locks are released only
    after every op it created has run. Each write ``fn`` makes through a SafeVariable
    runs only after every op ``fn`` created before it has succeeded, so a run-time
    failure (a ``tf.debugging`` assertion) stops the writes that follow it in ``fn``;
    writes before it stay made (a graph transaction does not roll back), each with its
    version.
    """
    variables = _variables_argument(variables, "variables")
    guards = guards_of(variables, "variables")
    timeout = check_timeout(timeout)
    if not callable(fn):
        raise NotCallableError(
            f"transaction(variables, fn) needs a callable with no arguments, got {fn!r}."
        )
    if not tf.executing_eagerly():

        def body() -> T:
            with program_order():
                return fn()

        return graph_section(guards, body)
    with hold(guards, timeout):
        saved = [(v.__wrapped__.read_value(), g.version()) for v, g in zip(variables, guards)]
        try:
            return fn()
        except BaseException:
            _roll_back(variables, guards, saved)
            raise


def _roll_back(variables: list[Any], guards: list[Guard], saved: list[Any]) -> None:
    for variable, guard, (value, version) in zip(variables, guards, saved):
        if guard.version() != version:
            variable.__wrapped__.assign(value, read_value=False)
            guard.set_version(version)
