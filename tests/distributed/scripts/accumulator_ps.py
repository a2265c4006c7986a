"""GradientAccumulator on an in-process ParameterServerStrategy cluster; one JSON line.

Usage: python accumulator_ps.py --seed SEED [--workers 3] [--ps 2] [--count 48] [--rounds 40]
Run it in its own process: in-process servers cannot be shut down.

Workers add concurrently through ``ClusterCoordinator.schedule`` and through one loop per
worker (run on every worker at once), while the coordinator and the workers take.
Arrays are printed as the hex of their bytes, so a test can compare them bitwise with a
reference computed in another process.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from safevars.accumulator import GradientAccumulator  # noqa: E402
from safevars.local_cluster import start_in_process_cluster  # noqa: E402

SIZE = 6  # Elements per contribution (two variables: [2, 2] and [2]).


def hard_contributions(count: int, seed: int) -> np.ndarray:
    """float32 rows spanning 12 decades, so float32 sums depend on the order.

    tests/accumulator/test_distributed.py recomputes them from the same seed.
    """
    rng = np.random.default_rng(seed)
    return np.stack(
        [
            (rng.standard_normal(SIZE) * 10.0 ** rng.uniform(-6, 6, SIZE)).astype(np.float32)
            for _ in range(count)
        ]
    )


def counted_contributions(count: int) -> np.ndarray:
    """Integer-valued rows (exact in any sum); element 0 counts contributions."""
    rows = np.arange(count * SIZE, dtype=np.float32).reshape(count, SIZE) % 97.0
    rows[:, 0] = 1.0
    return rows


def main() -> None:
    # Run as a script (tests/distributed/scripts on sys.path); the test module imports this
    # file as tests.distributed.scripts.accumulator_ps for the contributions above only.
    from script_common import error_of, hexes, parse, parser

    arguments = parser(seed=True)
    arguments.add_argument("--workers", type=int, default=3)
    arguments.add_argument("--ps", type=int, default=2)
    arguments.add_argument("--count", type=int, default=48)
    arguments.add_argument("--rounds", type=int, default=40)
    args = parse(arguments)
    workers, count, rounds = args.workers, args.count, args.rounds
    assert count % workers == 0

    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(workers, args.ps)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    worker_index = tf.distribute.coordinator.experimental_get_current_worker_index
    local = tf.Variable(tf.zeros([SIZE]))  # On the coordinator: outside the scope.
    outside = GradientAccumulator([local])
    with strategy.scope():
        tf.Variable(0.0)  # Round robin: the model's first variable lands on ps:1.
        kernel = tf.Variable(tf.zeros([2, 2]))
        bias = tf.Variable(tf.zeros([2]))
        params = [kernel, bias]
        exact = GradientAccumulator(params)  # deterministic=True, mean
        fast = GradientAccumulator(params, reduction="sum", deterministic=False)
        counted = GradientAccumulator(params, reduction="sum")
        ready = GradientAccumulator(params, reduction="sum", num_required=4)
        plain = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([2]))]

    def split(row: tf.Tensor) -> list[tf.Tensor]:
        return [tf.reshape(row[:4], [2, 2]), row[4:]]

    hard = tf.constant(hard_contributions(count, args.seed))
    ones = tf.constant(counted_contributions(workers * rounds))

    # -- 1. Scheduled adds, one contribution each, in two shuffled orders -----------------

    @tf.function
    def add_one(i):
        return worker_index(), exact.add(split(tf.gather(hard, i)))

    orders, exact_takes, scheduled_workers, scheduled_added = [], [], [], []
    for run in range(2):
        order = list(range(count))
        random.Random(args.seed + run).shuffle(order)
        orders.append(order)
        results = [coordinator.schedule(add_one, args=(tf.constant(i),)) for i in order]
        coordinator.join()
        fetched = [r.fetch() for r in results]
        scheduled_workers.append(sorted({int(w) for w, _ in fetched}))
        scheduled_added.append(sum(int(n) for _, n in fetched))
        exact_statistics = exact.statistics()
        exact_takes.append(hexes(exact.take()))

    # -- 2. One loop per worker, all workers at once --------------------------------------
    # Contribution w + workers * j is added by worker w; reversed on the second run.

    def make_loop(reverse: bool):
        @tf.function
        def loop():
            w = tf.cast(worker_index(), tf.int32)
            for j in tf.range(count // workers):
                k = count // workers - 1 - j if reverse else j
                exact.add(split(tf.gather(hard, w + workers * k)))
            return w

        return loop

    loop_takes, loop_workers = [], []
    for reverse in (False, True):
        per_worker = coordinator._create_per_worker_resources(make_loop(reverse))
        loop_workers.append(sorted(int(v.fetch()) for v in per_worker._values))
        loop_takes.append(hexes(exact.take()))

    # -- 3. Contention: plain read-then-write against the accumulators --------------------
    # Every worker adds `rounds` integer-valued contributions at once; the coordinator
    # takes from `counted` meanwhile, and the `ready` accumulator is taken by the workers.

    @tf.function
    def contend():
        w = tf.cast(worker_index(), tf.int32)
        taken = tf.zeros([SIZE])
        for j in tf.range(rounds):
            row = tf.gather(ones, w * rounds + j)
            grads = split(row)
            for v, g in zip(plain, grads):  # Keras-style accumulation: read, add, assign.
                v.assign(v.read_value() + g)
            fast.add(grads)
            counted.add(grads)
            ready.add(grads)
            is_ready, got = ready.take_if_ready()
            flat = tf.concat([tf.reshape(got[0], [-1]), got[1]], 0)
            taken += tf.where(is_ready, flat, tf.zeros_like(flat))
        return taken

    per_worker = coordinator._create_per_worker_resources(contend)
    fetched: list[np.ndarray] = []
    done = threading.Event()

    def fetch_all() -> None:
        try:
            fetched.extend(v.fetch() for v in per_worker._values)
        finally:
            done.set()

    fetcher = threading.Thread(target=fetch_all, daemon=True)
    fetcher.start()
    coordinator_takes = []
    while True:  # Take from the coordinator while the workers add.
        finished = done.is_set()
        got = counted.take()
        coordinator_takes.append(np.concatenate([got[0].numpy().ravel(), got[1].numpy()]))
        if finished:
            break
    # Everything is taken now; one more take finds nothing (and is not counted).
    got = counted.take()
    coordinator_takes.append(np.concatenate([got[0].numpy().ravel(), got[1].numpy()]))
    fetcher.join()
    assert len(fetched) == workers, "a worker's loop failed"
    worker_taken = np.sum(fetched, axis=0)
    # Fewer than num_required may be left: top up with zero rows (they add nothing).
    fillers = 0
    while True:
        is_ready, got = ready.take_if_ready()
        if is_ready:
            break
        ready.add([tf.zeros([2, 2]), tf.zeros([2])])
        fillers += 1
    ready_rest = np.concatenate([got[0].numpy().ravel(), got[1].numpy()])
    counted_statistics = counted.statistics()
    fast_total = fast.take()
    expected = counted_contributions(workers * rounds).sum(axis=0)
    plain_total = np.concatenate([plain[0].numpy().ravel(), plain[1].numpy()])

    # -- 4. Replica context (strategy.run) and the coordinator, checkpoint ----------------

    @tf.function
    def add_in_replica(i):
        return strategy.run(lambda: counted.add(split(tf.gather(ones, i))))

    in_replica = [coordinator.schedule(add_in_replica, args=(tf.constant(i),)) for i in range(3)]
    coordinator.join()
    counted.add(split(ones[0]))  # Eagerly on the coordinator.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = tf.train.Checkpoint(accumulator=counted)
        path = checkpoint.write(os.path.join(tmp, "acc"))
        counted.add(split(ones[1]))
        pending_before_restore = counted.count
        checkpoint.read(path).assert_consumed()
        pending_after_restore = counted.count
        restored = counted.take()

    # -- 4b. add_and_take: scheduled on every worker at once, and on the coordinator -----
    # Each scheduled call adds one contribution and adds-and-takes the next: at most one
    # add per worker and one more are pending, so max_pending=4 never refuses (and with
    # --blocks every pending block is kept by reference: the direct path, on the PS).

    with strategy.scope():
        capped = GradientAccumulator(params, reduction="sum", max_pending=4)

    @tf.function
    def add_then_take(i):
        capped.add(split(tf.gather(ones, 2 * i)))
        return capped.add_and_take(split(tf.gather(ones, 2 * i + 1)))

    pairs = workers * 4
    pair_results = [
        coordinator.schedule(add_then_take, args=(tf.constant(i),)) for i in range(pairs)
    ]
    coordinator.join()
    pair_taken = [np.concatenate([np.ravel(x) for x in r.fetch()]) for r in pair_results]
    capped.add(split(ones[0]))
    coordinator_pair = capped.add_and_take(split(ones[1]))  # the PS's section, eagerly
    capped_rest = capped.take()

    # -- 5. Refused uses (last: a failed schedule leaves the coordinator's flag set) ------

    @tf.function
    def add_outside():
        return outside.add([tf.zeros([SIZE])])

    def add_outside_eagerly_in_scope() -> None:
        with strategy.scope():
            outside.add([tf.zeros([SIZE])])

    errors = {
        "eager_in_scope": error_of(add_outside_eagerly_in_scope),
        "outside_statistics": list(outside.statistics()),
        "scheduled": error_of(lambda: coordinator.schedule(add_outside)),
    }

    print(
        json.dumps(
            {
                "workers": workers,
                "count": count,
                "devices": {
                    "kernel": kernel.device,
                    "exact": exact._state.device,
                    "exact_lock": exact._guard.cs._handle.device,
                },
                "orders": orders,
                "scheduled_workers": scheduled_workers,
                "scheduled_added": scheduled_added,
                "exact_statistics": list(exact_statistics),
                "exact_takes": exact_takes,
                "loop_workers": loop_workers,
                "loop_takes": loop_takes,
                "contention": {
                    "contributions": workers * rounds,
                    "expected": expected.tolist(),
                    "plain": plain_total.tolist(),
                    "fast": np.concatenate(
                        [fast_total[0].numpy().ravel(), fast_total[1].numpy()]
                    ).tolist(),
                    "fast_statistics": list(fast.statistics()),
                    "coordinator_takes": len(coordinator_takes),
                    "last_take": coordinator_takes[-1].tolist(),
                    "coordinator_taken": np.sum(coordinator_takes, axis=0).tolist(),
                    "counted_statistics": list(counted_statistics),
                    "worker_taken": worker_taken.tolist(),
                    "ready_rest": ready_rest.tolist(),
                    "ready_statistics": list(ready.statistics()),
                    "ready_fillers": fillers,
                },
                "in_replica": [int(r.fetch()) for r in in_replica],
                "checkpoint": {
                    "pending_before_restore": pending_before_restore,
                    "pending_after_restore": pending_after_restore,
                    "restored": np.concatenate(
                        [restored[0].numpy().ravel(), restored[1].numpy()]
                    ).tolist(),
                },
                "errors": errors,
                "add_and_take": {
                    "pairs": pairs,
                    "scheduled_taken": np.sum(pair_taken, axis=0).tolist(),
                    "coordinator": np.concatenate(
                        [coordinator_pair[0].numpy().ravel(), coordinator_pair[1].numpy()]
                    ).tolist(),
                    "rest": np.concatenate(
                        [capped_rest[0].numpy().ravel(), capped_rest[1].numpy()]
                    ).tolist(),
                    "statistics": list(capped.statistics()),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
