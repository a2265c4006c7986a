"""ReplicaRNG: one seed, an independent reproducible random stream per replica and worker.

The problem: replicas seeded with the same seed draw the same augmentations and dropout
masks; seeding every worker by hand is error-prone; under ``ParameterServerStrategy`` a
``tf.random.Generator`` is one state on a parameter server shared by all workers (its
per-replica key hash uses replica 0 on every worker), so the values a worker gets depend
on how the coordinator interleaves the steps; a Keras ``SeedGenerator`` shared by the
replicas of a ``MirroredStrategy`` hands every replica the same seeds; and
``tf.random.set_seed`` inside ``strategy.run`` gives no per-replica control.

The fix: ``ReplicaRNG(seed)`` owns one Philox stream per replica. Stream ``r`` of worker
``w`` is keyed by a 64-bit key derived from ``(seed, w, r)`` with
``numpy.random.SeedSequence`` (a stable, documented function; never Python's ``hash``),
and its position is the Philox counter stored next to the key in a 3-element int64
resource variable ``[counter_lo, counter_hi, key]``: the same layout as
``tf.random.Generator``. Every value is the stateless function
``philox(key(seed, worker, replica), counter)``; a draw fetches the counter and advances
it by the number of values drawn in one atomic step under the variable's own mutex:
one fused kernel (``StatefulStandardNormalV2``, ...) eagerly and for small graph
draws, ``RngReadAndSkip`` then the stateless ``*V2`` kernel for large graph draws
(bitwise the same values). Hence:

* the same seed gives bitwise the same streams in a new instance or a new process;
* different seeds, workers and replicas give different, independent streams;
* a draw never depends on which thread runs it, on how often a ``tf.function`` was
  traced (tracing draws nothing), or on other streams;
* the state is plain trackable TensorFlow state: ``tf.train.Checkpoint`` saves and
  restores it and a restored run continues exactly where it stopped.

Inside ``strategy.run`` the RNG's own :meth:`ReplicaRNG.normal` and friends use the stream
of the current replica (``tf.distribute.get_replica_context().replica_id_in_sync_group``).
Seeds derived without touching any stream (:meth:`ReplicaRNG.seed_for`,
:meth:`ReplicaRNG.numpy`, :meth:`ReplicaRNG.dataset_seed`,
:meth:`ReplicaRNG.element_seeds`) are pure functions of ``(seed, worker, replica, keys)``.
:meth:`ReplicaRNG.attach` makes the dropout and noise layers of a Keras model draw their
seeds from the calling replica's stream.

The worker part of the key is the ``(task_type, task_id)`` of the process: the
``worker=`` argument if given, else the ``cluster_resolver`` of the strategy the RNG is
created under, else ``TF_CONFIG``, else ``("worker", 0)``. So a single-process run has
the streams of task ``worker:0`` of a cluster.

Under ``tf.distribute`` (creating an RNG in the scope of any other strategy, or drawing
under one, raises :class:`~safevars.UnsupportedStrategyError` naming the supported ones):

* **No strategy, ``OneDeviceStrategy``, ``MirroredStrategy``**: one stream per replica
  of this process, each on its replica's device when created in ``strategy.scope()``;
  inside ``strategy.run`` a draw uses ``replica_id_in_sync_group``'s stream.
* **``MultiWorkerMirroredStrategy``**: every worker process creates the RNG in
  ``strategy.scope()`` with the same seed. Its worker part is the process's task from
  the strategy's ``cluster_resolver`` (that is, ``TF_CONFIG``), its replica ids are the
  global ``replica_id_in_sync_group``: replica ``r`` of worker ``w`` draws
  ``philox(key(seed, ("worker", w), r), counter)``. So two workers never share a stream
  even if they ran the same replica ids, and a rerun with the same seed on the same
  cluster gives bitwise the same values per (worker, replica). Each process holds
  ``num_replicas_in_sync`` streams but only those of its local replicas move.
* **``ParameterServerStrategy``** (with ``ClusterCoordinator``): the coordinator creates
  the RNG in ``strategy.scope()``. It holds ``num_replicas`` streams for every worker
  task ``w`` of the cluster, keyed by ``(seed, ("worker", w), r)`` (the streams of
  ``ReplicaRNG(seed, worker=("worker", w))``). Where the state lives is the design
  choice: not on the coordinator (every worker's draws would be a round trip to the
  process that drives the training), not in per-worker resources on the workers
  (``ClusterCoordinator`` rebuilds those from scratch on a restarted worker, which would
  replay values it already handed out, and a coordinator checkpoint cannot save them),
  but on parameter server ``w % num_ps``: where the model's variables already are,
  reachable from every worker, saved and restored by ``tf.train.Checkpoint`` on the
  coordinator, and untouched by a worker failure. In a function run by
  ``ClusterCoordinator.schedule``, a draw uses a state handle that is an input of the
  function, bound each time the coordinator calls it on a worker to that worker's
  stream (the call-time capture behind
  ``tf.distribute.coordinator.experimental_get_current_worker_index()``). It fetches and
  advances the counter on the PS (one ``RngReadAndSkip``: three integers travel) and
  computes the values on the worker with the stateless kernel. An eager draw on the
  coordinator runs on no worker and raises; :meth:`ReplicaRNG.for_worker` gives a
  named worker's stream.

  What "reproducible" means there: the coordinator decides at run time which worker runs
  which step, so *which step* gets which values from the worker streams is not
  reproducible. What is: worker ``w``'s draws, in the order it made them, are exactly
  stream ``(seed, w, r)``, bitwise the same in every run and process given the sequence
  of draws it made, and the workers' streams never overlap. A step's randomness that
  must not depend on scheduling (to compare two runs step by step) is keyed by the step
  instead: pass the step number as an argument of the scheduled function and draw with
  ``tf.random.stateless_*(..., seed=rng.element_seed(step))``. Pure seeds
  (:meth:`ReplicaRNG.seed_for`, :meth:`ReplicaRNG.element_seed`, ...) use the RNG's own
  worker part, the coordinator's (``("chief", 0)`` by default), so they are the same on
  every worker. Counters on the PS only move forward, so when ``ClusterCoordinator``
  reruns a step after a worker failure, no value is handed out twice.

NOTES:
  What is *not* guaranteed:

  * Draws from *one* stream by several threads at once are each atomic (no value is ever
    handed out twice) but which thread gets which values depends on the scheduler. Give
    every thread its own replica stream for reproducible results.
  * The position of a stream depends on the shapes and dtypes of the draws made from it:
    ``normal([2])`` then ``normal([3])`` is not ``normal([3])`` then ``normal([2])``.
  * Restoring a checkpoint restores keys and counters: an RNG created with another seed
    continues the *checkpointed* streams, while its pure seeds (:meth:`seed_for`, ...)
    still follow its own seed. Restore into an RNG built with the same arguments.
  * The ``numpy.random.Generator`` objects of :meth:`ReplicaRNG.numpy` are not
    checkpointed; derive one per epoch (``epoch=``) instead of carrying one across
    restarts.
  * Philox integer streams are identical on every device; floating-point transforms of
    them (normal, truncated normal) may differ in the last bits between CPU and GPU.
  * ``ParameterServerStrategy``: every draw is a round trip to a parameter server
    (three integers), like any PS variable read; the streams are placed by the RNG
    (round robin over the PS tasks, never sharded by the strategy's
    ``variable_partitioner``). A ``tf.function`` that draws and is called on the
    coordinator instead of being scheduled raises when called, not when traced.
  * ``MultiWorkerMirroredStrategy`` checkpoints: restore each worker from a checkpoint
    it wrote itself. Restoring the chief's checkpoint on another worker gives that
    worker the chief's keys: fresh streams (the chief never moved them), not a
    continuation of its own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import numbers
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from safevars._tf_internal import (
    FuncGraph,
    gen_stateful_random_ops,
    gen_stateless_random_ops_v2,
    resource_variable_ops,
)
from safevars._tf_internal import coordinator_context as _dispatch_context

if TYPE_CHECKING:
    import keras

from safevars import _autograph  # noqa: F401  (registers safevars with AutoGraph)
from safevars.distribute import SUPPORTED_STRATEGIES, check_strategy, is_parameter_server
from safevars.errors import InvalidArgumentError, UnsupportedStrategyError

__all__ = ["ReplicaRNG", "ReplicaStream"]

_PHILOX = 1  # tf.random.Algorithm.PHILOX.value
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
_FUSED_MAX_ELEMENTS = 1 << 16

_KEY_INT = 0
_KEY_STR = 1


# --------------------------------------------------------------------- validation


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _check_int(value: Any, argument: str, minimum: int, fix: str) -> int:
    """``int(value)`` if ``value`` is an integer ``>= minimum``, else raises."""
    if not _is_int(value):
        raise InvalidArgumentError(
            f"{argument} must be an int, got {value!r} of type {type(value).__name__}. {fix}"
        )
    value = int(value)
    if value < minimum:
        raise InvalidArgumentError(f"{argument} must be >= {minimum}, got {value}. {fix}")
    return value


def _check_seed(seed: Any) -> int:
    return _check_int(
        seed,
        "seed",
        0,
        "Pass a non-negative Python int, for example ReplicaRNG(seed=1234).",
    )


def _check_worker(worker: Any) -> tuple[str, int]:
    fix = 'Pass worker=(task_type, task_id), for example ("worker", 0).'
    if (
        not isinstance(worker, (tuple, list))
        or len(worker) != 2
        or not isinstance(worker[0], str)
        or not worker[0]
    ):
        raise InvalidArgumentError(
            f"worker must be a (task_type, task_id) pair, got {worker!r}. {fix}"
        )
    return worker[0], _check_int(worker[1], "worker task_id", 0, fix)


def _key_words(keys: Sequence[Any], argument: str) -> tuple[int, ...]:
    """Encodes user keys (non-negative ints or strings) as SeedSequence spawn-key words."""
    words: list[int] = []
    for key in keys:
        if isinstance(key, str):
            words += [_KEY_STR, _stable_int(key)]
        elif _is_int(key) and int(key) >= 0:
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


def _is_python_value(value: Any, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _float_dtype(dtype: Any, argument: str = "dtype") -> tf.DType:
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        raise InvalidArgumentError(
            f"{argument} must be a floating-point dtype, got {dtype.name}. Use "
            "uniform_int()/integers() for integers."
        )
    return dtype


def _detect_worker() -> tuple[str, int]:
    """``(task_type, task_id)`` of this process: strategy, then TF_CONFIG, then worker:0."""
    resolver = getattr(tf.distribute.get_strategy(), "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    if task_type:
        return str(task_type), int(getattr(resolver, "task_id", 0) or 0)
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "") or "{}").get("task", {})
    except (ValueError, AttributeError):
        task = {}
    if isinstance(task, dict) and task.get("type"):
        return str(task["type"]), int(task.get("index", 0) or 0)
    return "worker", 0


# --------------------------------------------------------------------- strategies

# The default identity of a ParameterServerStrategy coordinator (its TF_CONFIG task).
_COORDINATOR = ("chief", 0)

_SUPPORTED_USES = (
    "Supported: a ReplicaRNG created in (or outside) the scope of "
    + ", ".join(s for s in SUPPORTED_STRATEGIES if not s.startswith("ParameterServer"))
    + " and drawn in that strategy's replicas or outside any strategy; and a ReplicaRNG "
    "created in ParameterServerStrategy.scope() on the coordinator and drawn in "
    "tf.functions run by that strategy's ClusterCoordinator.schedule (or from "
    "rng.for_worker(w))."
)


def _parameter_server_tasks(strategy: tf.distribute.Strategy) -> tuple[int, int]:
    """``(num_workers, num_ps)`` of a ``ParameterServerStrategy``'s cluster."""
    extended = strategy.extended
    num_workers = getattr(extended, "_num_workers", None)
    num_ps = getattr(extended, "_num_ps", None)
    if not (_is_int(num_workers) and _is_int(num_ps) and num_workers >= 1 and num_ps >= 1):
        raise UnsupportedStrategyError(
            "ReplicaRNG cannot read the number of workers and parameter servers of this "
            f"{type(strategy).__name__} (got num_workers={num_workers!r}, "
            f"num_ps={num_ps!r}); this TensorFlow version is not supported. " + _SUPPORTED_USES
        )
    return int(num_workers), int(num_ps)


