"""Runs safevars on an in-process ParameterServerStrategy cluster; prints one JSON line.

Usage: python ps_cluster.py [--workers 3] [--steps 300]
Run it in its own process: in-process servers cannot be shut down.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import safevars  # noqa: E402
from safevars.local_cluster import start_in_process_cluster  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, 1)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        plain = tf.Variable(0.0)
        counter = safevars.SafeVariable(0.0)
        a = safevars.SafeVariable(100.0)
        b = safevars.SafeVariable(0.0)

    @tf.function
    def racy_step():
        plain.assign(plain.read_value() + 1.0)

    @tf.function
    def safe_step():
        counter.update(lambda x: x + 1.0)

    @tf.function
    def move_step():
        def move():
            a.assign(a.read_value() - 1.0)
            b.assign(b.read_value() + 1.0)

        safevars.transaction([a, b], move)
        sa, sb = safevars.snapshot([a, b])
        return sa.value + sb.value, sa.version - sb.version

    for _ in range(args.steps):
        coordinator.schedule(racy_step)
        coordinator.schedule(safe_step)
    sums = [coordinator.schedule(move_step) for _ in range(args.steps // 3)]
    coordinator.join()
    observed = [r.fetch() for r in sums]
    try:  # An eager write from the coordinator would contend for the PS mutex: refused.
        counter.assign_add(1.0)
        eager_write = "accepted"
    except safevars.UnsupportedStrategyError:
        eager_write = "refused"

    @tf.function
    def coordinator_write():
        return counter.assign_add(1.0)

    coordinator_write()  # the same write inside a tf.function works from the coordinator
    print(
        json.dumps(
            {
                "steps": args.steps,
                "plain": float(plain.numpy()),
                "eager_write": eager_write,
                "safe": float(counter.numpy()) - 1.0,
                "safe_version": int(counter.version) - 1,
                "a": float(a.numpy()),
                "b": float(b.numpy()),
                "a_version": int(a.version),
                "b_version": int(b.version),
                "snapshot_sums": sorted({float(s) for s, _ in observed}),
                "snapshot_version_gaps": sorted({int(d) for _, d in observed}),
                "device": counter.device,
                "lock_device": counter.guard.cs._handle.device,
            }
        )
    )


if __name__ == "__main__":
    main()
