"""Argument checks of :mod:`safevars.rng` beyond :mod:`safevars._validation`'s.

The seed, the worker identity, a floating-point dtype and Python bounds of a uniform
draw. Each raises :class:`~safevars.errors.InvalidArgumentError` before anything is
drawn or created. ``_check_seed`` is also ``safevars.data.ShardedInput``'s seed check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from safevars._validation import check_int
from safevars.errors import InvalidArgumentError


def _check_seed(seed: Any) -> int:
    return check_int(
        seed,
        "seed",
        0,
        fix="Pass a non-negative Python int, for example ReplicaRNG(seed=1234).",
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
    return worker[0], check_int(worker[1], "worker task_id", 0, fix=fix)


def _float_dtype(dtype: Any, argument: str = "dtype") -> tf.DType:
    dtype = tf.as_dtype(dtype)
    if not dtype.is_floating:
        raise InvalidArgumentError(
            f"{argument} must be a floating-point dtype, got {dtype.name}. Use "
            "uniform_int()/integers() for integers."
        )
    return dtype


def _check_bounds(minval: Any, maxval: Any) -> None:
    python = (int, float, np.number)
    if isinstance(minval, python) and isinstance(maxval, python) and not minval < maxval:
        raise InvalidArgumentError(
            f"minval must be < maxval, got minval={minval!r}, maxval={maxval!r}."
        )