def _ps_device(task: int) -> str:
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


# --------------------------------------------------------------------- one stream


_Kernels = tuple[Callable[..., Any], Callable[..., Any]]


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


class _Draws:
    """The distributions, built on ``_generate``: shared by one stream
    (:class:`ReplicaStream`) and a stream chosen at run time (:class:`_SelectedStream`),
    so both draw bitwise the same values for the same key and counter."""

    def _generate(self, kernels: _Kernels, shape: Any, **kwargs: Any) -> tf.Tensor:
        raise NotImplementedError

    def normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a normal distribution.

        Args:
          shape: 1-D integer shape of the result (list, tuple, ``TensorShape`` or tensor).
          mean: Mean, broadcastable to ``shape``.
          stddev: Standard deviation, broadcastable to ``shape``.
          dtype: A floating-point dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype``.

        Raises:
          InvalidArgumentError: ``dtype`` is not floating point (nothing is drawn).

        Thread safety: the read and advance of the counter and the draw are one kernel
          under the state variable's mutex: concurrent draws never overlap.

        Modes: eagerly the draw runs at once; in a ``tf.function`` it runs each time the
          function runs (tracing draws nothing). Under ``tf.distribute`` it uses this
          stream whatever replica or worker calls it (a stream of
          :meth:`ReplicaRNG.for_worker` lives on a parameter server, reachable from the
          coordinator and every worker).
        """
        dtype = _float_dtype(dtype)
        with tf.name_scope(name or "normal"):
            rnd = self._generate(_NORMAL, shape, dtype=dtype)
            return _affine(rnd, stddev, mean, dtype)

    def truncated_normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a normal distribution truncated to two standard deviations.

        Args:
          shape: 1-D integer shape of the result.
          mean: Mean, broadcastable to ``shape``.
          stddev: Standard deviation before truncation, broadcastable to ``shape``.
          dtype: A floating-point dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype`` with values in ``mean ± 2·stddev``.

        Raises:
          InvalidArgumentError: ``dtype`` is not floating point (nothing is drawn).

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        dtype = _float_dtype(dtype)
        with tf.name_scope(name or "truncated_normal"):
            rnd = self._generate(_TRUNCATED_NORMAL, shape, dtype=dtype)
            return _affine(rnd, stddev, mean, dtype)

    def uniform(
        self,
        shape: Any,
        minval: Any = 0,
        maxval: Any = None,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws from a uniform distribution on ``[minval, maxval)``.

        Args:
          shape: 1-D integer shape of the result.
          minval: Lower bound (included). For integer dtypes, ``minval`` and ``maxval``
            are both scalars or both ``None`` (the dtype's full range).
          maxval: Upper bound (excluded); default 1 for floating-point dtypes.
          dtype: Floating-point or integer dtype.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype``.

        Raises:
          InvalidArgumentError: an integer dtype with only one bound, a floating dtype
            with ``minval=None``, or Python bounds with ``minval >= maxval`` (nothing is
            drawn).

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        dtype = tf.as_dtype(dtype)
        if dtype.is_integer:
            if minval is None and maxval is None:
                return self._full_int(shape, dtype, name)
            if minval is None or maxval is None:
                raise InvalidArgumentError(
                    f"for integer dtype {dtype.name}, minval and maxval must both be given "
                    f"or both be None (full range); got minval={minval!r}, "
                    f"maxval={maxval!r}."
                )
            return self.uniform_int(shape, minval, maxval, dtype=dtype, name=name)
        dtype = _float_dtype(dtype)
        if minval is None:
            raise InvalidArgumentError(
                f"minval=None is only for integer dtypes (full range); for {dtype.name} "
                "pass a number (default 0)."
            )
        if maxval is None:
            maxval = 1
        _check_bounds(minval, maxval)
        with tf.name_scope(name or "uniform"):
            rnd = self._generate(_UNIFORM, shape, dtype=dtype)
            if _is_python_value(minval, 0) and _is_python_value(maxval, 1):
                return rnd
            lo = tf.convert_to_tensor(minval, dtype)
            return rnd * (tf.convert_to_tensor(maxval, dtype) - lo) + lo

    def uniform_int(
        self,
        shape: Any,
        minval: Any,
        maxval: Any,
        dtype: Any = tf.int64,
        name: str | None = None,
    ) -> tf.Tensor:
        """Draws integers uniformly from ``[minval, maxval)``.

        Args:
          shape: 1-D integer shape of the result.
          minval: Scalar lower bound (included).
          maxval: Scalar upper bound (excluded).
          dtype: ``tf.int32`` or ``tf.int64``.
          name: Optional op name.

        Returns:
          A tensor of ``shape`` and ``dtype`` (slightly biased unless ``maxval - minval``
          is a power of two, as ``tf.random.Generator.uniform``).

        Raises:
          InvalidArgumentError: ``dtype`` is not int32/int64, or Python bounds with
            ``minval >= maxval`` (nothing is drawn).

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        dtype = tf.as_dtype(dtype)
        if dtype not in (tf.int32, tf.int64):
            raise InvalidArgumentError(
                f"dtype must be tf.int32 or tf.int64 for uniform_int, got {dtype.name}."
            )
        _check_bounds(minval, maxval)
        with tf.name_scope(name or "uniform_int"):
            return self._generate(
                _UNIFORM_INT,
                shape,
                minval=tf.convert_to_tensor(minval, dtype),
                maxval=tf.convert_to_tensor(maxval, dtype),
            )

    integers = uniform_int  # numpy.random.Generator's name.

    def _full_int(self, shape: Any, dtype: tf.DType, name: str | None) -> tf.Tensor:
        with tf.name_scope(name or "uniform_full_int"):
            return self._generate(_FULL_INT, shape, dtype=dtype)

    # -- seeds drawn from the stream -----------------------------------------------------

    def make_seeds(self, count: int = 1) -> tf.Tensor:
        """Draws ``count`` seeds for stateless ops (``tf.random.stateless_*``, ``tf.image``).

        Args:
          count: Number of seeds, ``>= 1``.

        Returns:
          An int64 tensor of shape ``[2, count]``; column ``i`` is one seed (the layout of
          ``tf.random.Generator.make_seeds``).

        Raises:
          InvalidArgumentError: ``count`` is not a positive int (nothing is drawn).

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        count = _check_int(count, "count", 1, "Ask for at least one seed.")
        return self._full_int([2, count], tf.int64, "make_seeds")

    def make_seed(self) -> tf.Tensor:
        """Draws one seed for a stateless op: an int64 tensor of shape ``[2]``.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._full_int([2], tf.int64, "make_seed")


