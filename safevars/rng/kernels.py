"""The Philox kernels of a draw: fused stateful kernels and the split (skip, stateless) form.

Every draw is ``philox(key, counter)`` from a 3-element int64 state ``[counter_lo,
counter_hi, key]`` (the layout of ``tf.random.Generator``). Two equivalent forms produce
it (bitwise the same values and final state): one fused stateful kernel per distribution
(``StatefulStandardNormalV2``, ...), or ``RngReadAndSkip`` (:func:`_read_and_skip`) then
the stateless ``*V2`` kernel (:func:`_stateless_draw`). Which form a draw takes is
:meth:`ReplicaStream._generate`'s choice (:mod:`.replica_stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import gen_stateful_random_ops, gen_stateless_random_ops_v2

_PHILOX = 1  # tf.random.Algorithm.PHILOX.value

# (fused stateful kernel, stateless kernel) of each distribution: see
# ReplicaStream._generate(). Graph draws of fewer elements than _FUSED_MAX_ELEMENTS
# use the fused kernel.
_NORMAL = (
    gen_stateful_random_ops.stateful_standard_normal_v2,
    gen_stateless_random_ops_v2.stateless_random_normal_v2,
)
_TRUNCATED_NORMAL = (
    gen_stateful_random_ops.stateful_truncated_normal,
    gen_stateless_random_ops_v2.stateless_truncated_normal_v2,
)
_UNIFORM = (
    gen_stateful_random_ops.stateful_uniform,
    gen_stateless_random_ops_v2.stateless_random_uniform_v2,
)
_UNIFORM_INT = (
    gen_stateful_random_ops.stateful_uniform_int,
    gen_stateless_random_ops_v2.stateless_random_uniform_int_v2,
)
_FULL_INT = (
    gen_stateful_random_ops.stateful_uniform_full_int,
    gen_stateless_random_ops_v2.stateless_random_uniform_full_int_v2,
)
# Where the split form starts to win in a graph: the fused kernel fills its output under
# the state variable's mutex, so the draws of one stream in a graph fill one after
# another (each fill still shards over the intra-op threads); the split form's fills may
# run side by side, for three ops more per draw (RngReadAndSkip, Bitcast, SplitV).
# Measured on the 2-core development CPU on 2026-11-26 (8 draws of one stream per call,
# 60 rotated rounds): fused/split per call 0.91 at 1 element, 1.03 at 512, 1.12 at 1,024,
# 1.00 at 4,096; so the split form from 512. On 2026-11-29 (issue 44: the rng benchmark's
# graph draws of 1K elements read 1.19-1.26x tf.random.stateless_normal, goal 1.05), in
# one process, A/B against stateless_normal, 100 rotated rounds, the machine busy with
# other jobs: at 1,000 elements split 1.26 and 1.17, fused 1.01 and 1.00; at 2,048 split
# 1.15, fused 1.06; at 4,096 split 1.09, fused 1.16. Counted with callgrind (a count of
# instructions, which load does not change; 8 draws of 1,000 elements per call):
# stateless_normal 2.56M instructions per call, the same with one captured variable read
# added 2.73M, the split form 2.81M, the fused form 2.38M. What a stateful draw cannot
# avoid is the captured state variable (TensorFlow's per-call cost of a capture); the
# split form's three ops per draw come on top of it, the fused form saves two of
# stateless_normal's three. Hence the fused kernel below 4,096 elements.
_FUSED_MAX_ELEMENTS = 4096

_Kernels = tuple[Callable[..., Any], Callable[..., Any]]


def _shape(shape: Any) -> Any:
    """The shape argument of a draw; an empty shape must be an integer tensor."""
    if isinstance(shape, tf.TensorShape):
        shape = shape.as_list()
    if isinstance(shape, (tuple, list)) and not shape:
        return tf.constant([], tf.int64)
    return shape


def _static_num_elements(shape: Any) -> int | None:
    """The number of elements of a draw of ``shape``, or None if it is not static."""
    if isinstance(shape, (tf.Tensor, tf.Variable)):
        shape = tf.get_static_value(shape)
        if shape is None:
            return None
    try:
        return int(np.prod(np.asarray(shape, dtype=np.int64)))
    except (TypeError, ValueError):
        return None


def _delta(shape: Any, size: int | None) -> tf.Tensor:
    """The counter advance of a draw: its number of elements, as a uint64 scalar."""
    if size is not None:
        return tf.constant(size, tf.uint64)
    return tf.cast(tf.reduce_prod(tf.cast(shape, tf.int64)), tf.uint64)


def _read_and_skip(handle: tf.Tensor, delta: tf.Tensor) -> tf.Tensor:
    """Fetches ``[counter_lo, counter_hi, key]`` and advances the counter, atomically.

    The op runs where the state lives (a parameter server under
    ``ParameterServerStrategy``); only the three integers travel.
    """
    return gen_stateful_random_ops.rng_read_and_skip(handle, alg=_PHILOX, delta=delta)


def _stateless_draw(
    stateless: Callable[..., Any], shape: Any, state: tf.Tensor, **kwargs: Any
) -> tf.Tensor:
    """Fills ``shape`` from a fetched ``[counter_lo, counter_hi, key]`` state."""
    counter, key = tf.split(tf.bitcast(state, tf.uint64), [2, 1])
    return stateless(shape, key=key, counter=counter, alg=_PHILOX, **kwargs)
