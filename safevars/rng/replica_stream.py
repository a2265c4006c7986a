"""The random stream of one replica of one worker, and a stream chosen at run time.

:class:`ReplicaStream` owns a Philox key (derived from ``(seed, worker, replica_id)``)
and its counter, in one int64 resource variable ``[counter_lo, counter_hi, key]``;
every draw advances it atomically (:meth:`ReplicaStream._generate` picks the fused or
the split kernel form, :mod:`.kernels`). :class:`_SelectedStream` draws from a stream
whose state handle is only known when the graph runs (a run-time replica id, or the
executing worker under ``ParameterServerStrategy``, :mod:`.placement`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import resource_variable_ops
from safevars.rng.distributions import _Draws
from safevars.rng.keras_seed_generator import _seed_generator_class
from safevars.rng.kernels import (
    _FUSED_MAX_ELEMENTS,
    _PHILOX,
    _delta,
    _Kernels,
    _read_and_skip,
    _shape,
    _stateless_draw,
    _static_num_elements,
)
from safevars.rng.pure_seeds import _PureSeeds
from safevars.rng.seed_derivation import _DOMAIN_STREAM, _to_int64

__all__ = ["ReplicaStream"]


class ReplicaStream(_Draws, _PureSeeds, tf.Module):
    """The random stream of one replica of one worker: a Philox key and counter.

    Obtained from :meth:`ReplicaRNG.for_replica`, :meth:`ReplicaRNG.for_worker` (under
    ``ParameterServerStrategy``) or :meth:`ReplicaRNG.current_stream`; not constructed
    directly. The draw methods mirror ``tf.random.Generator`` and return the same
    dtypes; every draw advances this stream and no other.

    Attributes:
      replica_id: The replica this stream belongs to.
      key: The 64-bit Philox key (unsigned), derived from ``(seed, worker, replica_id)``.
      state: The int64 ``[counter_lo, counter_hi, key]`` resource variable (checkpointed).
    """

    def __init__(
        self,
        seed: int,
        worker: tuple[str, int],
        replica_id: int,
        device: str | None,
        name: str,
    ) -> None:
        super().__init__(name=name)
        self._rng_seed = seed
        self.replica_id = replica_id
        self._worker_id = worker
        self.key = int(self._sequence(_DOMAIN_STREAM).generate_state(1, np.uint64)[0])
        placement = tf.device(device) if device is not None else contextlib.nullcontext()
        with tf.init_scope(), placement:
            # A ResourceVariable built directly bypasses the variable-creator stack, so the
            # state is one plain variable per stream under any strategy scope (never
            # mirrored, never sharded, placed by ReplicaRNG alone).
            self.state = resource_variable_ops.ResourceVariable(
                [0, 0, _to_int64(self.key)],
                trainable=False,
                dtype=tf.int64,
                name=f"{name}_state",
            )

    @property
    def worker(self) -> tuple[str, int]:
        """The ``(task_type, task_id)`` of the worker, part of the key."""
        return (str(self._worker_id[0]), int(self._worker_id[1]))

    def __repr__(self) -> str:
        task_type, task_id = self.worker
        return (
            f"<safevars.ReplicaStream replica={self.replica_id} worker={task_type}:{task_id} "
            f"key={self.key:#018x}>"
        )

    def _generate(self, kernels: _Kernels, shape: Any, **kwargs: Any) -> tf.Tensor:
        """Draws ``philox(key, counter)`` values of ``shape`` and advances the counter.

        Two equivalent forms (bitwise the same values and final state, tested):

        * fused: one kernel fetches the counter, fills the output and advances the
          counter by the number of elements, under the state variable's mutex;
        * split: ``RngReadAndSkip`` fetches-and-advances the counter atomically, then
          the stateless kernel fills the output from the fetched key and counter outside
          the mutex (what ``tf.random.Generator`` does).

        Eagerly, and in a graph for draws of fewer than ``_FUSED_MAX_ELEMENTS`` (4,096)
        static elements, the fused form runs (one op instead of four). Larger or
        dynamic draws in a graph use the split form, so that independent draws of one
        graph fill their outputs in parallel (the measurements behind 4,096 are in
        :mod:`.kernels`).
        """
        fused, stateless = kernels
        shape = _shape(shape)
        if tf.executing_eagerly():
            return fused(self.state.handle, _PHILOX, shape, **kwargs)
        size = _static_num_elements(shape)
        if size is not None and size < _FUSED_MAX_ELEMENTS:
            return fused(self.state.handle, _PHILOX, shape, **kwargs)
        state = _read_and_skip(self.state.handle, _delta(shape, size))
        return _stateless_draw(stateless, shape, state, **kwargs)

    def keras_seed_generator(self, name: str | None = None) -> Any:
        """A ``keras.random.SeedGenerator`` whose ``next()`` draws from this stream.

        See :meth:`ReplicaRNG.keras_seed_generator` for the replica-aware variant.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return _seed_generator_class()(self.make_seed, self.seed_for("keras", name or ""), name)


class _SelectedStream(_Draws):
    """The stream whose state handle is ``handles[index]``, in a graph.

    Used when the stream is only known when the graph runs: a replica id that is a
    run-time tensor (one ``tf.switch_case`` picks the counter to fetch-and-advance), or,
    under ``ParameterServerStrategy``, a handle bound when the coordinator calls the
    function on a worker (a single handle, no control flow). ``RngReadAndSkip`` runs on
    the state's device; the stateless kernel then fills the values where the draw runs.
    They are bitwise those the chosen :class:`ReplicaStream` would draw.
    """

    def __init__(self, handles: Sequence[tf.Tensor], index: int | tf.Tensor) -> None:
        self._handles = tuple(handles)
        self._index = index

    def _generate(self, kernels: _Kernels, shape: Any, **kwargs: Any) -> tf.Tensor:
        _, stateless = kernels
        shape = _shape(shape)
        delta = _delta(shape, _static_num_elements(shape))
        if isinstance(self._index, int):
            state = _read_and_skip(self._handles[self._index], delta)
        else:
            state = tf.switch_case(
                tf.cast(self._index, tf.int32),
                [functools.partial(_read_and_skip, h, delta) for h in self._handles],
            )
        return _stateless_draw(stateless, shape, state, **kwargs)