class _PureSeeds:
    """Seeds that are pure functions of ``(seed, worker, replica_id, keys)``: no stream moves.

    Subclasses provide ``_rng_seed``, ``replica_id`` and the ``worker`` property.
    """

    _rng_seed: int
    replica_id: int
    worker: Any

    def seed_for(self, *keys: str | int) -> int:
        """An integer seed named by ``keys``: see :meth:`ReplicaRNG.seed_for`."""
        return _seed31(self._sequence(_DOMAIN_SEED, *_key_words(keys, "keys")))

    def numpy(self, epoch: int = 0) -> np.random.Generator:
        """A numpy generator for this replica: see :meth:`ReplicaRNG.numpy`."""
        epoch = _check_int(epoch, "epoch", 0, "Pass the epoch number, counting from 0.")
        return np.random.Generator(np.random.PCG64(self._sequence(_DOMAIN_NUMPY, epoch)))

    def dataset_seed(self, epoch: int = 0) -> int:
        """A ``tf.data`` seed for this replica: see :meth:`ReplicaRNG.dataset_seed`."""
        epoch = _check_int(epoch, "epoch", 0, "Pass the epoch number, counting from 0.")
        return _seed63(self._sequence(_DOMAIN_DATASET, epoch))

    def element_seed(self, index: Any, epoch: int = 0) -> tf.Tensor:
        """The seed of element ``index``: see :meth:`ReplicaRNG.element_seed`."""
        epoch = _check_int(epoch, "epoch", 0, "Pass the epoch number, counting from 0.")
        if not isinstance(index, (tf.Tensor, tf.Variable)):
            index = _check_int(index, "index", 0, "Element indices count from 0.")
        base = _seed63(self._sequence(_DOMAIN_ELEMENT, epoch))
        return tf.stack([tf.constant(base, tf.int64), tf.cast(index, tf.int64)])

    def element_seeds(self, epoch: int = 0) -> tf.data.Dataset:
        """Per-element seeds for this replica: see :meth:`ReplicaRNG.element_seeds`."""
        epoch = _check_int(epoch, "epoch", 0, "Pass the epoch number, counting from 0.")
        base = tf.constant(_seed63(self._sequence(_DOMAIN_ELEMENT, epoch)), tf.int64)
        return tf.data.Dataset.counter(dtype=tf.int64).map(lambda i: tf.stack([base, i]))

    def _sequence(self, domain: int, *words: int) -> np.random.SeedSequence:
        return _sequence(self._rng_seed, self.worker, domain, self.replica_id, *words)


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

        Eagerly, and in a graph for draws of fewer than ``_FUSED_MAX_ELEMENTS`` static
        elements, the fused form runs (one op instead of four). Larger or dynamic draws
        in a graph use the split form, so that independent draws of one graph fill
        their outputs in parallel.
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


