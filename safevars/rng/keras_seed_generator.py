"""Keras seed generators that draw from :mod:`safevars.rng` streams.

``ReplicaSeedGenerator`` is a ``keras.random.SeedGenerator`` whose ``next()`` draws
from a stream; the class is built on first use (importing Keras is slow), and
``safevars.rng.ReplicaSeedGenerator`` reaches it through this module's ``__getattr__``,
which the package re-exports. Its ``__module__`` is ``"safevars.rng"``, where it is
public, whichever file builds it. :class:`_KerasSeedGenerators` gives
:class:`~safevars.ReplicaRNG` its :meth:`~safevars.ReplicaRNG.keras_seed_generator` and
:meth:`~safevars.ReplicaRNG.attach` (the replica-aware variants).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars.errors import InvalidArgumentError
from safevars.rng.distributions import _Draws

if TYPE_CHECKING:
    import keras

    from safevars.rng.pure_seeds import _PureSeeds

# The module ReplicaSeedGenerator is public in (its __module__): the package, not this file.
_PUBLIC_MODULE = "safevars.rng"


class _KerasSeedGenerators(_Draws):
    """Keras seed generators of :class:`~safevars.ReplicaRNG` (a mixin; no state of its own).

    Their seeds are the draws' :meth:`make_seed`; ``ReplicaRNG`` provides what the
    ``TYPE_CHECKING`` block declares.
    """

    if TYPE_CHECKING:

        def _pure(self, replica_id: int | None) -> _PureSeeds: ...

    def keras_seed_generator(self, name: str | None = None) -> keras.random.SeedGenerator:
        """A ``keras.random.SeedGenerator`` that draws from the calling replica's stream.

        Pass it as the ``seed`` of ``keras.random.*`` ops in a custom layer, or assign it
        to a built-in layer's ``seed_generator`` attribute (``Dropout``,
        ``GaussianNoise``, ...): inside ``strategy.run`` every replica then gets its own
        dropout masks, reproducibly, where a plain ``SeedGenerator`` would hand all
        replicas the same seeds. Its position lives in this RNG's streams (checkpoint the
        RNG), not in the generator's own ``state`` variable.

        Args:
          name: Keras name of the generator.

        Returns:
          A :class:`ReplicaSeedGenerator`.

        Thread safety: each ``next()`` is one atomic draw, as :meth:`normal`.

        Modes: as :meth:`normal`; the replica is looked up at each ``next()``.
        """
        seed = self._pure(0).seed_for("keras", name or "")
        return _seed_generator_class()(self.make_seed, seed, name)

    def attach(self, layer: Any) -> int:
        """Makes every Keras ``seed_generator`` in ``layer`` draw from this RNG.

        Built-in Keras layers (``Dropout``, ``GaussianNoise``, ``RandomFlip``, ...) create
        their ``keras.random.SeedGenerator`` when constructed; under ``MirroredStrategy``
        one generator serves every replica, so all replicas get the same masks. This
        replaces the ``seed_generator`` of ``layer`` and of all its sublayers (a whole
        model at once) with :meth:`keras_seed_generator` objects: each replica then
        draws its own seeds from its own stream. Already attached generators are kept.

        Args:
          layer: A ``keras.Layer`` (a model is a layer).

        Returns:
          The number of generators replaced.

        Raises:
          InvalidArgumentError: ``layer`` is not a Keras layer.

        Thread safety: not atomic with respect to a concurrent call of the layer; attach
          before training starts.

        Modes: eager only (it edits Python objects); the layer's later calls work eagerly
          and in ``tf.function``.
        """
        import keras

        if not isinstance(layer, keras.layers.Layer):
            raise InvalidArgumentError(
                f"layer must be a keras.Layer or keras.Model, got {type(layer).__name__}."
            )
        generator_class = _seed_generator_class()
        replaced = 0
        for sublayer in layer._flatten_layers(include_self=True, recursive=True):
            old = getattr(sublayer, "seed_generator", None)
            if not isinstance(old, keras.random.SeedGenerator) or isinstance(old, generator_class):
                continue
            path = str(getattr(sublayer, "path", None) or sublayer.name).replace("/", "_")
            new = self.keras_seed_generator(name=f"{path}_replica_seed_generator")
            # Keras locks a built layer's tracker; swap the tracked generator the way
            # Keras' own _untrack_variable does, so layer.variables stays consistent.
            tracker = sublayer._tracker
            was_locked = tracker.locked
            tracker.unlock()
            try:
                tracker.untrack(old)
                sublayer.seed_generator = new
            finally:
                if was_locked:
                    tracker.lock()
            replaced += 1
        return replaced


ReplicaSeedGenerator: Any  # The class is built on first use (importing Keras is slow).


@functools.cache
def _seed_generator_class() -> type:
    import keras

    class ReplicaSeedGenerator(keras.random.SeedGenerator):
        """A ``keras.random.SeedGenerator`` drawing its seeds from a safevars stream.

        Made by :meth:`ReplicaRNG.keras_seed_generator` (the calling replica's stream at
        each ``next()``) or :meth:`ReplicaStream.keras_seed_generator` (one stream).
        The Keras ``state`` variable it inherits is seeded with ``seed_for("keras",
        name)`` but not used: the stream holds the position.
        """

        def __init__(
            self, draw: Callable[[], tf.Tensor], seed: int, name: str | None = None
        ) -> None:
            super().__init__(seed=seed, name=name)
            self._safevars_draw = draw

        def next(self, ordered: bool = True) -> tf.Tensor:
            """Draws a seed of shape ``[2]`` (int64) from the stream.

            Thread safety: one atomic draw.

            Modes: eager and ``tf.function``; the replica is looked up at each call.
            """
            return self._safevars_draw()

    ReplicaSeedGenerator.__module__ = _PUBLIC_MODULE
    globals()["ReplicaSeedGenerator"] = ReplicaSeedGenerator
    return ReplicaSeedGenerator


def __getattr__(name: str) -> Any:
    """``ReplicaSeedGenerator``, built on first use: ``safevars.rng``'s ``__getattr__``."""
    if name == "ReplicaSeedGenerator":
        return _seed_generator_class()
    raise AttributeError(f"module {_PUBLIC_MODULE!r} has no attribute {name!r}")
