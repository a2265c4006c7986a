"""ShardedInput: every (worker, replica) its own part of each epoch, exactly once, resumable.

The problem: ``dataset.shard(n, i).shuffle(...)`` per worker gives no way to resume in the
middle of an epoch (a restarted job replays the epoch or skips the rest), its shuffle
depends on the global seed and on the iterator's history, and under
``ParameterServerStrategy`` ``create_per_worker_dataset`` rebuilds a recovered worker's
pipeline from scratch (TensorFlow "doesn't manage any state sharing between such
separate input pipelines"), so a worker failure replays or loses elements.

The fix: the assignment is a pure function of ``(seed, epoch, layout)`` (see
:mod:`safevars.data._layout`: a stateless ``RandomIndexShuffle`` of the positions of each
epoch, strided over the shards ``g = worker * replicas_per_worker + replica``), and the
only state is one int64 per shard, ``positions[g]``: how many of the shard's slots have
been *committed* since epoch 0. A pipeline starts at the committed position (read when
it is built), every element comes with a *receipt* ``[g, counter]``, and
:meth:`ShardedInput.commit` moves the position past the receipt, atomically
(``ResourceScatterMax`` under the variable's lock), after checking that the receipt
continues the shard exactly (no element skipped, none repeated). Hence:

* the shards of an epoch are disjoint and together hold every element exactly once
  (``remainder="spread"``; ``"drop"`` and ``"pad"`` as documented);
* epoch ``e`` of shard ``g`` is the same sequence in every run and process, whatever the
  threads, ``num_parallel_calls`` or prefetching do;
* ``tf.train.Checkpoint(data=sharded)`` saves the positions; a pipeline built after a
  restore (in a new process or not) delivers exactly the elements that would have come.

Under ``tf.distribute``: :meth:`ShardedInput.dataset` reads one shard (no strategy);
:meth:`ShardedInput.distribute` gives replica ``r`` of worker ``w`` shard
``w * replicas_per_worker + r`` under ``MirroredStrategy`` and
``MultiWorkerMirroredStrategy`` (each process moves the positions of its own replicas:
checkpoint and restore each worker with its own); :meth:`ShardedInput.per_worker_dataset`
gives worker ``w`` shard ``w`` under ``ParameterServerStrategy``, where the positions live
on parameter server 0 (create the object in ``strategy.scope()`` on the coordinator).

What "exactly once" means under ``ParameterServerStrategy`` with failing workers: a step
calls ``next(iterator)``, trains, and commits its receipt as its last op
(``data.commit(receipt, after=...)``). Every element of shard ``w`` is committed exactly
once, in order. Elements that worker ``w`` delivered but never committed (the batch of a
step that died with the worker, and whatever it had read ahead) are delivered again,
first, by the dataset ``ClusterCoordinator`` rebuilds when the worker comes back; the
coordinator reruns the failed step itself on another worker, which takes that worker's
next batch. A step that fails after its updates reached the parameter servers but before
its commit is applied again (the coordinator's own at-least-once execution): commit right
after the updates. A worker that never comes back leaves the rest of its shard
uncommitted (:meth:`ShardedInput.position` shows where it stopped). A commit that would
skip delivered, uncommitted slots fails instead of losing them silently. Committing at
fetch time (:meth:`ShardedInput.next`) makes the failed step's batch at-most-once.

NOTES:
  What is *not* guaranteed:

  * Epochs are per shard: with ``"spread"`` shards differ in length by one element, and
    under ``ParameterServerStrategy`` workers run at their own pace, so one shard may be
    in epoch ``e + 1`` while another finishes epoch ``e``.
  * A pipeline reads the positions when it is built (:meth:`ShardedInput.dataset`,
    :meth:`ShardedInput.distribute`; on every (re)build on a worker for
    :meth:`ShardedInput.per_worker_dataset`): restore the checkpoint first, and build a
    new pipeline rather than iterate an old one again (its first commit fails: it would
    repeat committed elements). Building after restoring a checkpoint of another layout
    (seed, size, shards, policy) raises.
  * Under ``MultiWorkerMirroredStrategy`` restore every worker from its own checkpoint;
    restoring the chief's on another worker gives that worker the chief's positions.
  * A ``tf.data.Dataset`` source is read with ``tf.data.experimental.at`` (random access),
    one element at a time: slower than in-memory tensors (one gather per batch, or per
    epoch of a shard: see :meth:`ShardedInput.dataset`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import resource_variable_ops
from safevars._validation import check_bool, check_choice, check_int
from safevars.data._layout import (
    REMAINDER_POLICIES,
    Layout,
    shard_ids,
    shard_stream,
    worker_stream,
)
from safevars.data._source import source_elements
from safevars.data._strategies import check_coordinator, check_mirrored, default_layout
from safevars.distribute import check_strategy, is_parameter_server
from safevars.errors import InvalidArgumentError, NotCallableError, UnsupportedStrategyError
from safevars.rng import ReplicaRNG
from safevars.rng.arguments import _check_seed
from safevars.rng.placement import _ps_device

__all__ = ["REMAINDER_POLICIES", "ShardedInput"]


class ShardedInput(tf.Module):
    """A dataset split into disjoint, reshuffled-per-epoch, resumable shards.

    Example (``MirroredStrategy`` or ``MultiWorkerMirroredStrategy``)::

        with strategy.scope():
            data = safevars.ShardedInput((images, labels), seed=rng, remainder="pad",
                                         with_weights=True)
        checkpoint = tf.train.Checkpoint(model=model, data=data)
        checkpoint.restore(tf.train.latest_checkpoint(path))   # before building the pipeline
        iterator = iter(data.distribute(strategy, batch_size=32))

        @tf.function
        def step():
            ((x, y), w), receipt = next(iterator)
            loss = strategy.run(replica_step, args=(x, y, w))
            data.commit(receipt, after=loss)

    Args:
      source: The elements: a ``tf.data.Dataset`` of known, finite cardinality that
        supports random access (``tf.data.experimental.at``); a nested structure of
        tensors or arrays with a common first dimension (element ``i`` is row ``i`` of
        each, as ``from_tensor_slices``); or an int ``n``: the elements are the ids
        ``0..n-1`` (int64), to be mapped to data with ``map_fn`` or afterwards.
      seed: A non-negative int, or a :class:`~safevars.ReplicaRNG` (its seed is used). The
        order of epoch ``e`` depends only on the seed, ``e`` and the layout.
      num_workers: Workers (input pipelines). Default: from the strategy in scope
        (``num_replicas_in_sync // replicas_per_worker``; the cluster's workers under
        ``ParameterServerStrategy``), else 1.
      replicas_per_worker: Replicas of each worker. Default: the strategy's local
        devices (1 under ``ParameterServerStrategy``), else 1.
      remainder: What happens when ``num_shards`` does not divide the number of elements
        ``n = q * num_shards + r``: ``"spread"`` (default): the first ``r`` shards get
        ``q + 1`` elements, every element exactly once per epoch; ``"drop"``: every shard
        gets ``q``, ``r`` elements (different ones each epoch) are skipped in that epoch;
        ``"pad"``: every shard gets ``q + 1``, the epoch's first ``num_shards - r`` elements
        come twice, the copy with weight 0 (see ``with_weights``).
      shuffle: Reshuffle every epoch (default). ``False``: shard ``g`` gets elements
        ``g, g + num_shards, ...`` in order.
      map_fn: Optional function applied to every element after the lookup (a
        deterministic parallel ``tf.data`` map), e.g. decoding.
      with_weights: Deliver ``(element, weight)``: weight 1.0, or 0.0 for a ``"pad"`` copy,
        so a loss weighted by it counts every element exactly once.
      name: Module name.

    Raises:
      InvalidArgumentError: a bad ``source`` (not a dataset, tensors or a non-negative int;
        no elements; infinite or unknown cardinality; no random access; tensors of
        different lengths), ``seed``, ``num_workers``, ``replicas_per_worker``,
        ``remainder`` or ``with_weights``; or fewer elements than shards with
        ``"spread"``/``"drop"`` (some shard would be empty: use ``"pad"``).
      NotCallableError: ``map_fn`` is not callable.
      UnsupportedStrategyError: created in the scope of an unsupported strategy, or with
        a dataset source or several replicas per worker under ``ParameterServerStrategy``.
    """

    def __init__(
        self,
        source: Any,
        *,
        seed: int | ReplicaRNG,
        num_workers: int | None = None,
        replicas_per_worker: int | None = None,
        remainder: str = "spread",
        shuffle: bool = True,
        map_fn: Callable[..., Any] | None = None,
        with_weights: bool = False,
        name: str | None = None,
    ) -> None:
        seed = seed.seed if isinstance(seed, ReplicaRNG) else _check_seed(seed)
        check_choice(
            remainder,
            "remainder",
            REMAINDER_POLICIES,
            "'spread' delivers every element exactly once per epoch.",
        )
        check_bool(shuffle, "shuffle")
        check_bool(with_weights, "with_weights")
        if map_fn is not None and not callable(map_fn):
            raise NotCallableError(f"map_fn must be callable or None, got {map_fn!r}.")
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        parameter_server, default_workers, default_replicas = default_layout(strategy)
        fix = "Pass a positive int, or create the ShardedInput in strategy.scope()."
        num_workers = check_int(
            default_workers if num_workers is None else num_workers, "num_workers", 1, fix=fix
        )
        replicas_per_worker = check_int(
            default_replicas if replicas_per_worker is None else replicas_per_worker,
            "replicas_per_worker",
            1,
            fix=fix,
        )
        num_elements, elements = source_elements(source, map_fn, bool(with_weights))
        if num_elements < 1:
            raise InvalidArgumentError(
                f"source must hold at least one element, got {num_elements}."
            )
        num_shards = num_workers * replicas_per_worker
        if num_elements < num_shards and remainder != "pad":
            raise InvalidArgumentError(
                f"source has {num_elements} element(s) for {num_shards} shards: with "
                f"remainder={remainder!r} some shard would get none and its pipeline "
                "would never yield. Use remainder='pad' or fewer shards."
            )
        if parameter_server and (elements.kind == "dataset" or replicas_per_worker != 1):
            raise UnsupportedStrategyError(
                "under ParameterServerStrategy ShardedInput supports tensor or id sources "
                "(the dataset is rebuilt on every worker) and one replica per worker; got "
                f"a {elements.kind} source and replicas_per_worker={replicas_per_worker}. "
                "Pass the tensors, or the number of elements and a map_fn."
            )
        # Every check is done: nothing below can fail on a user's argument.
        super().__init__(name=name or "sharded_input")
        self._layout = Layout(
            num_elements, num_workers, replicas_per_worker, remainder, bool(shuffle), seed
        )
        self._elements = elements
        self._parameter_server = parameter_server
        placement = tf.device(_ps_device(0)) if parameter_server else contextlib.nullcontext()
        with tf.init_scope(), placement:
            # Plain resource variables: never mirrored or sharded by a strategy scope.
            self.positions = resource_variable_ops.ResourceVariable(
                tf.zeros([num_shards], tf.int64), trainable=False, name="positions"
            )
            self.layout_fingerprint = resource_variable_ops.ResourceVariable(
                tf.constant(self._layout.fingerprint(), tf.int64),
                trainable=False,
                name="layout_fingerprint",
            )

    # -- layout -------------------------------------------------------------------------

    @property
    def num_elements(self) -> int:
        """Elements of the source."""
        return self._layout.num_elements

    @property
    def num_workers(self) -> int:
        """The workers the elements are sharded over."""
        return self._layout.num_workers

    @property
    def replicas_per_worker(self) -> int:
        """Replicas on each worker; each replica reads a shard of its own."""
        return self._layout.replicas_per_worker

    @property
    def num_shards(self) -> int:
        """``num_workers * replicas_per_worker``."""
        return self._layout.num_shards

    @property
    def remainder(self) -> str:
        """What happens to the elements an even split leaves over.

        ``"spread"``, ``"drop"`` or ``"pad"``.
        """
        return self._layout.remainder

    @property
    def seed(self) -> int:
        """The seed of each epoch's order (used with ``shuffle=True``)."""
        return self._layout.seed

    def __repr__(self) -> str:
        layout = self._layout
        return (
            f"<safevars.ShardedInput n={layout.num_elements} workers={layout.num_workers} "
            f"replicas_per_worker={layout.replicas_per_worker} "
            f"remainder={layout.remainder!r} shuffle={layout.shuffle} seed={layout.seed}>"
        )

    def shard_index(self, worker: int = 0, replica: int = 0) -> int:
        """``worker * replicas_per_worker + replica``, checked.

        Raises:
          InvalidArgumentError: ``worker`` or ``replica`` is not an int in range.
        """
        layout = self._layout
        worker = check_int(worker, "worker", 0, fix=f"Workers are 0..{layout.num_workers - 1}.")
        replica = check_int(
            replica, "replica", 0, fix=f"Replicas are 0..{layout.replicas_per_worker - 1}."
        )
        if worker >= layout.num_workers:
            raise InvalidArgumentError(
                f"worker={worker} is out of range: this ShardedInput has "
                f"{layout.num_workers} worker(s)."
            )
        if replica >= layout.replicas_per_worker:
            raise InvalidArgumentError(
                f"replica={replica} is out of range: this ShardedInput has "
                f"{layout.replicas_per_worker} replica(s) per worker."
            )
        return worker * layout.replicas_per_worker + replica

    def shard_length(self, worker: int = 0, replica: int = 0) -> int:
        """Elements (slots, with ``"pad"`` copies) the shard gets per epoch."""
        return self._layout.shard_length(self.shard_index(worker, replica))

    def steps_per_epoch(self, batch_size: int) -> int:
        """Batches of the longest shard per epoch: the synchronous steps of one epoch."""
        batch_size = check_int(batch_size, "batch_size", 1, fix="Pass a positive batch size.")
        return math.ceil(self._layout.shard_length(0) / batch_size)

    def shard_ids(self, epoch: int, worker: int = 0, replica: int = 0) -> np.ndarray:
        """The element ids of a shard in ``epoch``, in delivery order.

        A pure function of the seed, the layout and ``epoch``; reads no state. With
        ``"pad"`` the last id may be a copy (weight 0).

        Raises:
          InvalidArgumentError: bad ``epoch``, ``worker`` or ``replica``.
        """
        epoch = check_int(epoch, "epoch", 0, fix="Epochs count from 0.")
        return shard_ids(self._layout, self.shard_index(worker, replica), epoch)

    def position(self, worker: int = 0, replica: int = 0) -> tuple[int, int]:
        """``(epoch, offset)`` of a shard's next uncommitted element.

        Thread safety: one read of the positions variable.

        Modes: eager (it returns Python ints).
        """
        shard = self.shard_index(worker, replica)
        counter = int(self.positions.numpy()[shard])
        return divmod(counter, self._layout.shard_length(shard))

    # -- pipelines ----------------------------------------------------------------------

    def _check_layout(self) -> None:
        """Raises if the positions were restored from a checkpoint of another layout."""
        if int(self.layout_fingerprint.numpy()) != self._layout.fingerprint():
            raise InvalidArgumentError(
                f"the checkpoint restored into {self!r} was written by a ShardedInput with "
                "another layout (seed, number of elements, workers, replicas per worker, "
                "remainder or shuffle): its positions do not apply. Restore into a "
                "ShardedInput built with the same arguments."
            )

    def _check_pipeline(
        self, batch_size: int | None, epochs: int | None, batch_required: bool
    ) -> tuple[int | None, int | None]:
        if batch_size is not None or batch_required:
            batch_size = check_int(batch_size, "batch_size", 1, fix="Pass a positive batch size.")
        if epochs is not None:
            epochs = check_int(epochs, "epochs", 1, fix="Pass a positive number, or None.")
        return batch_size, epochs

    def dataset(
        self,
        worker: int = 0,
        replica: int = 0,
        *,
        batch_size: int | None = None,
        epochs: int | None = None,
    ) -> tf.data.Dataset:
        """The ``(element, receipt)`` dataset of one shard, from its committed position.

        Commit every receipt (:meth:`commit`) once its element is used. ``receipt`` is an
        int64 ``[shard, counter]`` (``[batch, 2]`` when batched).

        Args:
          worker: The worker, in ``[0, num_workers)``.
          replica: The replica on that worker, in ``[0, replicas_per_worker)``.
          batch_size: Batch the elements (an epoch's last batch may be short); ``None``:
            single elements.
          epochs: Stop after this many epochs, the current one included; ``None``: never.

        Returns:
          A ``tf.data.Dataset`` starting at the position committed now (build a new one to
          start from a later commit).

        Raises:
          InvalidArgumentError: bad ``worker``, ``replica``, ``batch_size`` or ``epochs``;
            or positions restored from a checkpoint of another layout.
          UnsupportedStrategyError: the object was created under
            ``ParameterServerStrategy`` (use :meth:`per_worker_dataset`).

        Memory: single elements from tensors or ids are looked up an epoch of the shard at
        a time (a copy of those elements, held while the epoch is read) when that takes at
        most 64 MiB, receipts and weights included; else 256 at a time (and always for
        strings). Batches are looked up one at a time.

        Thread safety: reads the positions once, now (one read op).

        Modes: build it eagerly; iterate it eagerly or in a ``tf.function``.
        """
        if self._parameter_server:
            raise UnsupportedStrategyError(
                "this ShardedInput was created under ParameterServerStrategy: its shards "
                "are read on the workers. Use per_worker_dataset(coordinator, ...)."
            )
        shard = self.shard_index(worker, replica)
        batch_size, epochs = self._check_pipeline(batch_size, epochs, False)
        self._check_layout()
        start = self.positions.read_value()[shard]
        return shard_stream(
            self._layout, self._elements, shard, start, batch_size, epochs
        ).prefetch(tf.data.AUTOTUNE)

    def distribute(
        self,
        strategy: tf.distribute.Strategy,
        batch_size: int,
        *,
        epochs: int | None = None,
        options: tf.distribute.InputOptions | None = None,
    ) -> Any:
        """Per-replica batches under ``MirroredStrategy``/``MultiWorkerMirroredStrategy``.

        Replica ``r`` of worker ``w`` gets ``(element, receipt)`` batches of shard
        ``w * replicas_per_worker + r`` (see the module docstring).

        Args:
          strategy: The strategy (not ``ParameterServerStrategy``).
          batch_size: Per-replica batch size.
          epochs: As :meth:`dataset`.
          options: ``tf.distribute.InputOptions`` (``PER_WORKER`` replication only).

        Returns:
          The ``tf.distribute.DistributedDataset`` of
          ``strategy.distribute_datasets_from_function``.

        Raises:
          InvalidArgumentError: ``strategy`` runs another number of workers or replicas
            than this object has shards for, or bad ``batch_size``, ``epochs``, ``options``.
          UnsupportedStrategyError: ``ParameterServerStrategy`` or an unsupported strategy.

        Thread safety: as :meth:`dataset`.

        Modes: call it eagerly; iterate the result eagerly or in a ``tf.function``.
        """
        check_strategy(strategy)
        if is_parameter_server(strategy) or self._parameter_server:
            raise UnsupportedStrategyError(
                "under ParameterServerStrategy use per_worker_dataset(coordinator, ...)."
            )
        checked_batch, epochs = self._check_pipeline(batch_size, epochs, True)
        assert checked_batch is not None  # batch_required
        batch_size = checked_batch
        self._check_layout()
        layout = self._layout
        check_mirrored(layout, strategy, options)

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            if context.num_input_pipelines != layout.num_workers:
                raise InvalidArgumentError(
                    f"the strategy has {context.num_input_pipelines} input pipelines, this "
                    f"ShardedInput num_workers={layout.num_workers}."
                )
            worker = context.input_pipeline_id
            return worker_stream(
                layout, self._elements, worker, self.positions.read_value(), batch_size, epochs
            ).prefetch(tf.data.AUTOTUNE)

        return strategy.distribute_datasets_from_function(dataset_fn, options)

    def per_worker_dataset(
        self, coordinator: Any, batch_size: int | None = None, *, epochs: int | None = None
    ) -> Any:
        """Every worker's ``(element, receipt)`` dataset under ``ParameterServerStrategy``.

        ``coordinator.create_per_worker_dataset`` of a function that reads shard ``w``
        (``w`` the worker running it) from its committed position. ``ClusterCoordinator``
        runs it on every worker, and again on a worker that recovered from a failure, so
        a rebuilt dataset starts with the elements the worker delivered but never
        committed.

        Args:
          coordinator: The ``ClusterCoordinator`` of the strategy this object was created
            under.
          batch_size: As :meth:`dataset`.
          epochs: As :meth:`dataset` (``None`` is the usual choice: schedule steps).

        Returns:
          The coordinator's per-worker dataset; pass ``iter()`` of it to scheduled
          functions and call ``next`` there.

        Raises:
          UnsupportedStrategyError: this object was not created in a
            ``ParameterServerStrategy`` scope (its positions must live on a parameter
            server).
          InvalidArgumentError: bad ``coordinator``, ``batch_size`` or ``epochs``.

        Thread safety: each worker reads the positions once per (re)build.

        Modes: call it eagerly on the coordinator.
        """
        if not self._parameter_server:
            raise UnsupportedStrategyError(
                "per_worker_dataset needs a ShardedInput created in "
                "ParameterServerStrategy.scope() on the coordinator, so that its positions "
                "live on a parameter server every worker reaches."
            )
        check_coordinator(coordinator, self._layout)
        batch_size, epochs = self._check_pipeline(batch_size, epochs, False)
        self._check_layout()
        worker_index = tf.distribute.coordinator.experimental_get_current_worker_index

        def dataset_fn() -> tf.data.Dataset:
            worker = tf.cast(worker_index(), tf.int64)
            return worker_stream(
                self._layout,
                self._elements,
                worker,
                self.positions.read_value(),
                batch_size,
                epochs,
            ).prefetch(tf.data.AUTOTUNE)

        return coordinator.create_per_worker_dataset(dataset_fn)

    # -- consuming ----------------------------------------------------------------------

    def commit(self, receipt: Any, after: Any = None) -> None:
        """Marks the elements of ``receipt`` as consumed: their shard's position passes them.

        Args:
          receipt: The receipt of an element or batch (``[2]`` or ``[batch, 2]`` int64),
            or the per-replica receipts of a distributed batch (in cross-replica
            context), or a nest of them. An empty batch commits nothing.
          after: Tensors or operations (or a nest, distributed values included) the
            commit waits for, e.g. the step's loss or update ops.

        Raises:
          tf.errors.InvalidArgumentError: a receipt does not start at its shard's
            committed position: a later start would skip elements received and never
            committed, an earlier one would repeat committed elements (a receipt
            committed twice, or a pipeline built before later commits). Nothing is
            committed. In a graph, when the op runs.

        Thread safety: the check and one ``ResourceScatterMax`` per receipt (atomic under
          the positions variable's lock; a position only moves forward). A shard has one
          consumer: commits of one shard from two threads at once are not checked
          against each other.

        Modes: eager and ``tf.function`` (where it runs with the function, by automatic
          control dependencies), in cross-replica or replica context; under
          ``ParameterServerStrategy`` in a scheduled function (the positions live on a
          parameter server).
        """
        dependencies = [d for d in tf.nest.flatten(after, expand_composites=True) if d is not None]
        with tf.control_dependencies(dependencies):
            # One receipt tensor per local replica for distributed values.
            for part in tf.nest.flatten(receipt, expand_composites=True):
                self._commit_one(tf.cast(part, tf.int64))

    def _commit_one(self, part: tf.Tensor) -> None:
        """Checks and commits one receipt tensor: few ops, it may run once per element."""
        # One Unpack op, not a strided slice per column: on the single-element pipeline
        # of the data benchmark, A/B in one process (4 instances each, 40 rotated
        # rounds, 2026-11-27), 26.3 -> 24.1 µs per element (the baseline 23.4).
        if part.shape.rank == 1:  # [shard, counter]: scalars, no reduction
            first_shard, first = tf.unstack(part, num=2)
            shards, updates = first_shard, first + 1
        else:  # [batch, 2]; an empty batch checks and commits nothing
            shards, counters = tf.unstack(tf.reshape(part, [-1, 2]), num=2, axis=1)
            first_shard, first, updates = shards[:1], counters[:1], counters + 1
        handle = self.positions.handle
        committed = tf.raw_ops.ResourceGather(resource=handle, indices=first_shard, dtype=tf.int64)
        same = tf.equal(first, committed)
        if same.shape.rank != 0:
            same = tf.reduce_all(same)
        # The Assert op itself: tf.debugging.Assert puts an assertion with int64 data in a
        # tf.cond (sparing a GPU the copy of the data when it passes), which cost about
        # 2.5 µs of the ~45 µs an element of the benchmark's single-element pipeline takes
        # (A/B in one process, 2026-11-26: 48.6 vs 45.9 and 47.4 vs 45.0 µs, 3-4
        # pipeline instances each). Its data are one string and the three values: every
        # string is a Const op that runs with each commit (in a loop, every iteration),
        # and four strings interleaved with the values cost 0.4-0.5 µs per element more
        # (23.4 vs 22.95 µs, A/B in one process, 4 instances each, 2026-11-27).
        check = tf.raw_ops.Assert(
            condition=same,
            data=[
                (
                    "safevars.ShardedInput.commit: a receipt must continue its shard "
                    "exactly: a later one skips elements received and never committed, an "
                    "earlier one repeats committed elements (a pipeline built before those "
                    "commits: build it again). Commit every receipt once, in order. "
                    "[shard, receipt start, committed position]:"
                ),
                first_shard,
                first,
                committed,
            ],
            summarize=3,
        )
        with tf.control_dependencies([check]):
            tf.raw_ops.ResourceScatterMax(resource=handle, indices=shards, updates=updates)

    def next(self, iterator: Any) -> Any:
        """``next(iterator)``, committed at once: the element without its receipt.

        Commit at fetch time: a step that fails after this has its elements counted as
        consumed. Under ``ParameterServerStrategy`` keep the receipt and :meth:`commit`
        it at the end of the step instead.

        Thread safety: as :meth:`commit`.

        Modes: as :meth:`commit`.
        """
        element, receipt = next(iterator)
        self.commit(receipt)
        return element
