"""Pure seeds: functions of ``(seed, worker, replica_id, keys)`` that move no stream.

:meth:`~safevars.ReplicaRNG.seed_for` (Keras layers, ``tf.random.set_seed``),
:meth:`~safevars.ReplicaRNG.numpy` (numpy pipelines),
:meth:`~safevars.ReplicaRNG.dataset_seed` (``tf.data``) and the stateless per-element
seeds :meth:`~safevars.ReplicaRNG.element_seed` / ``element_seeds`` (augmentations that
depend on an element's index only). :class:`_PureSeeds` computes them for one
``(seed, worker, replica)`` (a :class:`~safevars.ReplicaStream`, or an ``_Identity``);
:class:`_ReplicaPureSeeds` is their :class:`~safevars.ReplicaRNG` front, which picks the
replica. The values come from :mod:`.seed_derivation`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from safevars._validation import check_int
from safevars.rng.seed_derivation import (
    _DOMAIN_DATASET,
    _DOMAIN_ELEMENT,
    _DOMAIN_NUMPY,
    _DOMAIN_SEED,
    _key_words,
    _seed31,
    _seed63,
    _sequence,
)


class _PureSeeds:
    """Seeds that are pure functions of ``(seed, worker, replica_id, keys)``: no stream moves.

    Subclasses provide ``_rng_seed``, ``replica_id`` and the ``worker`` property.
    """

    _rng_seed: int
    replica_id: int
    worker: Any

    def seed_for(self, *keys: str | int) -> int:
        """An integer seed named by ``keys``: see :meth:`ReplicaRNG.seed_for`."""
        return _seed31(self._sequence(_DOMAIN_SEED, *_key_words(keys, "keys")))

    def numpy(self, epoch: int = 0) -> np.random.Generator:
        """A numpy generator for this replica: see :meth:`ReplicaRNG.numpy`."""
        epoch = check_int(epoch, "epoch", 0, fix="Pass the epoch number, counting from 0.")
        return np.random.Generator(np.random.PCG64(self._sequence(_DOMAIN_NUMPY, epoch)))

    def dataset_seed(self, epoch: int = 0) -> int:
        """A ``tf.data`` seed for this replica: see :meth:`ReplicaRNG.dataset_seed`."""
        epoch = check_int(epoch, "epoch", 0, fix="Pass the epoch number, counting from 0.")
        return _seed63(self._sequence(_DOMAIN_DATASET, epoch))

    def element_seed(self, index: Any, epoch: int = 0) -> tf.Tensor:
        """The seed of element ``index``: see :meth:`ReplicaRNG.element_seed`."""
        epoch = check_int(epoch, "epoch", 0, fix="Pass the epoch number, counting from 0.")
        if not isinstance(index, (tf.Tensor, tf.Variable)):
            index = check_int(index, "index", 0, fix="Element indices count from 0.")
        base = _seed63(self._sequence(_DOMAIN_ELEMENT, epoch))
        return tf.stack([tf.constant(base, tf.int64), tf.cast(index, tf.int64)])

    def element_seeds(self, epoch: int = 0) -> tf.data.Dataset:
        """Per-element seeds for this replica: see :meth:`ReplicaRNG.element_seeds`."""
        epoch = check_int(epoch, "epoch", 0, fix="Pass the epoch number, counting from 0.")
        base = tf.constant(_seed63(self._sequence(_DOMAIN_ELEMENT, epoch)), tf.int64)
        return tf.data.Dataset.counter(dtype=tf.int64).map(lambda i: tf.stack([base, i]))

    def _sequence(self, domain: int, *words: int) -> np.random.SeedSequence:
        return _sequence(self._rng_seed, self.worker, domain, self.replica_id, *words)


class _Identity(_PureSeeds):
    """``(seed, worker, replica_id)`` for pure seeds, without a stream."""

    def __init__(self, seed: int, worker: tuple[str, int], replica_id: int) -> None:
        self._rng_seed = seed
        self.worker = worker
        self.replica_id = replica_id


class _ReplicaPureSeeds:
    """The pure seeds of :class:`~safevars.ReplicaRNG` (a mixin; no state of its own).

    ``ReplicaRNG`` provides what the ``TYPE_CHECKING`` block declares.
    """

    if TYPE_CHECKING:
        _seed: int

        @property
        def worker(self) -> tuple[str, int]: ...

        def _current_replica(self) -> int | tf.Tensor: ...

        def _check_replica(self, replica_id: Any, argument: str) -> int: ...

    # -- pure seeds: functions of (seed, worker, replica, keys); no stream moves --------

    def _pure(self, replica_id: int | None) -> _PureSeeds:
        """``(seed, worker, replica)`` of the pure seeds: the RNG's own worker identity
        (the coordinator's under ``ParameterServerStrategy``, so the same on every
        worker) and the given or calling replica."""
        if replica_id is None:
            replica_id = self._current_replica()
        return _Identity(self._seed, self.worker, self._check_replica(replica_id, "replica_id"))

    def seed_for(self, *keys: str | int, replica_id: int | None = None) -> int:
        """A Python int seed named by ``keys``, e.g. for ``keras.layers.Dropout(seed=...)``.

        The value depends only on ``(seed, worker, replica_id, keys)``: the same keys give
        the same seed in every process, different keys, replicas or workers (almost
        surely) different ones.

        Args:
          *keys: Non-negative ints and/or strings naming the use, e.g.
            ``seed_for("dropout", 3)``.
          replica_id: The replica; default the calling replica (0 outside
            ``strategy.run``).

        Returns:
          An int in ``[0, 2**31 - 1)``, valid for Keras, ``tf.random.set_seed`` and
          ``tf.data``.

        Raises:
          InvalidArgumentError: a key that is not a non-negative int or a string, or a
            bad ``replica_id``.

        Thread safety: pure function; reads no TensorFlow state.

        Modes: a Python value computed at trace time; it is the same in every trace.
        """
        return self._pure(replica_id).seed_for(*keys)

    def numpy(self, replica_id: int | None = None, *, epoch: int = 0) -> np.random.Generator:
        """A ``numpy.random.Generator`` for a replica's numpy data pipeline.

        ``numpy.random.Generator(PCG64(SeedSequence(seed, spawn_key=(1, w, task_id,
        replica_id, epoch))))`` with ``w`` the first 8 bytes (little endian) of the
        SHA-256 of the task type: a new generator at the start of its stream on every
        call, so ``numpy(r, epoch=e)`` is reproducible on its own.

        Args:
          replica_id: The replica; default the calling replica.
          epoch: A non-negative int; every epoch gets an independent generator.

        Returns:
          A fresh ``numpy.random.Generator``.

        Raises:
          InvalidArgumentError: bad ``replica_id`` or ``epoch``.

        Thread safety: pure function; the returned generator is not thread-safe (numpy's
          rule): use one per thread.

        Modes: Python only; call it outside ``tf.function`` (``tf.numpy_function`` works).
        """
        return self._pure(replica_id).numpy(epoch)

    def dataset_seed(self, epoch: int = 0, replica_id: int | None = None) -> int:
        """An int seed for ``tf.data`` ops (``shuffle(seed=...)``), per epoch and replica.

        Note that ``tf.data`` combines an op seed with the global seed
        (``tf.random.set_seed``), so a pipeline is reproducible when both are fixed.

        Args:
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          An int in ``[0, 2**63)``.

        Raises:
          InvalidArgumentError: bad ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: a Python value; the same in every trace.
        """
        return self._pure(replica_id).dataset_seed(epoch)

    def element_seed(self, index: Any, epoch: int = 0, replica_id: int | None = None) -> tf.Tensor:
        """The stateless seed of element ``index``: ``[base(seed, worker, replica, epoch), index]``.

        Use inside ``dataset.enumerate().map(...)`` with ``tf.random.stateless_*`` or
        ``tf.image.stateless_random_*``: the augmentation of an element then depends on
        its index only, not on ``num_parallel_calls`` or iteration order. Under
        ``ParameterServerStrategy``, pass a step number as ``index`` (an argument of the
        scheduled function): the step's values are then the same whichever worker runs
        it.

        Args:
          index: The element (or step) index: a non-negative int or an integer tensor.
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          An int64 tensor of shape ``[2]``.

        Raises:
          InvalidArgumentError: bad ``index`` (Python), ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: eager and graph (``tf.data`` functions).
        """
        return self._pure(replica_id).element_seed(index, epoch)

    def element_seeds(self, epoch: int = 0, replica_id: int | None = None) -> tf.data.Dataset:
        """An infinite dataset of per-element seeds: element ``i`` is ``element_seed(i, epoch)``.

        ``tf.data.Dataset.zip((dataset, rng.element_seeds(epoch)))`` pairs every element
        with its own seed.

        Args:
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          A ``tf.data.Dataset`` of int64 tensors of shape ``[2]``.

        Raises:
          InvalidArgumentError: bad ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: builds a dataset; iterate it eagerly or in a ``tf.function``.
        """
        return self._pure(replica_id).element_seeds(epoch)
