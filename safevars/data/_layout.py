"""Which element goes to which shard in which epoch, and the ``tf.data`` stream of a shard.

Pure functions of a :class:`Layout`: no TensorFlow state is read or written here (the
position comes in as a tensor). :mod:`safevars.data.sharded` builds the checkpointable
object on top.

The assignment, for ``n`` elements, ``S`` shards (``num_workers * replicas_per_worker``),
shard ``g = worker * replicas_per_worker + replica`` and epoch ``e``:

* slot ``k`` of shard ``g`` is position ``p = k * S + g`` of the epoch's order (strided, so
  the first ``k`` slots of every shard together are the first ``k * S`` positions);
* the epoch's order maps position ``p`` to element
  ``RandomIndexShuffle(p, seed=[base_key, e], max_index=n - 1)`` (``p`` itself with
  ``shuffle=False``), a stateless bijection of ``[0, n)``;
* the tail (``n = q * S + r``, ``0 < r < S``) follows ``remainder``: ``"spread"``: shards
  ``g < r`` have ``q + 1`` slots, the others ``q`` (every element exactly once);
  ``"drop"``: every shard has ``q`` slots (the last ``r`` positions, different elements in
  every epoch, are not delivered in that epoch); ``"pad"``: every shard has ``q + 1``
  slots and slot positions ``p >= n`` wrap to ``p mod n`` (the epoch's first ``S - r``
  elements come again; each copy has weight 0).

Every slot has a *counter* ``e * L_g + k`` (``L_g`` the slots of shard ``g`` per epoch):
the number of slots of the shard before it since epoch 0. The position of a shard is the
counter of its next slot.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import tensorflow as tf

from safevars.data._source import Elements
from safevars.rng.seed_derivation import _DOMAIN_SHUFFLE, _INT64_MAX, _seed63, _sequence

REMAINDER_POLICIES = ("spread", "drop", "pad")

# The epoch order's key is derived in its own SeedSequence domain (_DOMAIN_SHUFFLE,
# reserved for it in safevars.rng), so it never equals one of rng's derived values.
_IDENTITY = ("safevars.data", 0)  # not a task: the order is the same on every worker
_CHUNK = 256  # Elements looked up per gather when the pipeline is not batched...
_WHOLE_EPOCH_BYTES = 64 << 20  # ...and an epoch of the shard takes more than this.


def shuffle_key(seed: int) -> int:
    """The 63-bit key of every epoch order of ``seed``: ``[key, epoch]`` seeds epoch ``epoch``."""
    return _seed63(_sequence(seed, _IDENTITY, _DOMAIN_SHUFFLE, 0))


@dataclasses.dataclass(frozen=True)
class Layout:
    """The assignment of ``num_elements`` elements to shards, per epoch.

    Attributes:
      num_elements: ``n >= 1``.
      num_workers: Workers (input pipelines), ``>= 1``.
      replicas_per_worker: Replicas of each worker, ``>= 1``.
      remainder: One of :data:`REMAINDER_POLICIES`.
      shuffle: Whether epochs are shuffled (else position ``p`` is element ``p``).
      seed: The seed the epoch orders derive from.
    """

    num_elements: int
    num_workers: int
    replicas_per_worker: int
    remainder: str
    shuffle: bool
    seed: int

    @property
    def num_shards(self) -> int:
        return self.num_workers * self.replicas_per_worker

    @property
    def key(self) -> int:
        return shuffle_key(self.seed)

    def fingerprint(self) -> int:
        """A 63-bit digest of everything a position depends on (checked on restore)."""
        text = repr(
            (
                "safevars.data.Layout/1",
                self.num_elements,
                self.num_workers,
                self.replicas_per_worker,
                self.remainder,
                self.shuffle,
                self.seed,
            )
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & _INT64_MAX

    def shard_length(self, shard: int) -> int:
        """Slots of shard ``shard`` per epoch (Python)."""
        q, r = divmod(self.num_elements, self.num_shards)
        if self.remainder == "drop":
            return q
        if self.remainder == "pad":
            return q + (1 if r else 0)
        return q + (1 if shard < r else 0)

    def shard_length_tensor(self, shard: tf.Tensor) -> tf.Tensor:
        """Slots of shard ``shard`` (an int64 tensor) per epoch, as an int64 tensor."""
        q, r = divmod(self.num_elements, self.num_shards)
        if self.remainder == "spread":
            return tf.constant(q, tf.int64) + tf.cast(shard < r, tf.int64)
        return tf.constant(self.shard_length(0), tf.int64)

    def epoch_slots(self, shard: Any, epoch: Any, begin: Any, length: Any) -> dict[str, tf.Tensor]:
        """Slots ``begin..length-1`` of ``shard`` in ``epoch``: ids, receipts, weights.

        All arguments are int64 scalars (tensors or ints); one vectorized computation per
        epoch, so the pipeline only slices these per element.
        """
        n, num_shards = self.num_elements, self.num_shards
        slot = tf.range(begin, length, dtype=tf.int64)
        position = slot * num_shards + shard
        weight = tf.cast(position < n, tf.float32)
        if self.remainder == "pad":
            position = position % n
        if self.shuffle:
            seed = tf.stack([tf.constant(self.key, tf.int64), tf.cast(epoch, tf.int64)])
            ids = tf.random.experimental.index_shuffle(
                position, seed, tf.constant(n - 1, tf.int64)
            )
        else:
            ids = position
        counter = epoch * length + slot
        receipt = tf.stack([tf.fill(tf.shape(counter), tf.cast(shard, tf.int64)), counter], -1)
        return {"id": ids, "receipt": receipt, "weight": weight}


def _finish(elements: Elements, element: Any, weight: tf.Tensor) -> Any:
    return (element, weight) if elements.with_weights else element


def shard_stream(
    layout: Layout,
    elements: Elements,
    shard: Any,
    start: tf.Tensor,
    batch_size: int | None,
    epochs: int | None,
) -> tf.data.Dataset:
    """The ``(element, receipt)`` dataset of ``shard`` from counter ``start`` on.

    ``receipt`` is ``[shard, counter]`` (int64, ``[batch, 2]`` when batched). Batches never
    cross an epoch boundary (an epoch's last batch may be short). ``shard`` may be an int or
    an int64 tensor (the worker index under ``ParameterServerStrategy``).
    """
    shard = tf.cast(shard, tf.int64)
    start = tf.cast(start, tf.int64)
    length = layout.shard_length_tensor(shard)
    first_epoch, first_slot = start // length, start % length
    stop = (
        tf.constant(_INT64_MAX, tf.int64)
        if epochs is None
        else first_epoch + tf.constant(epochs, tf.int64)
    )
    parallel = dict(num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    whole_epochs = batch_size is None and _gathers_whole_epochs(layout, elements)

    def gather(s: dict[str, tf.Tensor]) -> Any:
        # One lookup per batch, epoch or chunk: no function call per element.
        return _finish(elements, elements.lookup_one(s["id"]), s["weight"]), s["receipt"]

    def one_epoch(epoch: tf.Tensor) -> tf.data.Dataset:
        begin = tf.where(tf.equal(epoch, first_epoch), first_slot, tf.constant(0, tf.int64))
        epoch_slots = layout.epoch_slots(shard, epoch, begin, length)
        if whole_epochs:
            # The rest of the epoch in one gather, then its rows. On the data benchmark's
            # single elements (--cases data --repeat 3, 2026-11-27): 0.99 [0.97, 1.00]
            # the plain shard().shuffle(), against 1.02 [1.01, 1.05] with chunks of 256
            # unbatched (docs/history.md, for the shapes tried).
            return tf.data.Dataset.from_tensor_slices(gather(epoch_slots))
        slots = tf.data.Dataset.from_tensor_slices(epoch_slots)
        if elements.vectorized:
            if batch_size is not None:
                return slots.batch(batch_size).map(gather, **parallel)
            # Chunks are gathered one after the other: one gather per 256 elements, run
            # ahead of the consumer by the prefetch after the stream. Parallel calls only
            # added threads: on 2 cores the single-element pipeline took 1.044x the plain
            # shard().shuffle() with them, 1.013x without (3 pipelines each, 40 rotated
            # rounds, one process, 2026-11-27).
            return slots.batch(_CHUNK).map(gather).unbatch()

        def one(s: dict[str, tf.Tensor]) -> Any:
            element = elements.lookup_one(s["id"])
            if elements.map_fn is not None:
                element = elements.map_fn(element)
            return _finish(elements, element, s["weight"]), s["receipt"]

        out = slots.map(one, **parallel)
        return out if batch_size is None else out.batch(batch_size)

    return tf.data.Dataset.range(first_epoch, stop).flat_map(one_epoch)


def _gathers_whole_epochs(layout: Layout, elements: Elements) -> bool:
    """Whether an unbatched stream looks up an epoch of its shard at once: when the
    elements are looked up by one gather, and an epoch of the largest shard (receipts and
    weights included) takes at most ``_WHOLE_EPOCH_BYTES``. Else chunks of ``_CHUNK``."""
    row = elements.row_bytes() if elements.vectorized else None
    if row is None:
        return False
    row += 16 + (4 if elements.with_weights else 0)  # the receipt, the weight
    return layout.shard_length(0) * row <= _WHOLE_EPOCH_BYTES


def worker_stream(
    layout: Layout,
    elements: Elements,
    worker: Any,
    positions: tf.Tensor,
    batch_size: int | None,
    epochs: int | None,
) -> tf.data.Dataset:
    """Worker ``worker``'s pipeline: its replicas' shards, one batch (or element) of each
    in turn, each from its position in ``positions``; ``worker`` may be a tensor."""
    replicas = layout.replicas_per_worker
    streams = []
    for replica in range(replicas):
        shard = tf.cast(worker, tf.int64) * replicas + replica
        streams.append(
            shard_stream(layout, elements, shard, tf.gather(positions, shard), batch_size, epochs)
        )
    if replicas == 1:
        return streams[0]
    # Shards with more batches are the first ones ("spread"), so a round whose later
    # shards are exhausted still hands batch j to replica j.
    return tf.data.Dataset.choose_from_datasets(
        streams, tf.data.Dataset.range(replicas).repeat(), stop_on_empty_dataset=False
    )


def shard_ids(layout: Layout, shard: int, epoch: int) -> np.ndarray:
    """The element ids of ``shard`` in ``epoch``, in delivery order (computed eagerly)."""
    slots = layout.epoch_slots(
        tf.constant(shard, tf.int64),
        tf.constant(epoch, tf.int64),
        tf.constant(0, tf.int64),
        tf.constant(layout.shard_length(shard), tf.int64),
    )
    return slots["id"].numpy()
