"""Where the streams live under ``ParameterServerStrategy``, and how a worker reaches its own.

Stream ``(w, r)`` (worker task ``w``, replica ``r``) lives on parameter server
``w % num_ps`` (:func:`_ps_device`; ``ReplicaRNG.__init__`` lays the streams out from
:func:`_parameter_server_tasks`): reachable from every worker, saved by the
coordinator's checkpoints, untouched by a worker failure (the module docstring of
:mod:`safevars.rng` explains the choice). A draw in a function run by
``ClusterCoordinator.schedule`` uses a state handle bound at each call to the stream of
the worker the coordinator runs it on (:class:`_ExecutingWorkerStreams`).
``safevars.data.ShardedInput`` places its positions with :func:`_ps_device` too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tensorflow as tf

from safevars._tf_internal import FuncGraph
from safevars._tf_internal import coordinator_context as _dispatch_context
from safevars._validation import is_int
from safevars.errors import UnsupportedStrategyError
from safevars.rng.replica_stream import _SelectedStream
from safevars.rng.strategies import _SUPPORTED_USES

if TYPE_CHECKING:
    from safevars.rng.replica_stream import ReplicaStream


def _parameter_server_tasks(strategy: tf.distribute.Strategy) -> tuple[int, int]:
    """``(num_workers, num_ps)`` of a ``ParameterServerStrategy``'s cluster."""
    extended = strategy.extended
    num_workers: Any = getattr(extended, "_num_workers", None)
    num_ps: Any = getattr(extended, "_num_ps", None)
    if not (is_int(num_workers) and is_int(num_ps) and num_workers >= 1 and num_ps >= 1):
        raise UnsupportedStrategyError(
            "ReplicaRNG cannot read the number of workers and parameter servers of this "
            f"{type(strategy).__name__} (got num_workers={num_workers!r}, "
            f"num_ps={num_ps!r}); this TensorFlow version is not supported. " + _SUPPORTED_USES
        )
    return int(num_workers), int(num_ps)


def _ps_device(task: int) -> str:
    return f"/job:ps/replica:0/task:{task}/device:CPU:0"


class _ExecutingWorkerStreams:
    """The stream of the worker that runs a scheduled function (a mixin of
    :class:`~safevars.ReplicaRNG`; no state of its own)."""

    if TYPE_CHECKING:
        _streams: list[ReplicaStream]
        _num_replicas: int

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
