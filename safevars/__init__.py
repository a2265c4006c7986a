"""safevars: TensorFlow variables that are safe to share between threads, graphs and replicas."""

from safevars.accumulator import AccumulatorStatistics, GradientAccumulator
from safevars.audit import AuditReport, Race, audit
from safevars.errors import (
    AccumulatorTimeoutError,
    DTypeMismatchError,
    InvalidArgumentError,
    LockOrderError,
    LockReentryError,
    NonFiniteGradientError,
    NotCallableError,
    RaceDetectedError,
    SafeVarsError,
    ShapeMismatchError,
    StaleGradientError,
    UnsupportedStrategyError,
)
from safevars.locking import LockStatistics
from safevars.optimizer import OptimizerStatistics, SafeOptimizer
from safevars.rng import ReplicaRNG, ReplicaStream
from safevars.snapshot import Snapshot, snapshot
from safevars.transaction import locked, transaction
from safevars.variable import SafeVariable, wrap

__version__ = "0.1.0"

__all__ = [
    "AccumulatorStatistics",
    "AuditReport",
    "AccumulatorTimeoutError",
    "DTypeMismatchError",
    "GradientAccumulator",
    "InvalidArgumentError",
    "LockOrderError",
    "LockReentryError",
    "LockStatistics",
    "NonFiniteGradientError",
    "NotCallableError",
    "OptimizerStatistics",
    "Race",
    "RaceDetectedError",
    "ReplicaRNG",
    "ReplicaStream",
    "SafeVarsError",
    "SafeOptimizer",
    "SafeVariable",
    "ShapeMismatchError",
    "Snapshot",
    "StaleGradientError",
    "UnsupportedStrategyError",
    "__version__",
    "audit",
    "locked",
    "snapshot",
    "transaction",
    "wrap",
]
