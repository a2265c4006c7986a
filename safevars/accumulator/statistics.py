"""The statistics record of a GradientAccumulator, and the counters it is read from.

The accumulator keeps its statistics in one int64 variable of :data:`_NUM_COUNTERS`
counters (checkpointed with the state, and changed in the same critical section as the
state); :class:`AccumulatorStatistics` lists them in the same order, so a read of the
variable is the record (``AccumulatorStatistics(*counters)``).
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

__all__ = ["AccumulatorStatistics"]

# Counter positions in the int64 counters variable.
_PENDING, _ADDED, _DROPPED, _REJECTED, _SCALED, _TAKEN, _TAKES, _DISCARDED = range(8)
_NUM_COUNTERS = 8


def _taken_delta(pending: tf.Tensor, takes: int | tf.Tensor) -> tf.Tensor:
    """The counters' change when a traced take hands out ``pending`` contributions
    (int64): ``taken`` up and ``pending`` down by that many, ``takes`` up by
    ``takes``."""
    delta = tf.one_hot(_TAKEN, _NUM_COUNTERS, dtype=tf.int64) * pending
    delta -= tf.one_hot(_PENDING, _NUM_COUNTERS, dtype=tf.int64) * pending
    return delta + tf.one_hot(_TAKES, _NUM_COUNTERS, dtype=tf.int64) * takes


class AccumulatorStatistics(NamedTuple):
    """A frozen record of what an accumulator has seen (see ``statistics()``).

    Invariant: ``added == pending + taken + discarded``.

    Attributes:
      pending: Contributions accumulated and not yet taken (``count``).
      added: Contributions accumulated since construction (or the checkpoint).
      dropped_stale: Contributions dropped as stale (``on_stale="drop"``).
      rejected: Contributions skipped as non-finite (``nonfinite="skip"``).
      scaled: Accumulated contributions that were scaled down as stale.
      taken: Contributions handed out by ``take``.
      takes: Calls of ``take`` that took something (also the accumulator's version).
      discarded: Contributions thrown away by ``reset``.
    """

    pending: int | tf.Tensor
    added: int | tf.Tensor
    dropped_stale: int | tf.Tensor
    rejected: int | tf.Tensor
    scaled: int | tf.Tensor
    taken: int | tf.Tensor
    takes: int | tf.Tensor
    discarded: int | tf.Tensor
