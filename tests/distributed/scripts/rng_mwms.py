"""ReplicaRNG on one worker of a MultiWorkerMirroredStrategy cluster; prints one JSON line.

Usage: python rng_mwms.py WORKER_INDEX PORT0,PORT1[,...] --seed SEED [--steps 3]
Every worker gets the same ports list; TF_CONFIG is built from it on 127.0.0.1.

Arrays are printed as the hex of their bytes, so a test can compare them bitwise with a
reference computed in another process.
"""

from __future__ import annotations

import json

from loopback import set_tf_config  # same directory
from script_common import parse, parser


def main() -> None:
    arguments = parser(worker=True, seed=True)
    arguments.add_argument("--steps", type=int, default=3)
    args = parse(arguments)
    set_tf_config(args.index, args.ports)
    import numpy as np
    import tensorflow as tf

    from safevars.rng import ReplicaRNG

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        rng = ReplicaRNG(args.seed)

    @tf.function
    def step():
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            # The same fixed sequence as tests/rng/test_distributed.py's reference.
            draws = [rng.normal([4]), rng.uniform_int([3], 0, 1_000_000), rng.make_seed()]
            return replica, draws, tf.constant(rng.seed_for("augment"), tf.int64)

        return strategy.run(replica_fn)

    local: dict[int, dict] = {}
    for _ in range(args.steps):
        replicas, draws, seeds = step()
        replicas = strategy.experimental_local_results(replicas)
        seeds = strategy.experimental_local_results(seeds)
        per_kind = [strategy.experimental_local_results(d) for d in draws]
        for i, replica in enumerate(replicas):
            entry = local.setdefault(int(replica), {"draws": [], "seed_for": int(seeds[i])})
            entry["draws"].append([np.asarray(kind[i]).tobytes().hex() for kind in per_kind])
    print(
        json.dumps(
            {
                "index": args.index,
                "worker": list(rng.worker),
                "num_replicas": rng.num_replicas,
                "replicas_in_sync": strategy.num_replicas_in_sync,
                "keys": [s.key for s in rng.streams],
                "moved": [s.state.numpy()[:2].tolist() != [0, 0] for s in rng.streams],
                "local": {str(r): entry for r, entry in sorted(local.items())},
            }
        )
    )


if __name__ == "__main__":
    main()
