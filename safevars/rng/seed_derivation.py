"""Seed derivation: every key and seed of :mod:`safevars.rng` comes from one SeedSequence.

A stream's Philox key and every pure seed (:meth:`~safevars.ReplicaRNG.seed_for`,
:meth:`~safevars.ReplicaRNG.numpy`, ...) is drawn from
``numpy.random.SeedSequence(seed, spawn_key=(domain, sha256(task_type)[:8], task_id,
replica_id, *words))`` (:func:`_sequence`): a stable, documented function, never Python's
``hash``. The domain keeps kinds of derived values apart; user keys (ints and strings)
become spawn-key words (:func:`_key_words`). ``safevars.data`` derives its epoch orders
here too (domain 5).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from safevars._validation import is_int
from safevars.errors import InvalidArgumentError

_UINT64 = 1 << 64
_INT64_MAX = (1 << 63) - 1
_SEED31_MAX = (1 << 31) - 1  # seed_for(): in [0, 2**31 - 1), safe for Keras and tf.data

# SeedSequence spawn-key domains: one per kind of derived value, so that no two kinds of
# value ever share a SeedSequence (a TF stream key never equals a numpy seed, ...).
_DOMAIN_STREAM = 0
_DOMAIN_NUMPY = 1
_DOMAIN_SEED = 2
_DOMAIN_DATASET = 3
_DOMAIN_ELEMENT = 4
_DOMAIN_SHUFFLE = 5  # reserved: safevars.data's per-epoch order (data/_layout.py)

_KEY_INT = 0
_KEY_STR = 1


def _key_words(keys: Sequence[Any], argument: str) -> tuple[int, ...]:
    """Encodes user keys (non-negative ints or strings) as SeedSequence spawn-key words."""
    words: list[int] = []
    for key in keys:
        if isinstance(key, str):
            words += [_KEY_STR, _stable_int(key)]
        elif is_int(key) and int(key) >= 0:
            words += [_KEY_INT, int(key)]
        else:
            raise InvalidArgumentError(
                f"{argument} must be non-negative ints or strings, got {key!r} of type "
                f"{type(key).__name__}. Name the seed, for example seed_for('dropout', 1)."
            )
    return tuple(words)


def _stable_int(text: str) -> int:
    """A 64-bit integer of ``text`` that is the same in every process (SHA-256)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little")


def _to_int64(value: int) -> int:
    """Reinterprets an unsigned 64-bit integer as a signed one (two's complement)."""
    return value - _UINT64 if value > _INT64_MAX else value


def _sequence(
    seed: int, worker: tuple[str, int], domain: int, replica_id: int, *words: int
) -> np.random.SeedSequence:
    """The SeedSequence every derived value of ``(seed, worker, replica, ...)`` comes from.

    ``SeedSequence(seed, spawn_key=(domain, sha256(task_type)[:8], task_id, replica_id,
    *words))``: stable across processes, platforms and numpy versions (numpy keeps
    ``SeedSequence`` bit-compatible).
    """
    task_type, task_id = worker
    spawn_key = (domain, _stable_int(task_type), task_id, replica_id, *words)
    return np.random.SeedSequence(seed, spawn_key=spawn_key)


def _seed31(sequence: np.random.SeedSequence) -> int:
    return int(sequence.generate_state(1, np.uint32)[0]) % _SEED31_MAX


def _seed63(sequence: np.random.SeedSequence) -> int:
    return int(sequence.generate_state(1, np.uint64)[0]) & _INT64_MAX