class _Identity(_PureSeeds):
    """``(seed, worker, replica_id)`` for pure seeds, without a stream."""

    def __init__(self, seed: int, worker: tuple[str, int], replica_id: int) -> None:
        self._rng_seed = seed
        self.worker = worker
        self.replica_id = replica_id


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


def _check_bounds(minval: Any, maxval: Any) -> None:
    python = (int, float, np.number)
    if isinstance(minval, python) and isinstance(maxval, python) and not minval < maxval:
        raise InvalidArgumentError(
            f"minval must be < maxval, got minval={minval!r}, maxval={maxval!r}."
        )


def _affine(rnd: tf.Tensor, scale: Any, shift: Any, dtype: tf.DType) -> tf.Tensor:
    """``rnd * scale + shift``, skipping the ops for the Python defaults 1 and 0."""
    if not _is_python_value(scale, 1):
        rnd = rnd * tf.convert_to_tensor(scale, dtype)
    if not _is_python_value(shift, 0):
        rnd = rnd + tf.convert_to_tensor(shift, dtype)
    return rnd


# --------------------------------------------------------------------- the RNG


class ReplicaRNG(tf.Module):
    """One seed, an independent reproducible random stream per replica and worker.

    ``ReplicaRNG(seed)`` creates one :class:`ReplicaStream` per replica. Created inside
    ``strategy.scope()``, it has ``strategy.num_replicas_in_sync`` streams, each on its
    replica's device; otherwise one stream (pass ``num_replicas`` to have more). Inside
    ``strategy.run`` the draw methods of the RNG (:meth:`normal`, :meth:`uniform`, ...)
    use the current replica's stream; in cross-replica context and outside any strategy
    they use replica 0's.

    Created in the scope of a ``ParameterServerStrategy`` (on the coordinator), it holds
    ``num_replicas`` streams for *every* worker of the cluster, on the parameter
    servers, and its draw methods work in functions run by
    ``ClusterCoordinator.schedule``: each draw uses the stream of the worker that runs
    it (see the module docstring).

    Example::

        rng = safevars.ReplicaRNG(1234, num_replicas=strategy.num_replicas_in_sync)
        @tf.function
        def step(x):
            return strategy.run(lambda x: x + rng.normal(tf.shape(x)), args=(x,))
        ckpt = tf.train.Checkpoint(rng=rng)  # streams are saved and restored

    Args:
      seed: A non-negative Python int; the only input the streams depend on (with the
        worker and replica ids).
      num_replicas: Number of replica streams (per worker under
        ``ParameterServerStrategy``), ``>= 1``. Default: the ``num_replicas_in_sync``
        of the current strategy (1 outside any strategy).
      worker: ``(task_type, task_id)`` of this process, part of every key. Default: the
        current strategy's ``cluster_resolver``, else ``TF_CONFIG``, else
        ``("worker", 0)``. Under ``ParameterServerStrategy`` it is the coordinator's
        identity, used by the pure seeds (:meth:`seed_for`, ...), default
        ``("chief", 0)``; worker ``w``'s streams are always keyed by ``("worker", w)``.
      name: Module name (the checkpoint does not depend on it).

    Raises:
      InvalidArgumentError: ``seed`` is negative, not an int or a bool; ``num_replicas``
        is not a positive int; ``worker`` is not a ``(str, non-negative int)`` pair.
      UnsupportedStrategyError: created in the scope of a strategy safevars does not
        support (``CentralStorageStrategy``, ``TPUStrategy``, the TF1
        ``ParameterServerStrategy``, ...); the message names the supported ones.
    """

    def __init__(
        self,
        seed: int,
        num_replicas: int | None = None,
        *,
        worker: tuple[str, int] | None = None,
        name: str | None = None,
    ) -> None:
        seed = _check_seed(seed)
        strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if strategy is not None:
            check_strategy(strategy)
        parameter_server = is_parameter_server(strategy)
        if num_replicas is None:
            num_replicas = strategy.num_replicas_in_sync if strategy is not None else 1
        num_replicas = _check_int(
            num_replicas,
            "num_replicas",
            1,
            "Pass the number of replicas, for example strategy.num_replicas_in_sync.",
        )
        if worker is not None:
            worker = _check_worker(worker)
        else:
            worker = _COORDINATOR if parameter_server else _detect_worker()
        # Every check is done: nothing below can fail on a user's argument.
        super().__init__(name=name or "replica_rng")
        self._seed = seed
        self._num_replicas = num_replicas
        self._worker = worker
        self._parameter_server = parameter_server
        # (worker identity, replica id, device, name) of every stream, worker-major.
        specs: list[tuple[tuple[str, int], int, str | None, str]]
        if parameter_server:
            assert strategy is not None
            num_workers, num_ps = _parameter_server_tasks(strategy)
            # Stream (w, r) lives on a parameter server: reachable by every worker and by
            # the coordinator's checkpoints; keyed by the worker task it serves.
            specs = [
                (("worker", w), r, _ps_device(w % num_ps), f"worker_{w}_replica_{r}")
                for w in range(num_workers)
                for r in range(num_replicas)
            ]
        else:
            num_workers = 1
            devices: Sequence[str | None] = [None] * num_replicas
            if strategy is not None:
                local = list(getattr(strategy.extended, "worker_devices", ()) or ())
                if len(local) == num_replicas:
                    devices = local
            specs = [(worker, r, devices[r], f"replica_{r}") for r in range(num_replicas)]
        self._num_workers = num_workers
        self._streams = [
            ReplicaStream(seed, identity, r, device, name=stream_name)
            for identity, r, device, stream_name in specs
        ]

    # -- identity -------------------------------------------------------------------

    @property
    def seed(self) -> int:
        """The seed the RNG was created with."""
        return self._seed

    @property
    def num_replicas(self) -> int:
        """The number of replica streams (of each worker under ``ParameterServerStrategy``)."""
        return self._num_replicas

    @property
    def num_workers(self) -> int:
        """The number of workers whose streams this RNG holds: the cluster's workers
        under ``ParameterServerStrategy``, else 1 (this process)."""
        return self._num_workers

    @property
    def worker(self) -> tuple[str, int]:
        """The ``(task_type, task_id)`` that is part of every key (of the pure seeds only
        under ``ParameterServerStrategy``: the coordinator)."""
        return (str(self._worker[0]), int(self._worker[1]))

    @property
    def streams(self) -> tuple[ReplicaStream, ...]:
        """Every stream: stream ``worker * num_replicas + replica``, worker-major (outside
        ``ParameterServerStrategy`` there is one worker, so this is by replica id)."""
        return tuple(self._streams)

    def __repr__(self) -> str:
        task_type, task_id = self._worker
        cluster = (
            f" num_workers={self._num_workers} (ParameterServerStrategy)"
            if self._parameter_server
            else ""
        )
        return (
            f"<safevars.ReplicaRNG seed={self._seed} num_replicas={self._num_replicas}"
            f"{cluster} worker={task_type}:{task_id}>"
        )

    # -- choosing a stream ------------------------------------------------------------

    def for_replica(self, replica_id: int) -> ReplicaStream:
        """The stream of replica ``replica_id``.

        Args:
          replica_id: An int in ``[0, num_replicas)`` (or a tensor with that static value).

        Returns:
          The :class:`ReplicaStream`; the same object on every call.

        Raises:
          InvalidArgumentError: ``replica_id`` is not an int, is negative or is
            ``>= num_replicas``; or the RNG was created under ``ParameterServerStrategy``
            (every worker has a replica ``replica_id``: use :meth:`for_worker`).
        """
        if self._parameter_server:
            raise InvalidArgumentError(
                f"replica_id={replica_id!r} does not name one stream: this ReplicaRNG was "
                f"created under ParameterServerStrategy and has a stream per worker "
                f"({self._num_workers}) and replica. Use for_worker(worker_index, "
                "replica_id), or the RNG's own draw methods in a scheduled function."
            )
        return self._streams[self._check_replica(replica_id, "replica_id")]

    def for_worker(self, worker_index: int, replica_id: int = 0) -> ReplicaStream:
        """The stream of replica ``replica_id`` of worker task ``worker_index``.

        Only for an RNG created under ``ParameterServerStrategy``, where the coordinator
        holds every worker's streams: use it to draw for a known worker from the
        coordinator, or to check what a worker drew. The stream equals stream
        ``replica_id`` of ``ReplicaRNG(seed, worker=("worker", worker_index))`` (same
        key, so the same values from the same counter).

        Args:
          worker_index: The worker's task id, in ``[0, num_workers)``.
          replica_id: The replica on that worker, in ``[0, num_replicas)``.

        Returns:
          The :class:`ReplicaStream` (its state lives on a parameter server).

        Raises:
          InvalidArgumentError: bad ``worker_index`` or ``replica_id``; or the RNG was not
            created under ``ParameterServerStrategy`` (another process's streams are
            ``ReplicaRNG(seed, worker=(task_type, task_id)).for_replica(r)``).
        """
        if not self._parameter_server:
            task_type, task_id = self._worker
            raise InvalidArgumentError(
                f"for_worker(worker_index={worker_index!r}) is for a ReplicaRNG created in "
                "ParameterServerStrategy.scope(); this one holds the streams of "
                f"{task_type}:{task_id} only: use for_replica(replica_id). The streams of "
                "another process are ReplicaRNG(seed, worker=(task_type, task_id))"
                ".for_replica(replica_id)."
            )
        fix = f"Worker indices are 0..{self._num_workers - 1} (the cluster's worker tasks)."
        worker_index = _check_int(worker_index, "worker_index", 0, fix)
        if worker_index >= self._num_workers:
            raise InvalidArgumentError(f"worker_index={worker_index} is out of range. {fix}")
        replica_id = self._check_replica(replica_id, "replica_id")
        return self._streams[worker_index * self._num_replicas + replica_id]

    def _check_replica(self, replica_id: Any, argument: str) -> int:
        if isinstance(replica_id, (tf.Tensor, tf.Variable)):
            static = tf.get_static_value(replica_id)
            if static is None or np.ndim(static) != 0:
                raise InvalidArgumentError(
                    f"{argument} must be a Python int, got a tensor without a static "
                    f"value: {replica_id!r}. Use the RNG's own draw methods inside "
                    "strategy.run; they pick the replica from the replica context."
                )
            replica_id = static.item()
        fix = (
            f"This ReplicaRNG has {self._num_replicas} replica stream(s); valid ids are "
            f"0..{self._num_replicas - 1}. Create it inside strategy.scope() or pass "
            "num_replicas=strategy.num_replicas_in_sync."
        )
        replica_id = _check_int(replica_id, argument, 0, fix)
        if replica_id >= self._num_replicas:
            raise InvalidArgumentError(f"{argument}={replica_id} is out of range. {fix}")
        return replica_id

    def _check_draw_strategy(self) -> None:
        """Raises if the current strategy cannot use this RNG's streams."""
        strategy = tf.distribute.get_strategy()
        check_strategy(strategy)
        if is_parameter_server(strategy) == self._parameter_server:
            return
        if self._parameter_server:
            raise UnsupportedStrategyError(
                f"this ReplicaRNG was created under ParameterServerStrategy: its streams "
                f"are chosen by worker index, so it cannot draw under "
                f"{type(strategy).__name__}. " + _SUPPORTED_USES
            )
        raise UnsupportedStrategyError(
            "this ReplicaRNG was created outside ParameterServerStrategy.scope(): its "
            "streams are this process's replicas, not the cluster's workers, so every "
            "worker would share one stream in whatever order the coordinator schedules "
            "steps. Create it inside strategy.scope() on the coordinator. " + _SUPPORTED_USES
        )

    def _current_replica(self) -> int | tf.Tensor:
        """The replica id of the calling context: an int, or an int32 tensor (TPU)."""
        if not tf.distribute.has_strategy():
            return 0
        self._check_draw_strategy()
        if tf.distribute.in_cross_replica_context():
            return 0
        context = tf.distribute.get_replica_context()
        if context is None:  # pragma: no cover - covered by in_cross_replica_context
            return 0
        in_sync = context.num_replicas_in_sync
        if in_sync > self._num_replicas:
            # Checked by every replica before any of them draws, so a misconfigured
            # strategy.run moves no stream at all.
            raise InvalidArgumentError(
                f"the strategy runs {in_sync} replicas but this ReplicaRNG has "
                f"num_replicas={self._num_replicas} stream(s). Create it inside "
                "strategy.scope() or pass num_replicas=strategy.num_replicas_in_sync."
            )
        replica_id = context.replica_id_in_sync_group
        static = tf.get_static_value(replica_id)
        if static is None:
            return replica_id
        return self._check_replica(int(static), "replica id of the replica context")

    def current_stream(self) -> ReplicaStream:
        """The stream of the calling replica (replica 0 outside ``strategy.run``).

        Raises:
          InvalidArgumentError: the replica id of the replica context is out of range
            (the RNG has fewer streams than the strategy has replicas), or it is only
            known at run time (use the RNG's own draw methods then), or the RNG was
            created under ``ParameterServerStrategy`` (the worker is only known at run
            time: use the draw methods or :meth:`for_worker`).
        """
        return self.for_replica(self._current_replica())

    def _select(self) -> _Draws:
        """The stream the calling context draws from (validated before any draw)."""
        replica = self._current_replica()
        if self._parameter_server:
            return self._executing_worker_stream(replica)
        if isinstance(replica, int):
            return self._streams[replica]
        # A replica id known only at run time (e.g. TPUStrategy).
        return _SelectedStream([s.state.handle for s in self._streams], replica)

    def _executing_worker_stream(self, replica: int | tf.Tensor) -> _SelectedStream:
        """Under ParameterServerStrategy: the stream of (executing worker, replica).

        The state handle is an input of the function bound at *call* time, when
        ``ClusterCoordinator`` runs it on a worker (the mechanism of
        ``tf.distribute.coordinator.experimental_get_current_worker_index``): the draw is
        then one ``RngReadAndSkip`` on the worker's state, like a draw from any
        captured variable. Selecting the state in the graph from the worker index
        instead (``tf.switch_case`` over every worker's state) took about 1.5x the time
        of a ``tf.random.Generator`` draw per scheduled step in a 3-worker, 1-PS
        loopback cluster; the bound handle takes about the same time as the Generator.
        """
        if not tf.inside_function():
            raise UnsupportedStrategyError(
                "this ReplicaRNG was created under ParameterServerStrategy, where a draw "
                "uses the stream of the worker that runs it; an eager call on the "
                "coordinator runs on no worker. Draw inside a tf.function run by "
                "ClusterCoordinator.schedule, or from a named worker's stream with "
                "rng.for_worker(worker_index). " + _SUPPORTED_USES
            )
        graph = tf.compat.v1.get_default_graph()
        # Bind in the outermost function graph (the one the coordinator calls); a draw
        # in a tf.cond branch or loop body then captures that input as usual.
        while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
            graph = graph.outer_graph
        if isinstance(replica, int):
            return _SelectedStream([self._call_time_handle(graph, replica)], 0)
        handles = [self._call_time_handle(graph, r) for r in range(self._num_replicas)]
        return _SelectedStream(handles, replica)

    def _call_time_handle(self, graph: Any, replica: int) -> tf.Tensor:
        """A placeholder fed, at each call, with the state handle of stream (executing
        worker, ``replica``)."""
        streams, num_replicas = self._streams, self._num_replicas

        def executing_worker_handle() -> tf.Tensor:
            dispatch = _dispatch_context.get_current_dispatch_context()
            if dispatch is None:
                raise UnsupportedStrategyError(
                    "a tf.function drawing from a ReplicaRNG created under "
                    "ParameterServerStrategy ran outside ClusterCoordinator.schedule, "
                    "so no worker's stream applies. Schedule it with the coordinator. "
                    + _SUPPORTED_USES
                )
            return streams[dispatch.worker_index * num_replicas + replica].state.handle

        return graph.capture_call_time_value(
            executing_worker_handle,
            tf.TensorSpec([], tf.resource),
            key=("safevars.ReplicaRNG", id(self), replica),
        )

    # -- draws on the current replica's stream -----------------------------------------

    def normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """:meth:`ReplicaStream.normal` on the current replica's stream.

        Raises:
          InvalidArgumentError: as :meth:`current_stream`, or a bad ``dtype``.
          UnsupportedStrategyError: the current strategy is not supported, or is not the
            kind the RNG was created under (``ParameterServerStrategy`` or not); or an
            eager call on a ``ParameterServerStrategy`` coordinator.

        Thread safety: as :meth:`ReplicaStream.normal`; under ``MirroredStrategy`` every
          replica thread advances only its own stream; under ``ParameterServerStrategy``
          concurrent workers advance their own counters on the parameter server.

        Modes: eager and ``tf.function``; inside ``strategy.run`` the replica comes from
          ``tf.distribute.get_replica_context()`` (a run-time replica id selects the
          stream with ``tf.switch_case``). Under ``ParameterServerStrategy``, only in a
          ``tf.function`` run by ``ClusterCoordinator.schedule``: the stream of the
          worker the coordinator runs the function on, bound at each call (the values
          are computed on that worker).
        """
        return self._select().normal(shape, mean, stddev, dtype, name)

    def truncated_normal(
        self,
        shape: Any,
        mean: Any = 0.0,
        stddev: Any = 1.0,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """:meth:`ReplicaStream.truncated_normal` on the current replica's stream.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._select().truncated_normal(shape, mean, stddev, dtype, name)

    def uniform(
        self,
        shape: Any,
        minval: Any = 0,
        maxval: Any = None,
        dtype: Any = tf.float32,
        name: str | None = None,
    ) -> tf.Tensor:
        """:meth:`ReplicaStream.uniform` on the current replica's stream.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._select().uniform(shape, minval, maxval, dtype, name)

    def uniform_int(
        self, shape: Any, minval: Any, maxval: Any, dtype: Any = tf.int64, name: str | None = None
    ) -> tf.Tensor:
        """:meth:`ReplicaStream.uniform_int` on the current replica's stream.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._select().uniform_int(shape, minval, maxval, dtype, name)

    integers = uniform_int

    def make_seeds(self, count: int = 1) -> tf.Tensor:
        """:meth:`ReplicaStream.make_seeds` on the current replica's stream.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        count = _check_int(count, "count", 1, "Ask for at least one seed.")
        return self._select().make_seeds(count)

    def make_seed(self) -> tf.Tensor:
        """:meth:`ReplicaStream.make_seed` on the current replica's stream.

        Thread safety: as :meth:`normal`.

        Modes: as :meth:`normal`.
        """
        return self._select().make_seed()

    def keras_seed_generator(self, name: str | None = None) -> keras.random.SeedGenerator:
        """A ``keras.random.SeedGenerator`` that draws from the calling replica's stream.

        Pass it as the ``seed`` of ``keras.random.*`` ops in a custom layer, or assign it
        to a built-in layer's ``seed_generator`` attribute (``Dropout``,
        ``GaussianNoise``, ...): inside ``strategy.run`` every replica then gets its own
        dropout masks, reproducibly, where a plain ``SeedGenerator`` would hand all
        replicas the same seeds. Its position lives in this RNG's streams (checkpoint the
        RNG), not in the generator's own ``state`` variable.

        Args:
          name: Keras name of the generator.

        Returns:
          A :class:`ReplicaSeedGenerator`.

        Thread safety: each ``next()`` is one atomic draw, as :meth:`normal`.

        Modes: as :meth:`normal`; the replica is looked up at each ``next()``.
        """
        seed = self._pure(0).seed_for("keras", name or "")
        return _seed_generator_class()(self.make_seed, seed, name)

    def attach(self, layer: Any) -> int:
        """Makes every Keras ``seed_generator`` in ``layer`` draw from this RNG.

        Built-in Keras layers (``Dropout``, ``GaussianNoise``, ``RandomFlip``, ...) create
        their ``keras.random.SeedGenerator`` when constructed; under ``MirroredStrategy``
        one generator serves every replica, so all replicas get the same masks. This
        replaces the ``seed_generator`` of ``layer`` and of all its sublayers (a whole
        model at once) with :meth:`keras_seed_generator` objects: each replica then
        draws its own seeds from its own stream. Already attached generators are kept.

        Args:
          layer: A ``keras.Layer`` (a model is a layer).

        Returns:
          The number of generators replaced.

        Raises:
          InvalidArgumentError: ``layer`` is not a Keras layer.

        Thread safety: not atomic with respect to a concurrent call of the layer; attach
          before training starts.

        Modes: eager only (it edits Python objects); the layer's later calls work eagerly
          and in ``tf.function``.
        """
        import keras

        if not isinstance(layer, keras.layers.Layer):
            raise InvalidArgumentError(
                f"layer must be a keras.Layer or keras.Model, got {type(layer).__name__}."
            )
        generator_class = _seed_generator_class()
        replaced = 0
        for sublayer in layer._flatten_layers(include_self=True, recursive=True):
            old = getattr(sublayer, "seed_generator", None)
            if not isinstance(old, keras.random.SeedGenerator) or isinstance(old, generator_class):
                continue
            path = str(getattr(sublayer, "path", None) or sublayer.name).replace("/", "_")
            new = self.keras_seed_generator(name=f"{path}_replica_seed_generator")
            # Keras locks a built layer's tracker; swap the tracked generator the way
            # Keras' own _untrack_variable does, so layer.variables stays consistent.
            tracker = sublayer._tracker
            was_locked = tracker.locked
            tracker.unlock()
            try:
                tracker.untrack(old)
                sublayer.seed_generator = new
            finally:
                if was_locked:
                    tracker.lock()
            replaced += 1
        return replaced

    # -- pure seeds: functions of (seed, worker, replica, keys); no stream moves --------

    def _pure(self, replica_id: int | None) -> _PureSeeds:
        """``(seed, worker, replica)`` of the pure seeds: the RNG's own worker identity
        (the coordinator's under ``ParameterServerStrategy``, so the same on every
        worker) and the given or calling replica."""
        if replica_id is None:
            replica_id = self._current_replica()
        return _Identity(self._seed, self.worker, self._check_replica(replica_id, "replica_id"))

    def seed_for(self, *keys: str | int, replica_id: int | None = None) -> int:
        """A Python int seed named by ``keys``, e.g. for ``keras.layers.Dropout(seed=...)``.

        The value depends only on ``(seed, worker, replica_id, keys)``: the same keys give
        the same seed in every process, different keys, replicas or workers (almost
        surely) different ones.

        Args:
          *keys: Non-negative ints and/or strings naming the use, e.g.
            ``seed_for("dropout", 3)``.
          replica_id: The replica; default the calling replica (0 outside
            ``strategy.run``).

        Returns:
          An int in ``[0, 2**31 - 1)``, valid for Keras, ``tf.random.set_seed`` and
          ``tf.data``.

        Raises:
          InvalidArgumentError: a key that is not a non-negative int or a string, or a
            bad ``replica_id``.

        Thread safety: pure function; reads no TensorFlow state.

        Modes: a Python value computed at trace time; it is the same in every trace.
        """
        return self._pure(replica_id).seed_for(*keys)

    def numpy(self, replica_id: int | None = None, *, epoch: int = 0) -> np.random.Generator:
        """A ``numpy.random.Generator`` for a replica's numpy data pipeline.

        ``numpy.random.Generator(PCG64(SeedSequence(seed, spawn_key=(1, w, task_id,
        replica_id, epoch))))`` with ``w`` the first 8 bytes (little endian) of the
        SHA-256 of the task type: a new generator at the start of its stream on every
        call, so ``numpy(r, epoch=e)`` is reproducible on its own.

        Args:
          replica_id: The replica; default the calling replica.
          epoch: A non-negative int; every epoch gets an independent generator.

        Returns:
          A fresh ``numpy.random.Generator``.

        Raises:
          InvalidArgumentError: bad ``replica_id`` or ``epoch``.

        Thread safety: pure function; the returned generator is not thread-safe (numpy's
          rule): use one per thread.

        Modes: Python only; call it outside ``tf.function`` (``tf.numpy_function`` works).
        """
        return self._pure(replica_id).numpy(epoch)

    def dataset_seed(self, epoch: int = 0, replica_id: int | None = None) -> int:
        """An int seed for ``tf.data`` ops (``shuffle(seed=...)``), per epoch and replica.

        Note that ``tf.data`` combines an op seed with the global seed
        (``tf.random.set_seed``), so a pipeline is reproducible when both are fixed.

        Args:
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          An int in ``[0, 2**63)``.

        Raises:
          InvalidArgumentError: bad ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: a Python value; the same in every trace.
        """
        return self._pure(replica_id).dataset_seed(epoch)

    def element_seed(self, index: Any, epoch: int = 0, replica_id: int | None = None) -> tf.Tensor:
        """The stateless seed of element ``index``: ``[base(seed, worker, replica, epoch), index]``.

        Use inside ``dataset.enumerate().map(...)`` with ``tf.random.stateless_*`` or
        ``tf.image.stateless_random_*``: the augmentation of an element then depends on
        its index only, not on ``num_parallel_calls`` or iteration order. Under
        ``ParameterServerStrategy``, pass a step number as ``index`` (an argument of the
        scheduled function): the step's values are then the same whichever worker runs
        it.

        Args:
          index: The element (or step) index: a non-negative int or an integer tensor.
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          An int64 tensor of shape ``[2]``.

        Raises:
          InvalidArgumentError: bad ``index`` (Python), ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: eager and graph (``tf.data`` functions).
        """
        return self._pure(replica_id).element_seed(index, epoch)

    def element_seeds(self, epoch: int = 0, replica_id: int | None = None) -> tf.data.Dataset:
        """An infinite dataset of per-element seeds: element ``i`` is ``element_seed(i, epoch)``.

        ``tf.data.Dataset.zip((dataset, rng.element_seeds(epoch)))`` pairs every element
        with its own seed.

        Args:
          epoch: A non-negative int.
          replica_id: The replica; default the calling replica.

        Returns:
          A ``tf.data.Dataset`` of int64 tensors of shape ``[2]``.

        Raises:
          InvalidArgumentError: bad ``epoch`` or ``replica_id``.

        Thread safety: pure function.

        Modes: builds a dataset; iterate it eagerly or in a ``tf.function``.
        """
        return self._pure(replica_id).element_seeds(epoch)


# --------------------------------------------------------------------- Keras


ReplicaSeedGenerator: Any  # The class is built on first use (importing Keras is slow).


@functools.cache
def _seed_generator_class() -> type:
    import keras

    class ReplicaSeedGenerator(keras.random.SeedGenerator):
        """A ``keras.random.SeedGenerator`` drawing its seeds from a safevars stream.

        Made by :meth:`ReplicaRNG.keras_seed_generator` (the calling replica's stream at
        each ``next()``) or :meth:`ReplicaStream.keras_seed_generator` (one stream).
        The Keras ``state`` variable it inherits is seeded with ``seed_for("keras",
        name)`` but not used: the stream holds the position.
        """

        def __init__(
            self, draw: Callable[[], tf.Tensor], seed: int, name: str | None = None
        ) -> None:
            super().__init__(seed=seed, name=name)
            self._safevars_draw = draw

        def next(self, ordered: bool = True) -> tf.Tensor:
            """Draws a seed of shape ``[2]`` (int64) from the stream.

            Thread safety: one atomic draw.

            Modes: eager and ``tf.function``; the replica is looked up at each call.
            """
            return self._safevars_draw()

    ReplicaSeedGenerator.__module__ = __name__
    globals()["ReplicaSeedGenerator"] = ReplicaSeedGenerator
    return ReplicaSeedGenerator


def __getattr__(name: str) -> Any:
    if name == "ReplicaSeedGenerator":
        return _seed_generator_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
