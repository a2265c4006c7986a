"""safevars: TensorFlow variables that are safe to share between threads, graphs and replicas."""

from safevars import exactly_once
from safevars.accumulator import AccumulatorStatistics, GradientAccumulator
from safevars.audit import AuditReport, Race, audit
from safevars.creator_scope import scope
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

__version__ = "0.1.0"

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
    "UnsupportedStrategyError",
    "__version__",
    "audit",
    "exactly_once",
    "held_locks",
    "locked",
    "scope",
    "snapshot",
    "transaction",
    "wrap",
]
