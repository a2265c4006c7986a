"""ReplicaRNG: one seed, an independent reproducible random stream per replica and worker.

The class: its docstring, the constructor (argument checks, worker identity, one
:class:`~safevars.ReplicaStream` per replica, or per worker and replica on the parameter
servers), its identity, choosing a stream (by replica id, by worker, or the calling
replica's under the current strategy) and the draws on the current replica's stream
(the distributions are a stream's, :mod:`.distributions`). The pure seeds, the Keras seed generators and the parameter-server binding of a
scheduled draw are mixins (:mod:`.pure_seeds`, :mod:`.keras_seed_generator`,
:mod:`.placement`); the semantics are described in the docstring of :mod:`safevars.rng`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _autograph  # noqa: F401  (registers safevars with AutoGraph)
from safevars._validation import check_int
from safevars.distribute import check_strategy, is_parameter_server
from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.rng.arguments import _check_seed, _check_worker
from safevars.rng.distributions import _Draws
from safevars.rng.keras_seed_generator import _KerasSeedGenerators
from safevars.rng.kernels import _Kernels
from safevars.rng.placement import _ExecutingWorkerStreams, _parameter_server_tasks, _ps_device
from safevars.rng.pure_seeds import _ReplicaPureSeeds
from safevars.rng.replica_stream import ReplicaStream, _SelectedStream
from safevars.rng.strategies import _COORDINATOR, _SUPPORTED_USES, _detect_worker

__all__ = ["ReplicaRNG"]


class ReplicaRNG(
    _ReplicaPureSeeds, _KerasSeedGenerators, _ExecutingWorkerStreams, _Draws, tf.Module
):
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
    it (see the docstring of :mod:`safevars.rng`).

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
        num_replicas = check_int(
            num_replicas,
            "num_replicas",
            1,
            fix="Pass the number of replicas, for example strategy.num_replicas_in_sync.",
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
        worker_index = check_int(worker_index, "worker_index", 0, fix=fix)
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
        replica_id = check_int(replica_id, argument, 0, fix=fix)
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

    # -- draws on the current replica's stream -----------------------------------------

    def _generate(self, kernels: _Kernels, shape: Any, **kwargs: Any) -> tf.Tensor:
        """The draws of :class:`_Draws` (:meth:`normal`, ...) on the calling context's
        stream, chosen (and the strategy checked) once the draw's arguments are."""
        return self._select()._generate(kernels, shape, **kwargs)
