"""safevars: TensorFlow variables that are safe to share between threads, graphs and replicas.

Layers, bottom to top. A module imports only modules of its own package (without a
cycle) or of a lower layer; the units of one layer do not import each other; where a
lower layer must call back up, it offers a registered hook, named as such.
``tests/test_layers.py`` reads this list and checks every import against it (module
level, inside functions and under ``TYPE_CHECKING``):

1. ``errors``: the error classes.
2. ``_tf_internal``: the one door to private TensorFlow and Keras APIs.
3. ``_validation``, ``_autograph``, ``distribute``, ``local_cluster``: argument checks,
   AutoGraph registration, what safevars knows of ``tf.distribute``, local clusters.
4. ``staleness``: the staleness policy shared by the accumulator and the optimizer.
5. ``locking``: eager locks, guards, versions, the savers' locks.
6. ``sections``: graph critical sections (mutex ops), gates, lock coarsening, step
   spans, XLA-compiled calls.
7. ``variable``: ``SafeVariable``, ``wrap`` and SafeVariable's snapshots.
8. ``snapshot``, ``transaction``, ``creator_scope``, ``exactly_once``: the public entry
   points on variables.
9. ``rng``, ``accumulator``, ``audit``: features.
10. ``data``, ``optimizer``: features built on those (``data`` uses ``rng``,
    ``optimizer`` uses ``accumulator``).
11. ``__init__`` (this module): re-exports only.
"""

from safevars import exactly_once
from safevars.accumulator import AccumulatorStatistics, GradientAccumulator
from safevars.audit import AuditReport, Race, audit
from safevars.creator_scope import (
    UnprotectedVariable,
    is_protected,
    protect,
    scope,
    unprotected_variables,
)
from safevars.data import ShardedInput
from safevars.errors import (
    AccumulatorFullError,
    AccumulatorTimeoutError,
    DTypeMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    LockOrderError,
    LockReentryError,
    LockTimeoutError,
    NonFiniteGradientError,
    NotCallableError,
    NotProtectedError,
    RaceDetectedError,
    SafeVarsError,
    ShapeMismatchError,
    StaleGradientError,
    UnsupportedStrategyError,
)
from safevars.locking import HeldLock, LockStatistics, held_locks
from safevars.optimizer import OptimizerStatistics, SafeOptimizer
from safevars.rng import ReplicaRNG, ReplicaStream
from safevars.snapshot import Snapshot, snapshot
from safevars.transaction import locked, transaction
from safevars.variable import SafeVariable, wrap

__version__ = "0.2.0"

__all__ = [
    "AccumulatorFullError",
    "AccumulatorStatistics",
    "AccumulatorTimeoutError",
    "AuditReport",
    "DTypeMismatchError",
    "GradientAccumulator",
    "HeldLock",
    "IndexOutOfRangeError",
    "InvalidArgumentError",
    "LockOrderError",
    "LockReentryError",
    "LockStatistics",
    "LockTimeoutError",
    "NonFiniteGradientError",
    "NotCallableError",
    "NotProtectedError",
    "OptimizerStatistics",
    "Race",
    "RaceDetectedError",
    "ReplicaRNG",
    "ReplicaStream",
    "SafeOptimizer",
    "SafeVariable",
    "SafeVarsError",
    "ShapeMismatchError",
    "ShardedInput",
    "Snapshot",
    "StaleGradientError",
    "UnprotectedVariable",
    "UnsupportedStrategyError",
    "__version__",
    "audit",
    "exactly_once",
    "held_locks",
    "is_protected",
    "locked",
    "protect",
    "scope",
    "snapshot",
    "transaction",
    "unprotected_variables",
    "wrap",
]
