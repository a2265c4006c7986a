"""Family ``data``: a ShardedInput pipeline against the ``shard().shuffle()`` it replaces.

One shard (worker 1 of 4) of an in-memory dataset: ``n`` elements of 32 float32 features
and an int64 label (``n`` = 65,536; 8,192 with ``--quick``). Every variant is an endless
pipeline built once, read through one iterator kept across calls, as in training; one call
is a ``tf.function`` that takes one epoch of the shard (``n / 4`` elements; 1,024 single
elements in ``epoch/elements``) from it and sums the features (so every element is
materialized). Elements per second is
``ops_per_call`` over the call time. The single-element case reads 4 instances of each
pipeline, each for a block of 40 consecutive calls (see :class:`_Pipeline`); all
instances share one copy of the data.

* ``shard().shuffle()`` (baseline): ``Dataset.from_tensor_slices((x, y)).shard(4, 1)
  .shuffle(n / 4, seed, reshuffle_each_iteration=True).repeat()``, then batched, then
  ``prefetch(AUTOTUNE)``: a full-shard shuffle buffer, reshuffled every epoch.
* ``ShardedInput``: ``ShardedInput((x, y), seed=..., num_workers=4).dataset(1,
  batch_size=...)`` (a stateless per-epoch permutation of the whole dataset, strided over
  the shards; one gather per batch, per epoch for single elements), and
  ``commit(receipt)`` after every batch: the checkpointable position moves with every
  step, as it must in training.

Cases: ``epoch/batch32`` (batches of 32) and ``epoch/elements`` (single elements: the
per-element costs of both pipelines, and a commit per element). The issue's goal,
recorded on both: ShardedInput takes at most 1.05x the baseline's time per element.

Both cases take ``ROUNDS_FACTOR`` (4) times the suite's rounds (``--quick``, a smoke
test: the suite's rounds, one pipeline instance per variant). Their rounds are noisy on
a 2-core machine: a call of either pipeline runs at one of two speeds for a few hundred
milliseconds at a time (ShardedInput's single elements at about 17 or about 30 µs, one
pipeline alone in a process), so one round's ratio swings between about 0.7 and 1.4.
With 25 rounds the interval of a 0.87 median reached 1.06 (the goal undecided), and
intervals were 0.25-0.41 wide; with 100 rounds 0.09-0.24. Each case takes 6-13 s (the
single-element one about 20 s, warming its instances). A pipeline instance tends to
keep one mode for its life, hence the instances (docs/history.md).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from benchmarks.case import Case, Context, LazyCase
from benchmarks.tf_functions import variant_function
from safevars.data import ShardedInput

FAMILY = "data"
DESCRIPTION = "ShardedInput (disjoint, reshuffled, resumable shards) vs dataset.shard().shuffle()"
ORDER = 16
SECONDS = {"full": 25, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide

GOAL = 1.05
ROUNDS_FACTOR = 4
SEED = 1234
SHARDS, SHARD = 4, 1
FEATURES = 32
ELEMENTS_PER_CALL = 1_024
INSTANCES = 4  # single-element pipeline instances per variant, read in blocks of calls
WARMUP_CALLS = 3  # per instance after the first (traced, then steady)


def num_elements(ctx: Context) -> int:
    return 8_192 if ctx.quick else 65_536


def _source(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, FEATURES)).astype(np.float32), np.arange(n, dtype=np.int64)


def _reader(
    iterator: Any, steps: int, ctx: Context, commit: Callable[[Any], None] | None
) -> Callable[[], Any]:
    """A call that takes ``steps`` elements/batches from ``iterator`` and sums them (one
    ``tf.function`` per reader, see :mod:`benchmarks.tf_functions`)."""

    @variant_function(autograph=False)
    def read() -> tf.Tensor:
        def body(i: tf.Tensor, total: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            element = next(iterator)
            if commit is not None:
                (x, _), receipt = element
                commit(receipt)
            else:
                x, _ = element
            with tf.device(ctx.device):
                return i + 1, total + tf.reduce_sum(x)

        return tf.while_loop(lambda i, _: i < steps, body, (tf.constant(0), tf.constant(0.0)))[1]

    return lambda: float(read())


class _Pipeline:
    """One variant's pipelines: ``instances`` of them, built and warmed at its first call,
    each read for ``calls_per_instance`` calls in turn, all dropped by :meth:`close`.

    Built when the case is built, or kept after it was measured, a pipeline's threads
    (prefetching, parallel maps, the autotuner) took CPU from the case being measured:
    the single-element case read 1.06-1.08 after the batched case's pipelines had run
    and stayed alive, 1.01-1.03 without them (one process each, 2026-11-27).

    Single elements: several instances, each read for a block of consecutive calls. A
    pipeline instance keeps one speed for its life (the baseline's instances read
    21.9-25.5 µs per element in one pass), so one instance per variant made a whole
    pass read fast or slow: single-element passes 0.94-1.20 in one ``--repeat 5``,
    1.01-1.07 with 4 instances in blocks (2026-11-27). Blocks, not one call each in
    turn: an autotuned parallel map runs down while its instance waits. The batched
    case keeps one instance: its ``ShardedInput`` map is autotuned and reaches its
    speed only after many calls (per block of 25 rounds, four instances warmed with 3
    calls each read 3.45, 1.97, 2.14, 1.65 µs per element; one instance read about 1.4
    over a whole pass), and at 0.4x its goal does not hang on the instance.
    """

    def __init__(
        self, build: Callable[[], Callable[[], Any]], instances: int, calls_per_instance: int
    ) -> None:
        self._build = build
        self._instances = instances
        self._calls_per_instance = calls_per_instance
        self._reads: list[Callable[[], Any]] = []
        self._calls = 0

    def __call__(self) -> Any:
        if not self._reads:
            self._reads = [self._build() for _ in range(self._instances)]
            for read in self._reads[1:]:  # the first is warmed by the runner
                for _ in range(WARMUP_CALLS):
                    read()
        index = self._calls // self._calls_per_instance % self._instances
        self._calls += 1
        return self._reads[index]()

    def close(self) -> None:
        self._reads = []  # the readers, their functions and iterators: their threads end
        gc.collect()


def _case(ctx: Context, batch_size: int | None) -> Case:
    n = num_elements(ctx)
    # One copy of the data in the process, shared by every pipeline instance (eager
    # tensors; each pipeline built from NumPy arrays would copy them), in host memory
    # as tf.data wants it, also when the variables are on a GPU.
    with tf.device("/CPU:0"):
        x, y = (tf.constant(a) for a in _source(n))
    per_shard = n // SHARDS
    # Single elements: a slice of an epoch per call (every element is a loop iteration).
    steps = min(per_shard, ELEMENTS_PER_CALL) if batch_size is None else per_shard // batch_size

    def plain() -> Callable[[], Any]:
        baseline = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shard(SHARDS, SHARD)
            .shuffle(per_shard, seed=SEED, reshuffle_each_iteration=True)
            .repeat()
        )
        if batch_size is not None:
            baseline = baseline.batch(batch_size)
        baseline = baseline.prefetch(tf.data.AUTOTUNE)
        return _reader(iter(baseline), steps, ctx, None)

    def sharded() -> Callable[[], Any]:
        data = ShardedInput((x, y), seed=SEED, num_workers=SHARDS)
        return _reader(iter(data.dataset(SHARD, batch_size=batch_size)), steps, ctx, data.commit)

    # Single elements: a quarter of a full pass's calls per instance (2 calls per round,
    # 80 rounds), so every instance is read in a pass.
    instances, block = (1, 1) if batch_size is not None else (INSTANCES, 40)
    if ctx.quick:  # a smoke test: one instance, the suite's rounds (see the docstring)
        instances, block = 1, 1
    pipelines = [_Pipeline(plain, instances, block), _Pipeline(sharded, instances, block)]
    label = "elements" if batch_size is None else f"batch{batch_size}"

    def teardown() -> None:
        for pipeline in pipelines:
            pipeline.close()

    return Case(
        family=FAMILY,
        name=f"epoch/{label}",
        variants=dict(zip(("shard().shuffle()", "ShardedInput"), pipelines)),
        ops_per_call=steps * (batch_size or 1),
        params={
            "elements": n,
            "shards": SHARDS,
            "batch_size": batch_size,
            "elements_per_call": steps * (batch_size or 1),
            "features": FEATURES,
        },
        goal=("ShardedInput", GOAL),
        rounds_factor=1 if ctx.quick else ROUNDS_FACTOR,
        teardown=teardown,
    )


def cases(ctx: Context) -> list[LazyCase]:
    return [
        LazyCase(FAMILY, "epoch/batch32", functools.partial(_case, ctx, 32)),
        LazyCase(FAMILY, "epoch/elements", functools.partial(_case, ctx, None)),
    ]
