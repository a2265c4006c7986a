"""Deterministic accumulators of one layout share their compiled reductions (``take``'s
and ``add_and_take``'s), each reading its own variables
(``safevars/accumulator/shared_reductions.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from safevars.accumulator import GradientAccumulator, shared_reductions


def _shared(acc: GradientAccumulator) -> tf.types.experimental.PolymorphicFunction:
    """The shared reduction an accumulator of ``acc``'s layout gets."""
    references = acc._helpers.references
    return shared_reductions.shared_reduction(
        acc._layout.width,
        acc._layout.chunks,
        acc._layout.firsts,
        references.shapes,
        references.count,
        acc._reduction,
        acc._shared_dtype(),
    )


@pytest.mark.parametrize("how", ["eager", "tf_function"])
def test_accumulators_of_one_layout_trace_one_reduction_and_each_takes_its_own(layout, how):
    """Two accumulators over variables of the same shapes (a layout no other test uses,
    so nothing traced it before): the second take traces nothing, and each take is the
    mean of what was added to that accumulator, not the other's."""
    shapes = ([3, 13], [17]) if layout == "one_row" else ([5, 13], [19])
    accumulators = [
        GradientAccumulator([tf.Variable(tf.zeros(shape)) for shape in shapes]) for _ in "ab"
    ]
    assert accumulators[1]._helpers.references.count == accumulators[0]._helpers.references.count
    for scale, acc in enumerate(accumulators, start=1):
        for step in (1.0, 3.0):
            acc.add([tf.fill(shape, scale * step) for shape in shapes])

    def take(acc: GradientAccumulator) -> list[tf.Tensor]:
        return acc.take() if how == "eager" else tf.function(acc.take, autograph=False)()

    for scale, acc in enumerate(accumulators, start=1):
        for shape, got in zip(shapes, take(acc)):
            np.testing.assert_array_equal(got, np.full(shape, 2.0 * scale, np.float32))
    shared = _shared(accumulators[0])
    assert shared is _shared(accumulators[1])
    assert shared.experimental_get_tracing_count() == 1


def test_add_and_take_of_accumulators_of_one_layout_share_their_reductions(layout):
    """A traced ``add_and_take`` reduces in place (rows of the buffer, or pieces of the
    blocks kept by reference in the "blocks" layout; eagerly it adds, then takes): two
    accumulators of one layout call the same compiled functions (traced once per piece
    shape), and each returns the mean of its own contributions."""
    shapes = ([7, 11], [13]) if layout == "one_row" else ([9, 11], [15])
    accumulators = [
        GradientAccumulator([tf.Variable(tf.zeros(shape)) for shape in shapes], max_pending=3)
        for _ in "ab"
    ]
    for scale, acc in enumerate(accumulators, start=1):
        acc.add([tf.fill(shape, scale * 1.0) for shape in shapes])
        add_and_take = tf.function(acc.add_and_take, autograph=False)
        got = add_and_take([tf.fill(shape, scale * 5.0) for shape in shapes])
        for shape, out in zip(shapes, got):
            np.testing.assert_array_equal(out, np.full(shape, 3.0 * scale, np.float32))
    references = accumulators[0]._helpers.references.count
    first = accumulators[0]
    args = (first._max_pending, first._reduction, first._shared_dtype())
    if references:
        shared = shared_reductions.piece_reduction(references, *args)
    else:
        shared = shared_reductions.rows_reduction(first._layout.width, *args)
    assert (references > 0) == (layout == "blocks")
    # One trace per piece shape (the "blocks" layout has two pieces), not per accumulator.
    assert shared.experimental_get_tracing_count() == len(first._layout.firsts)


def test_the_most_recently_used_reductions_are_kept_and_one_in_use_still_works(
    monkeypatch,
):
    """Past ``KEPT`` layouts the least recently used is dropped from the cache; an
    accumulator made before keeps its own reduction and takes with it."""
    monkeypatch.setattr(shared_reductions, "KEPT", 2)
    first = GradientAccumulator([tf.Variable(tf.zeros([23]))])
    for width in (29, 31):  # two more layouts: the first one's reduction leaves the cache
        GradientAccumulator([tf.Variable(tf.zeros([width]))])
    assert len(shared_reductions._FUNCTIONS) == 2
    kept = list(shared_reductions._FUNCTIONS)
    assert [key[0] for key in kept] == [29, 31]
    first.add([tf.fill([23], 4.0)])
    np.testing.assert_array_equal(first.take()[0], np.full([23], 4.0, np.float32))
