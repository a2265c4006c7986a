"""``safevars.scope()`` itself: a block whose variables are SafeVariables under one lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from safevars.creator_scope.creators import ScopeLocks, creating
from safevars.creator_scope.patches import install
from safevars.distribute import check_strategy

__all__ = ["scope"]


@contextlib.contextmanager
def scope() -> Iterator[None]:
    """Makes every variable created inside a :class:`~safevars.SafeVariable`, under one lock.

    Example::

        with safevars.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
            model.compile(optimizer="adam", loss="mse")
        model.fit(x, y)                       # each step one section, every write counted
        snaps = safevars.snapshot(model)      # from any thread, meanwhile

    Keras variables created inside keep being ``keras.Variable`` s (their class, path,
    dtype policy, saving format); the ``tf.Variable`` each stores its value in is a
    SafeVariable, so ``safevars.wrap(layer.kernel)`` returns it and
    ``safevars.snapshot(model)``, ``safevars.locked(model)`` and
    ``safevars.transaction(model, fn)`` use its lock and version. Every variable the
    block creates (weights, optimizer variables, metrics) shares one lock, each keeping
    its own version; the optimizer slots made for them later join it. A training step
    over the model is one section that takes that lock once, however many variables the
    model has (see :mod:`safevars.creator_scope`).

    Thread safety: the scope applies to the calling thread (and to ``tf.function`` s it
    traces inside the block); the variables it creates may then be shared with any
    thread. Scopes nest (a variable is wrapped once, under the innermost block's lock);
    ``keras.backend.clear_session()`` inside a block does not end it.

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
    with creating(ScopeLocks()):
        yield
