"""The reproducible summation behind ``GradientAccumulator(deterministic=True)``.

How determinism is achieved (``deterministic=True``):
  ``add`` stores each contribution as one float32 block of a buffer (float16 and
  bfloat16 widen to float32 exactly), at the next free block: one copy, no arithmetic (a
  block is one row, or for large gradients several rows; :mod:`.state`). With large
  gradients the first blocks are kept by reference instead, one variable per piece,
  and are read in place as the first rows (``leading``). Here a "row" is
  one contribution's block. ``take`` reduces the pending rows by one of two methods,
  picked by their number alone:

  * **Up to four** (:func:`_sorted_sum`; the common case: accumulating K <= 4
    micro-batches): each element's values are put in ascending order by a sorting
    network (five elementwise minimum/maximum pairs: the sorted values are the same
    whatever order they came in) and added in float64 in a fixed order, the smallest
    and the largest first: ``(x0 + x3) + (x1 + x2)``. The float64 sum differs from the
    exact one by at most ``2**-53`` of the exact sum plus ``2**-51`` of the largest
    magnitude.
  * **More** (:func:`_grid_sum`): a two-level *reproducible summation* (after Demmel
    and Nguyen, "Fast Reproducible Floating-Point Summation", ARITH 2013): for each
    element, with ``M`` the largest magnitude among its values (a maximum does not
    depend on order), every value is split exactly into a multiple of a grid ``q1``
    derived from ``M`` and the count, a multiple of a finer grid ``q2`` and a
    remainder below ``q2``. The multiples are integers small enough that their float64
    sums are exact in any order; the remainders (below ``2**-87 * M`` in total for up
    to 64 contributions) are dropped, and ``sum1 * q1 + sum2 * q2`` is rounded once.

  The float64 sum is then divided by the count once and rounded once to the variable's
  dtype (for float16 and bfloat16 variables twice: TensorFlow and XLA cast float64 to
  them through float32, which can differ from one rounding in the last bit; still a
  function of the value alone). Every step is exact, a fixed sequence of IEEE roundings
  or an order-free sort, so the result depends only on the multiset of contributions,
  not on their order, their rows, the summation order TensorFlow or XLA picks, or the
  device; and it is within float32 rounding of the exact mean unless the contributions
  cancel to below about ``2**-60`` of their largest value (``2**-26`` for up to four:
  a float32 running sum, Keras' accumulator, is off by a float32 rounding per addition).
  The sorted sum replaced the grid for up to four contributions on 2026-11-27: in one
  process, per micro-step of the accumulator benchmark against Keras, 1.163x -> 1.128x
  (1.3M parameters) and 1.122x -> 1.098x (26K), 40 rotated rounds each. It kept each
  addition's rounding error exactly (Knuth's TwoSum) until the same day, for a sum
  within one float64 rounding plus ``2**-98`` of the largest value; that arithmetic made
  the 1.3M model's ``add_and_take`` micro-steps 1.08-1.11x Keras against 1.03-1.05x
  without it (its reductions run beside the backward pass, where each operation
  competes with it for the cores). The reduction is
  one XLA-compiled function (``jit_compile=True``) that reads the buffer in place, under
  the lock; the grid combines four rows at a time by elementwise ops, so that up to four
  contributions would be a single vectorized pass; XLA does not change the result.
  (TensorFlow's CPU kernels flush float32 subnormals to zero; both methods see them as
  zeros.)

The row buffer is filled by :mod:`.commit` and read, in place and under the lock, by
:mod:`.take`, which calls :func:`_reproducible_sum` from one compiled function.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

# Rows combined elementwise by the reduction (see _reproducible_sum).
_GROUP = 4
# Up to this many contributions are summed by sorting them (see _sorted_sum).
_SORTED = 4
# A sorting network for four values (Knuth, TAOCP 5.3.4; optimal: five comparators).
_NETWORK = ((0, 1), (2, 3), (0, 2), (1, 3), (1, 2))
# Pending counts up to this read a power of two of rows at take, beyond it all rows.
_MARKER_TABLE = 1024
_LN2 = float(np.log(2.0))
_POWER_BITS = 1 << 52  # float64 bits of the exponent field's least significant bit
_EXPONENT_FIELD = 0x7FF << 52


@functools.cache
def _marker_shapes_array() -> np.ndarray:
    shapes = [[1 << (max(i, _GROUP) - 1).bit_length(), 0] for i in range(_MARKER_TABLE)]
    return np.array(shapes + [[2**30, 0]], np.int32)  # 2**30: the whole buffer


def _marker_shapes() -> tf.Tensor | np.ndarray:
    """Row i: the shape of take's marker for i pending rows (see ``_reduce_rows``).

    A constant in a graph (one gather picks the row: cheaper than computing a power of
    two with scalar ops); the array itself eagerly.
    """
    table = _marker_shapes_array()
    return table if tf.executing_eagerly() else tf.constant(table)


def _reproducible_sum(
    rows: tf.Tensor,
    count: tf.Tensor,
    leading: Sequence[tf.Tensor] = (),
    most: int | None = None,
) -> tf.Tensor:
    """Per-element sums of the first ``count`` rows, independent of the rows' order.

    Args:
      rows: float32 ``[b, n]``; rows at ``count`` and beyond are ignored.
      count: int64 scalar, at most ``b`` (plus ``len(leading)``).
      leading: float32 ``[n]`` rows that come before ``rows`` (row ``j`` of the
        whole is ``leading[j]``, then ``rows[j - len(leading)]``): the blocks kept by
        reference (:mod:`.state`), read where they are rather than stacked.
      most: a bound on ``count`` known when tracing (``max_pending``), if any.

    Returns:
      float64 ``[n]``. See the module docstring for the methods and their error
      bounds: :func:`_sorted_sum` of the first :data:`_SORTED` rows when ``count`` is
      at most that, else :func:`_grid_sum`. Non-finite values propagate as in IEEE
      addition (+Inf and -Inf give NaN).
    """
    count = tf.cast(count, tf.int64)

    def first_rows() -> list[tf.Tensor]:
        # The first _SORTED rows of the whole (the buffer's padded if it has fewer).
        from_rows = _SORTED - min(len(leading), _SORTED)
        padded = rows
        if from_rows:
            b = tf.shape(rows, out_type=tf.int64)[0]
            padded = tf.pad(rows, [[0, tf.maximum(from_rows - b, 0)], [0, 0]])
        return list(leading[:_SORTED]) + [padded[j] for j in range(from_rows)]

    # Only the sorted sum where the count cannot exceed _SORTED. XLA turns a cond
    # whose branches are elementwise into a select of both, so the grid would be
    # computed for every element too (the 26K-parameter benchmark model's fused
    # reduction: 23-32 µs per take under the profiler with it, 16-23 µs without).
    bound = rows.shape[0]
    bound = None if bound is None else bound + len(leading)
    if most is not None:
        bound = most if bound is None else min(bound, most)
    if bound is not None and bound <= _SORTED:
        return _sorted_sum(first_rows(), count)
    # Under XLA the rows' number is a constant of the compiled function (take compiles
    # once per power of two of the pending rows), so XLA folds this to true and keeps
    # only the sorted sum when there are few rows.
    few = tf.shape(rows, out_type=tf.int64)[0] + len(leading) <= _SORTED
    return tf.cond(
        few | (count <= _SORTED),
        lambda: _sorted_sum(first_rows(), count),
        lambda: _grid_sum(rows, count, leading),
    )


def _sorted_sum(values: Sequence[tf.Tensor], count: tf.Tensor) -> tf.Tensor:
    """Per-element sums of ``values[:count]`` (float32 ``[n]`` each, ``count`` at most
    :data:`_SORTED`), independent of their order.

    The values past ``count`` and every zero are made +0.0, each element's values are
    put in ascending order by :data:`_NETWORK` (a sorting network: elementwise
    minima and maxima, so the sorted row is the same whatever order the values came
    in; equal values are then the same bits: with -0.0 and +0.0 both present, a
    minimum and a maximum may return the same one of them, TensorFlow's CPU kernels
    do, and the sum's sign would depend on the order), then widened to float64 and
    added in a fixed order, ``(x0 + x3) + (x1 + x2)``: the smallest and the largest
    first, so that opposite values cancel before anything else is added
    (``1 + 2**-110 - 1`` is ``2**-110`` exactly). The masking and the sort run in
    float32 (widening is exact and keeps the order, so the sorted values are the same
    as in float64, at half the width per operation: in the accumulator benchmark's
    26K-parameter micro-steps, 11-28 µs less per micro-step in 5 of 6 processes against
    sorting in float64). Three roundings: the sum differs from the exact one by at
    most ``2**-53`` of the exact sum plus ``2**-51`` of the largest magnitude (each
    pair's sum is at most twice it).
    Keeping the roundings' errors (TwoSum) would bring that to one rounding plus
    ``2**-98``, at about 20 more float64 operations per element (the module
    docstring says what they cost). Infinities need nothing more: they sort to the
    ends and the float64 additions give what IEEE addition of the values gives (+Inf
    and -Inf: NaN; a float64 sum of four float32 values cannot overflow). A NaN is not
    left to the minima and maxima (XLA's CPU ones return the other operand when the
    second is NaN): where any value is NaN the result is NaN. A sum of zeros is +0.0,
    -0.0 ones included.
    """
    zero = tf.constant(0.0, tf.float32)
    xs = [tf.where((j < count) & (x != 0), x, zero) for j, x in enumerate(values)]
    nan = functools.reduce(tf.logical_or, [tf.math.is_nan(x) for x in xs])
    for i, j in _NETWORK:
        xs[i], xs[j] = tf.minimum(xs[i], xs[j]), tf.maximum(xs[i], xs[j])
    wide = [tf.cast(x, tf.float64) for x in xs]
    total = (wide[0] + wide[3]) + (wide[1] + wide[2])
    return tf.where(nan, tf.constant(np.nan, tf.float64), total)


def _grid_sum(rows: tf.Tensor, count: tf.Tensor, leading: Sequence[tf.Tensor] = ()) -> tf.Tensor:
    """:func:`_reproducible_sum` by the two-level grid (any ``count``).

    The rows are taken in groups of :data:`_GROUP` (the last one padded with ignored
    rows): within a group the rows are combined by elementwise ops, across groups by
    reductions, so with up to ``_GROUP`` rows XLA compiles the whole sum into one
    vectorized pass. The grouping does not change the result: maxima, and sums of
    integers below 2**53, are exact in any order.
    """
    count = tf.cast(count, tf.int64)
    n = rows.shape[1]
    b = tf.shape(rows, out_type=tf.int64)[0]
    rows = tf.pad(rows, [[0, tf.math.floormod(-b, _GROUP)], [0, 0]])
    groups = tf.reshape(rows, [-1, _GROUP, n if n is not None else -1])
    first = tf.range(tf.shape(groups, out_type=tf.int64)[0]) * _GROUP + len(leading)
    xs = [
        tf.where(
            (first + j < count)[:, None],
            tf.cast(groups[:, j], tf.float64),
            tf.zeros([], tf.float64),
        )
        for j in range(_GROUP)
    ]  # [groups, n] each: row j of every group
    ones = [
        tf.where(j < count, tf.cast(x, tf.float64), tf.zeros([], tf.float64))
        for j, x in enumerate(leading)
    ]  # [n] each
    # An empty ``rows`` (every pending row is a leading one) reduces to -inf here.
    biggest = tf.reduce_max(functools.reduce(tf.maximum, [tf.abs(x) for x in xs]), axis=0)
    if ones:
        biggest = functools.reduce(tf.maximum, [tf.abs(x) for x in ones], biggest)
    # 2**floor(log2(biggest)) as float64 bits (its exponent field), clamped to
    # [2**-160, 2**128]: below for zeros, above for Inf/NaN.
    unit = tf.clip_by_value(
        tf.bitwise.bitwise_and(tf.bitcast(biggest, tf.int64), _EXPONENT_FIELD),
        _POWER_BITS * (1023 - 160),
        _POWER_BITS * (1023 + 128),
    )
    # count <= 2**log_count, so count integers below 2**(52 - log_count) sum exactly.
    log_count = tf.cast(
        tf.math.ceil(tf.math.log(tf.cast(tf.maximum(count, 1), tf.float64)) / _LN2),
        tf.int64,
    )
    # Grids q1 = 2**(e + 1 + log_count - 52) and q2 = 2**(e + 2 * log_count - 104), e
    # the exponent of biggest, and their inverses: powers of two, so scaling by them is
    # exact; built by adding to the exponent field (2**-k has field 2046 - field(2**k)).
    q1_bits = unit + _POWER_BITS * (1 + log_count - 52)
    q2_bits = unit + _POWER_BITS * (2 * log_count - 104)
    q1, q2 = tf.bitcast(q1_bits, tf.float64), tf.bitcast(q2_bits, tf.float64)
    inverse1 = tf.bitcast(_POWER_BITS * 2046 - q1_bits, tf.float64)
    inverse2 = tf.bitcast(_POWER_BITS * 2046 - q2_bits, tf.float64)

    def split(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        n1 = tf.round(x * inverse1)  # |n1| <= 2**(52 - log_count)
        return n1, tf.round((x - n1 * q1) * inverse2)  # exact remainder; same bound

    parts = [split(x) for x in xs]
    # Exact whatever the order: integers below 2**53.
    total1 = tf.reduce_sum(tf.add_n([p[0] for p in parts]), axis=0)
    total2 = tf.reduce_sum(tf.add_n([p[1] for p in parts]), axis=0)
    if ones:
        parts = [split(x) for x in ones]
        total1 = tf.add_n([total1] + [p[0] for p in parts])
        total2 = tf.add_n([total2] + [p[1] for p in parts])
    return tf.where(tf.math.is_finite(total1), total1 * q1 + total2 * q2, total1)
