"""How a ShardedInput's shards map onto a ``tf.distribute`` strategy, and the checks."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from safevars.data._layout import Layout
from safevars.distribute import check_strategy, is_parameter_server
from safevars.errors import InvalidArgumentError
from safevars.rng.placement import _parameter_server_tasks


def local_replicas(strategy: tf.distribute.Strategy) -> int:
    """Replicas of one worker: its devices (``worker_devices``), at least 1."""
    return len(getattr(strategy.extended, "worker_devices", ()) or ()) or 1


def default_layout(strategy: tf.distribute.Strategy | None) -> tuple[bool, int, int]:
    """``(parameter_server, num_workers, replicas_per_worker)`` of the strategy in scope.

    Raises:
      UnsupportedStrategyError: a strategy safevars does not support.
    """
    if strategy is None:
        return False, 1, 1
    check_strategy(strategy)
    if is_parameter_server(strategy):
        return True, _parameter_server_tasks(strategy)[0], 1
    local = local_replicas(strategy)
    return False, max(1, strategy.num_replicas_in_sync // local), local


def check_mirrored(layout: Layout, strategy: tf.distribute.Strategy, options: Any) -> None:
    """Raises unless ``strategy`` runs ``layout``'s workers and replicas, per worker."""
    local = local_replicas(strategy)
    if strategy.num_replicas_in_sync != layout.num_shards or local != layout.replicas_per_worker:
        raise InvalidArgumentError(
            f"the strategy runs {strategy.num_replicas_in_sync} replicas, {local} per "
            f"worker, but this ShardedInput has num_workers={layout.num_workers}, "
            f"replicas_per_worker={layout.replicas_per_worker}. Create it in "
            "strategy.scope() (the defaults then match) or pass matching values."
        )
    if options is not None and (
        options.experimental_replication_mode != tf.distribute.InputReplicationMode.PER_WORKER
    ):
        raise InvalidArgumentError(
            "options must use InputReplicationMode.PER_WORKER (replica r of a worker takes "
            f"its r-th batch of each round), got {options.experimental_replication_mode}."
        )


def check_coordinator(coordinator: Any, layout: Layout) -> None:
    """Raises unless ``coordinator`` is a ClusterCoordinator of ``layout``'s workers."""
    strategy = getattr(coordinator, "strategy", None)
    if not (
        callable(getattr(coordinator, "create_per_worker_dataset", None))
        and is_parameter_server(strategy)
    ):
        raise InvalidArgumentError(
            f"coordinator must be a ClusterCoordinator, got {coordinator!r}."
        )
    workers = _parameter_server_tasks(strategy)[0]
    if workers != layout.num_workers:
        raise InvalidArgumentError(
            f"the coordinator's cluster has {workers} workers, this ShardedInput "
            f"num_workers={layout.num_workers}. Create it in strategy.scope()."
        )
