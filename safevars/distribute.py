"""safevars under ``tf.distribute``: which strategies, and how writes cross replicas.

Supported strategies (anything else raises :class:`~safevars.UnsupportedStrategyError`
when a SafeVariable is created in its scope or written in its replica context):

* no strategy / the default strategy and ``OneDeviceStrategy``;
* ``MirroredStrategy`` (one machine, several devices);
* ``MultiWorkerMirroredStrategy`` (``CollectiveAllReduceStrategy``; several processes
  configured by ``TF_CONFIG``);
* ``ParameterServerStrategy`` (TF2, driven by ``ClusterCoordinator``).

How a write is made safe under each:

* **Cross-replica context** (outside ``strategy.run``): the write goes through the
  variable's guard as usual; a ``MirroredVariable`` write updates every component inside
  the one critical section.
* **Replica context of a mirrored variable** (inside ``strategy.run``): replicas cannot
  each take the lock — under ``MirroredStrategy`` they are traced in lock-step threads
  that meet at ``merge_call``, and holding a critical section across that meeting would
  deadlock. So safevars first merges, exactly as TensorFlow does for the variable's
  ``aggregation`` (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``), and then makes *one*
  locked, versioned write in cross-replica context. With aggregation ``NONE``
  TensorFlow merges nothing, each replica writes its own copy with its own value (Keras'
  EMA copies of ``use_ema=True``): safevars gathers the replicas' values and writes
  each copy its own, again as one locked, versioned write. ``update(fn)`` applies every
  replica's ``fn`` in replica order inside one critical section, one version each, so
  no replica's update is lost.
* **Parameter servers**: variables live on the PS tasks; the guard places its
  ``tf.CriticalSection`` and its version variable on the variable's device, so every
  worker's graph locks the same mutex on the PS — concurrent workers lose no update and
  the version counts every write.
* **Multi-worker mirrored**: every worker applies the same all-reduced write to its own
  copy; each worker's versions therefore agree.

NOTES:
  Keras optimizers apply their updates under a strategy through
  ``strategy.extended.update``, which hands *component* variables to the update
  function: those writes bypass a SafeVariable's lock and version. Wrap the optimizer in
  :class:`safevars.SafeOptimizer`, which locks and counts at the ``apply_gradients`` level.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from safevars._tf_internal import ds_values, values_util
from safevars.errors import UnsupportedStrategyError

__all__ = [
    "SUPPORTED_STRATEGIES",
    "check_strategy",
    "merge_context",
    "merged_update",
    "merged_write",
]

SUPPORTED_STRATEGIES = (
    "the default strategy (no tf.distribute)",
    "OneDeviceStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy (TF2, with ClusterCoordinator)",
)

_SUPPORTED_CLASS_NAMES = frozenset(
    {
        "_DefaultDistributionStrategy",
        "OneDeviceStrategy",
        "OneDeviceStrategyV1",
        "MirroredStrategy",
        "CollectiveAllReduceStrategy",
        "_CollectiveAllReduceStrategyExperimental",
        "ParameterServerStrategyV2",
    }
)


def _supported(strategy: tf.distribute.Strategy) -> bool:
    return any(cls.__name__ in _SUPPORTED_CLASS_NAMES for cls in type(strategy).__mro__)


def check_strategy(strategy: tf.distribute.Strategy | None = None) -> tf.distribute.Strategy:
    """Returns the current (or given) strategy, or raises if safevars does not support it.

    Raises:
      UnsupportedStrategyError: naming the strategy and the supported ones.
    """
    strategy = strategy if strategy is not None else tf.distribute.get_strategy()
    if not _supported(strategy):
        raise UnsupportedStrategyError(
            f"safevars does not support {type(strategy).__name__}: its guarantees are "
            f"tested only under {', '.join(SUPPORTED_STRATEGIES)}. Use one of those "
            "instead of relying on an untested path."
        )
    return strategy


def is_parameter_server(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether ``strategy`` is a TF2 ``ParameterServerStrategy``."""
    return strategy is not None and any(
        cls.__name__ == "ParameterServerStrategyV2" for cls in type(strategy).__mro__
    )


def on_parameter_server(device: str | None) -> bool:
    """Whether ``device`` (a device string, possibly empty) is on a ``ps`` task."""
    return bool(device) and _on_ps_job(device)


@functools.lru_cache(maxsize=1024)
def _on_ps_job(device: str) -> bool:  # (parsed once per string: eager sections ask)
    return tf.DeviceSpec.from_string(device).job == "ps"


def merge_context(variable: Any) -> tf.distribute.ReplicaContext | None:
    """The replica context if a write of ``variable`` must be merged across replicas first.

    ``None`` in cross-replica context, without a strategy, and for variables that are not
    mirrored (a parameter-server variable is written in place, under its lock).
    """
    if not isinstance(variable, ds_values.DistributedVariable):
        return None  # Checked first: it is the cheap test on every eager write.
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return None
    strategy = check_strategy()
    if not strategy.extended._use_merge_call():  # XLA-compiled replica functions on GPUs.
        raise UnsupportedStrategyError(
            "safevars cannot lock a mirrored variable inside a replica function compiled "
            "with XLA on GPUs (TensorFlow skips merge_call there). Write it outside "
            "strategy.run, or drop jit_compile for the replica function."
        )
    return tf.distribute.get_replica_context()


def merged_write(
    ctx: tf.distribute.ReplicaContext,
    variable: Any,
    write: Callable[[Any], Any],
    value: Any,
) -> Any:
    """Aggregates ``value`` across replicas as the variable's aggregation says, then
    calls ``write(aggregated)`` once, in cross-replica context.

    With aggregation ``NONE`` nothing is aggregated: TensorFlow writes each replica's
    own copy with that replica's value, without merging. ``write`` then gets the
    replicas' values as they are (a ``PerReplica``, or the one value every replica
    passed) and must write each copy its own replica's value, as a cross-replica write
    of the variable does (``strategy.extended.update`` hands each copy its replica's
    value): the copies end as TensorFlow leaves them, written by one locked write.
    """
    aggregation = variable.aggregation
    if aggregation == tf.VariableAggregation.NONE:
        return ctx.merge_call(lambda _, per_replica: write(per_replica), args=(value,))

    def merge_fn(strategy: tf.distribute.Strategy, per_replica: Any) -> Any:
        aggregated = values_util.apply_aggregation(strategy, per_replica, aggregation, variable)
        return write(aggregated)

    return ctx.merge_call(merge_fn, args=(value,))


def merged_update(
    ctx: tf.distribute.ReplicaContext,
    apply_all: Callable[[list[Callable[[Any], Any]]], list[Any]],
    fn: Callable[[Any], Any],
) -> Any:
    """Gathers every replica's ``fn`` and runs ``apply_all(fns)`` once, in cross-replica
    context; each replica gets back the value its own ``fn`` wrote."""

    def merge_fn(strategy: tf.distribute.Strategy, per_replica_fn: Any) -> Any:
        if isinstance(per_replica_fn, ds_values.PerReplica):
            fns = list(per_replica_fn.values)
        else:
            fns = [per_replica_fn] * strategy.num_replicas_in_sync
        results = apply_all(fns)
        return ds_values.PerReplica(tuple(results))

    return ctx.merge_call(merge_fn, args=(fn,))
