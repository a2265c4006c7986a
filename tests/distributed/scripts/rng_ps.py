"""ReplicaRNG on an in-process ParameterServerStrategy cluster; prints one JSON line.

Usage: python rng_ps.py --seed SEED [--other-seed SEED] [--workers 3] [--ps 1] [--steps 24]
Run it in its own process: in-process servers cannot be shut down.

Arrays are printed as the hex of their bytes, so a test can compare them bitwise with a
reference computed in another process.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from script_common import error_of, hexes  # noqa: E402

from safevars.local_cluster import start_in_process_cluster  # noqa: E402
from safevars.rng import ReplicaRNG  # noqa: E402


def step_draws(rng: ReplicaRNG) -> list[tf.Tensor]:
    """The fixed sequence of draws of one step (tests/rng/test_distributed.py mirrors it)."""
    return [rng.normal([4]), rng.uniform_int([3], 0, 1_000_000), rng.make_seed()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--other-seed", type=int, default=None)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    other_seed = args.other_seed if args.other_seed is not None else args.seed + 1

    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, args.ps)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    outside = ReplicaRNG(args.seed)  # Not in the scope: refused in scheduled functions.
    with strategy.scope():
        rng = ReplicaRNG(args.seed)
        other = ReplicaRNG(other_seed)

    worker_index = tf.distribute.coordinator.experimental_get_current_worker_index

    @tf.function
    def once_per_worker():
        return worker_index(), step_draws(rng), other.normal([4])

    @tf.function
    def step(step_number):
        # Replica context, in a tf.cond branch (a nested graph).
        in_replica = strategy.run(
            lambda: tf.cond(step_number >= 0, lambda: rng.normal([4]), lambda: tf.zeros([4]))
        )
        own = step_draws(rng)  # Cross-replica context of the scheduled function.
        # Keyed by the step, not the worker: the same whoever runs the step.
        keyed = tf.random.stateless_normal([4], seed=rng.element_seed(step_number))
        return worker_index(), [in_replica] + own, keyed

    # The coordinator's (private in TF 2.21) create_per_worker_resources runs a function
    # once on every worker: each worker draws for sure, whatever the coordinator does with
    # the scheduled steps. Fetched before scheduling, so these are each stream's first
    # draws.
    per_worker = coordinator._create_per_worker_resources(once_per_worker)
    first = [value.fetch() for value in per_worker._values]
    results = [
        coordinator.schedule(step, args=(tf.constant(i, tf.int64),)) for i in range(args.steps)
    ]
    coordinator.join()
    steps = []
    for i, result in enumerate(results):
        worker, draws, keyed = result.fetch()
        steps.append(
            {"step": i, "worker": int(worker), "draws": hexes(draws), "keyed": hexes([keyed])[0]}
        )

    # The streams live on the parameter server: the coordinator checkpoints them, and a
    # restore rewinds every worker's stream.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tf.train.Checkpoint(rng=rng)
        path = checkpoint.write(os.path.join(tmp, "rng"))
        after_save = [hexes([rng.for_worker(w).normal([3])]) for w in range(args.workers)]
        checkpoint.read(path).assert_consumed()
        after_restore = [hexes([rng.for_worker(w).normal([3])]) for w in range(args.workers)]

    # autograph=False: AutoGraph turns a SafeVarsError raised while tracing converted
    # code into a StagingError (it only re-raises builtin-constructible types).
    @tf.function(autograph=False)
    def outside_step():
        return outside.normal([2])

    errors = {
        "eager_on_coordinator": error_of(lambda: rng.normal([2])),
        "eager_in_scope": error_of(lambda: strategy.run(lambda: rng.normal([2]))),
        "unscheduled_function": error_of(tf.function(lambda: rng.normal([2]), autograph=False)),
        "for_replica": error_of(lambda: rng.for_replica(0)),
        "for_worker_out_of_range": error_of(lambda: rng.for_worker(args.workers)),
        # Last: a failed schedule leaves the coordinator's scheduling flag set.
        "rng_created_outside_scope": error_of(lambda: coordinator.schedule(outside_step)),
    }
    print(
        json.dumps(
            {
                "seed": args.seed,
                "other_seed": other_seed,
                "workers": args.workers,
                "num_workers": rng.num_workers,
                "num_replicas": rng.num_replicas,
                "identity": list(rng.worker),
                "repr": repr(rng),
                "devices": [s.state.device for s in rng.streams],
                "keys": [s.key for s in rng.streams],
                "stream_workers": [list(s.worker) for s in rng.streams],
                "per_worker": sorted(
                    (
                        {"worker": int(w), "draws": hexes(d), "other": hexes([o])[0]}
                        for w, d, o in first
                    ),
                    key=lambda item: item["worker"],
                ),
                "steps": steps,
                "checkpoint_continues": after_save == after_restore,
                "errors": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
