"""SafeOptimizer under ``tf.distribute``: which strategies, and how replicas meet.

* The supported strategies (anything else is refused naming them), and the check that
  the optimizer is called under the strategy that created its state.
* Inside ``strategy.run`` the gradients are summed across replicas (and workers), as
  Keras does, and the section runs once, in cross-replica context
  (:meth:`StrategiesPart._safevars_merge_into_cross_replica`).
* Keras' update reached from there calls its merge function directly
  (:func:`direct_merge_calls`).

The parameter-server coordinator's path is in ``coordinator.py``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from safevars._tf_internal import distribute_lib
from safevars.distribute import is_parameter_server
from safevars.errors import InvalidArgumentError, UnsupportedStrategyError
from safevars.optimizer.runtime import OptimizerPart, _Step

SUPPORTED_STRATEGIES = (
    tf.distribute.OneDeviceStrategy,
    tf.distribute.MirroredStrategy,
    tf.distribute.MultiWorkerMirroredStrategy,
    tf.distribute.experimental.ParameterServerStrategy,
)
SUPPORTED_NAMES = (
    "no strategy (the default), tf.distribute.OneDeviceStrategy, "
    "tf.distribute.MirroredStrategy (one machine, any number of devices), "
    "tf.distribute.MultiWorkerMirroredStrategy (processes configured by TF_CONFIG) and "
    "tf.distribute.experimental.ParameterServerStrategy (TF2, driven by "
    "ClusterCoordinator)"
)


def current_strategy() -> tf.distribute.Strategy | None:
    """The strategy in scope, or ``None`` for the default one; refuses unsupported ones."""
    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, SUPPORTED_STRATEGIES):
        raise UnsupportedStrategyError(
            f"SafeOptimizer does not support {type(strategy).__name__}. Supported: "
            f"{SUPPORTED_NAMES}."
        )
    return strategy


def local(value: Any) -> Any:
    """The first replica's component of a distributed value (values that are equal)."""
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return value


def oldest(value: Any) -> Any:
    """The smallest replica's version of a distributed version (largest staleness)."""
    if isinstance(value, tf.distribute.DistributedValues):
        parts = tf.distribute.get_strategy().experimental_local_results(value)
        return tf.reduce_min(tf.stack([tf.cast(p, tf.int64) for p in parts]))
    return value


# Under MirroredStrategy the section runs in cross-replica context (in the merge_call
# every Keras optimizer makes for its update anyway), so that one section covers the
# update of every replica's copy. Keras' TensorFlow optimizer reaches its update through
# ``maybe_merge_call``, which assumes a replica context and fails in cross-replica
# context, where no merge is needed. While the optimizer's own update runs from
# cross-replica context, the calling thread tells the strategy that merge calls are not
# needed, so ``maybe_merge_call`` calls its function directly. Other threads are not
# affected.

_direct = threading.local()
_install_lock = threading.Lock()


def _allow_direct_merge_calls(strategy: tf.distribute.Strategy) -> None:
    extended = strategy.extended
    if getattr(extended, "_safevars_direct_merge", False):
        return
    with _install_lock:
        if getattr(extended, "_safevars_direct_merge", False):
            return
        original = extended._use_merge_call

        def _use_merge_call() -> bool:
            if getattr(_direct, "depth", 0):
                return False
            return original()

        extended._use_merge_call = _use_merge_call
        extended._safevars_direct_merge = True


@contextlib.contextmanager
def direct_merge_calls(strategy: tf.distribute.Strategy | None) -> Iterator[None]:
    """Inside: ``maybe_merge_call`` of ``strategy`` calls its function directly."""
    if strategy is None:
        yield
        return
    _allow_direct_merge_calls(strategy)
    _direct.depth = getattr(_direct, "depth", 0) + 1
    try:
        yield
    finally:
        _direct.depth -= 1


class StrategiesPart(OptimizerPart):
    """SafeOptimizer's part that checks the strategy and merges replicas."""

    def _safevars_check_created_under(self, strategy: tf.distribute.Strategy | None) -> None:
        """Refuses a call under a strategy other than the one that created the state.

        The slots, ``iterations`` and counters belong to the strategy current when they
        were created; used under another they would be variables that strategy does not
        own (Keras fails deep inside with "Must not nest tf.distribute.Strategy scopes").
        """
        if strategy is None:
            return
        owners = (
            (getattr(self, "_distribution_strategy", None), "the optimizer"),
            (self._safevars.strategy, "SafeOptimizer(...) was called, and its counters"),
        )
        for created, what in owners:
            if created is None or created is strategy:
                continue
            under = (
                "outside any strategy scope"
                if isinstance(created, distribute_lib._DefaultDistributionStrategy)
                else f"under another {type(created).__name__}"
            )
            raise InvalidArgumentError(
                f"SafeOptimizer is called under {type(strategy).__name__} but {what} was "
                f"created {under}, so its state (slots, iterations, counters) does not "
                "belong to this strategy. Create the optimizer and make it safe inside "
                "`with strategy.scope():` (the scope the model's variables are created in)."
            )

    def _safevars_on_parameter_servers(self) -> bool:
        return is_parameter_server(getattr(self, "_distribution_strategy", None))

    def _safevars_merge_into_cross_replica(self, step: _Step) -> None:
        """Sums the gradients over replicas (as Keras does), then runs the section once."""
        context = tf.distribute.get_replica_context()
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, step.grads)
        packed: Any = None
        kind = None
        if step.versions is not None:
            kind, value = step.versions
            if kind == "global":
                packed = tf.cast(value, tf.int64)
            else:
                packed = [None if v is None else tf.cast(v, tf.int64) for v in value]

        def merged(strategy: tf.distribute.Strategy, grads: Any, versions: Any) -> None:
            grads = [local(g) for g in grads]
            if versions is not None:
                if kind == "global":
                    versions = ("global", oldest(versions))
                else:
                    versions = ("each", [None if v is None else oldest(v) for v in versions])
            self._safevars_section(step._replace(grads=grads, versions=versions), strategy)

        context.merge_call(merged, args=(reduced, packed))
