"""What GradientAccumulator tests share: the state a refused call must leave unchanged,
integers from tensors, and contributions whose float32 sum depends on the order."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from safevars.accumulator import GradientAccumulator


def state(acc: GradientAccumulator) -> tuple:
    """Everything a refused call must leave unchanged: the live state and statistics.

    Deterministic accumulators only read the blocks (one per contribution) below the
    pending count.
    """
    stats = acc.statistics()
    live = acc._rows().numpy() if acc.deterministic else acc._state.numpy()
    if acc.deterministic:
        layout = acc._layout
        live = live.reshape(-1, layout.chunks * layout.width)[: stats.pending]
    return (live.tobytes(), stats)


def as_int(x) -> int:
    return int(x.numpy()) if isinstance(x, tf.Tensor) else int(x)


def hard_contributions(count: int, size: int, seed: int) -> list[np.ndarray]:
    """float32 gradients spanning 12 decades, so float32 sums depend on the order."""
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(size) * 10.0 ** rng.uniform(-6, 6, size)).astype(np.float32)
        for _ in range(count)
    ]
