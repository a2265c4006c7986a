"""Contributions from the replicas of a ``tf.distribute`` strategy.

Inside ``strategy.run`` every replica's contribution counts once and the state is one
non-distributed copy. ``MirroredStrategy``: the replicas' contributions are committed
in one ``merge_call``, in replica order (:meth:`_Replicas._merge_add`).
``MultiWorkerMirroredStrategy``: every replica's contribution, with its value checks
and version, is all-gathered first, so every worker commits the same contributions in
the same order (:meth:`_Replicas._add_across_workers`). In cross-replica context a
``PerReplica`` structure is split into one contribution per replica
(:func:`_per_replica`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from safevars.accumulator.state import _AccumulatorBase, _Part


class _Replicas(_AccumulatorBase):
    """``add`` inside ``strategy.run``: one commit for all replicas (of every worker)."""

    def _merge_add(self, strategy: tf.distribute.Strategy, part: tuple, take: bool = False) -> Any:
        replicas = strategy.num_replicas_in_sync  # all local: no replica on other workers
        fields = [_local_values(x, replicas) for x in part]
        parts = [_Part(*(f[r] for f in fields)) for r in range(replicas)]
        return self._commit(parts, take)

    def _add_across_workers(
        self,
        ctx: tf.distribute.ReplicaContext,
        gradients: Any,
        version: Any,
        take: bool = False,
    ) -> Any:
        """``add`` in a replica of a strategy whose replicas span processes.

        Every replica's contribution, with its value-dependent flags (finite, sparse
        indices in range) and versions, is all-gathered first, so every worker checks
        and commits the same contributions in the same (replica) order: the workers'
        states stay equal, each contribution counts once in each, and a refused
        contribution fails every worker's step alike (none is left waiting in a
        collective).
        """
        entries, part, in_range = self._compute(gradients, version)
        replicas = ctx.num_replicas_in_sync
        sparse = 0 if in_range is None else int(in_range.shape[0])
        by_element = part.elements is not None
        if part.version_kind == "each":
            versions = tuple(part.version)
        elif part.version_kind == "int":
            versions = (part.version,)
        else:
            versions = ()
        finite = True if part.finite is None else part.finite
        ints = [tf.reshape(tf.cast(finite, tf.int64), [1])]
        if in_range is not None:
            ints.append(tf.cast(in_range, tf.int64))
        if by_element:
            ints.append(tf.reshape(tf.size(part.values, out_type=tf.int64), [1]))
        ints.extend(tf.reshape(tf.cast(v, tf.int64), [1]) for v in versions)
        values = part.values
        if isinstance(values, tuple):  # a deterministic block's pieces: the block, flat
            values = tf.concat([tf.reshape(p, [-1]) for p in values], 0)
        local = [tf.concat(ints, 0)[None], values if by_element else values[None]]
        if by_element:
            local.append(part.elements)
        gathered = ctx.all_gather(local, axis=0)

        def merge(strategy: tf.distribute.Strategy, gathered: Any) -> Any:
            # Every local replica holds the same gathered tensors: use the first's.
            small, values, *rest = [strategy.experimental_local_results(x)[0] for x in gathered]
            elements = rest[0] if rest else None
            in_range = tf.cast(small[:, 1 : 1 + sparse], tf.bool) if sparse else None
            elements, values, finite = self._check(
                entries, elements, values, tf.cast(small[:, 0], tf.bool), in_range
            )
            column = 1 + sparse
            if by_element:
                lengths = small[:, column]
                value_parts = tf.split(values, lengths, num=replicas)
                element_parts = tf.split(elements, lengths, num=replicas)
                column += 1
            else:
                value_parts = tf.unstack(values, num=replicas)
                element_parts = [None] * replicas
            eager = tf.executing_eagerly()
            table = small.numpy() if eager else small
            finite_flags = (
                finite
                if finite is True
                else (
                    [bool(f) for f in np.asarray(finite).tolist()]
                    if eager
                    else tf.unstack(finite, num=replicas)
                )
            )
            parts = []
            for r in range(replicas):
                row = [table[r, column + i] for i in range(len(versions))]
                if eager:
                    row = [int(x) for x in row]
                if part.version_kind == "each":
                    version_r: Any = tuple(row)
                elif part.version_kind == "int":
                    version_r = row[0]
                else:
                    version_r = None
                parts.append(
                    _Part(
                        element_parts[r],
                        value_parts[r],
                        True if finite_flags is True else finite_flags[r],
                        part.version_kind,
                        version_r,
                    )
                )
            return self._commit(parts, take)

        return ctx.merge_call(merge, args=(tuple(gathered),))


def _replica_context() -> tf.distribute.ReplicaContext | None:
    """The replica context of a non-default strategy's ``run``, else None."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    return tf.distribute.get_replica_context()


def _spans_workers(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether some of ``strategy``'s replicas run in other processes (multi-worker)."""
    if strategy is None:
        return False
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def _holds_distributed(*structures: Any) -> bool:
    return any(
        isinstance(x, tf.distribute.DistributedValues)
        for structure in structures
        for x in tf.nest.flatten(structure)
    )


def _per_replica(gradients: Any) -> list[Any]:
    """Splits a structure holding PerReplica leaves into one structure per replica."""
    leaves = tf.nest.flatten(gradients)
    distributed = [x for x in leaves if isinstance(x, tf.distribute.DistributedValues)]
    if not distributed:
        return [gradients]
    replicas = len(distributed[0].values)
    per_leaf = [_local_values(x, replicas) for x in leaves]
    return [
        tf.nest.pack_sequence_as(gradients, [leaf[r] for leaf in per_leaf])
        for r in range(replicas)
    ]


def _local_values(value: Any, replicas: int) -> list[Any]:
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    if isinstance(value, tuple) and not isinstance(value, tf.Tensor):
        fields = [_local_values(v, replicas) for v in value]
        return [tuple(f[r] for f in fields) for r in range(replicas)]
    return [value] * replicas
