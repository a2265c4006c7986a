"""ShardedInput under ParameterServerStrategy with a worker that is killed mid-step.

Usage: python data_ps.py --seed SEED --other-seed SEED --out DIR [--size 50] [--batch 2]
(``--serve SPEC JOB INDEX`` runs one server: used for worker 1.)

The cluster is 3 workers and 1 parameter server on 127.0.0.1. The parameter server and
workers 0 and 2 run in this process (as ``safevars.local_cluster`` does); worker 1 runs
in a subprocess so that it can be killed and restarted. Prints one JSON line.

Phases:

1. Steps until every shard is in the middle of epoch 0; checkpoint.
2. A step on worker 1 takes its batch and then blocks (an empty queue on the parameter
   server) before training or committing. Worker 1 is killed (SIGKILL) while that step is
   in flight and restarted; steps go on until every shard finished epoch 0 and worker 1
   committed again. Every step "trains" by adding 1 to ``trained[epoch * size + id]`` on
   the parameter server, then commits its receipt.
3. A new ShardedInput restored from the phase-1 checkpoint reads on.
4. Another seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from loopback import ps_spec, serve, start_servers  # noqa: E402  (same directory)
from script_common import scaled  # noqa: E402

WORKERS = 3
# Bound on every wait for the cluster (a failure, not a timing check), scaled.
WAIT_SECONDS = scaled(120.0)


def start_worker_1(spec: dict) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", json.dumps(spec), "worker", "1"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    assert line == "ready", f"worker 1 did not start: {line!r}"
    return proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int)
    parser.add_argument("--other-seed", type=int)
    parser.add_argument("--out")
    parser.add_argument("--size", type=int, default=50)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--serve", nargs=3, metavar=("SPEC", "JOB", "INDEX"))
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), WORKERS + 1)
        return

    spec = ps_spec(WORKERS)
    processes = [start_worker_1(spec)]  # worker 1; the last one is the live one
    try:
        run(args, spec, processes)
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
    sys.stdout.flush()
    os._exit(0)  # The in-process servers (and a dequeue left blocked on the PS) never end.


def run(args: argparse.Namespace, spec: dict, processes: list) -> None:
    import tensorflow as tf
    from tensorflow.python.ops import resource_variable_ops

    from safevars.data import ShardedInput
    from safevars.errors import SafeVarsError

    cluster = start_servers(spec, [("worker", 0), ("worker", 2), ("ps", 0)], WORKERS + 1)
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    size, batch = args.size, args.batch
    with strategy.scope():
        data = ShardedInput(size, seed=args.seed)
        lengths = tf.constant([data.shard_length(w) for w in range(WORKERS)], tf.int64)
        with tf.device("/job:ps/replica:0/task:0/device:CPU:0"):
            new = resource_variable_ops.ResourceVariable
            trained = new(tf.zeros([2 * size], tf.int64), trainable=False)  # epochs 0, 1
            armed = new(tf.constant(0, tf.int64), trainable=False)
            in_flight = new(tf.constant([-1, -1], tf.int64), trainable=False)
            never = tf.queue.FIFOQueue(1, tf.int64, shapes=[])
    worker_index = tf.distribute.coordinator.experimental_get_current_worker_index

    def make_step(source: ShardedInput):
        @tf.function
        def step(iterator):
            ids, receipt = next(iterator)
            worker = tf.cast(worker_index(), tf.int64)

            def hang() -> tf.Tensor:
                # Taken, not trained on, not committed: what a killed step leaves behind.
                with tf.control_dependencies([in_flight.assign(receipt[0])]):
                    return never.dequeue()

            blocked = tf.cond(
                tf.logical_and(tf.equal(worker, 1), tf.equal(armed, 1)),
                hang,
                lambda: tf.constant(0, tf.int64),
            )
            with tf.control_dependencies([blocked]):
                epoch = tf.minimum(receipt[:, 1] // tf.gather(lengths, receipt[:, 0]), 1)
                update = trained.scatter_add(
                    tf.IndexedSlices(tf.ones_like(ids), epoch * size + ids)
                )
            source.commit(receipt, after=update)
            return worker, ids, receipt

        return step

    def schedule_until(source, step, iterator, done, log) -> None:
        """Schedules rounds of steps until ``done()``; appends committed batches to log."""
        deadline = time.monotonic() + WAIT_SECONDS
        while not done():
            assert time.monotonic() < deadline, "the cluster made no progress"
            results = [coordinator.schedule(step, args=(iterator,)) for _ in range(WORKERS)]
            coordinator.join()
            log += results

    def committed(results) -> list[list]:
        out = []
        for result in results:
            worker, ids, receipt = result.fetch()
            out.append([int(worker), ids.tolist(), receipt[:, 1].tolist()])
        return out

    def positions(source) -> list[int]:
        return source.positions.numpy().tolist()

    # Phase 1: every shard in the middle of epoch 0, then a checkpoint.
    step = make_step(data)
    iterator = iter(data.per_worker_dataset(coordinator, batch))
    log: list = []
    schedule_until(data, step, iterator, lambda: min(positions(data)) >= 6, log)
    checkpoint_path = tf.train.Checkpoint(data=data).write(os.path.join(args.out, "ckpt"))
    at_checkpoint = positions(data)

    # Phase 2: worker 1 dies with a batch in flight; it is restarted.
    armed.assign(1)
    pending = []
    deadline = time.monotonic() + WAIT_SECONDS
    while int(in_flight.numpy()[0]) < 0:  # until worker 1 has taken one of these steps
        assert time.monotonic() < deadline, "no step blocked on worker 1"
        pending.append(coordinator.schedule(step, args=(iterator,)))
        time.sleep(0.02)
    taken = in_flight.numpy().tolist()
    positions_when_killed = positions(data)
    armed.assign(0)
    processes[-1].kill()
    processes[-1].wait()
    processes.append(start_worker_1(spec))
    coordinator.join()
    log += pending
    ends = [data.shard_length(w) for w in range(WORKERS)]
    schedule_until(
        data,
        step,
        iterator,
        lambda: all(
            p >= max(e, taken[1] + batch if w == 1 else 0)
            for w, (p, e) in enumerate(zip(positions(data), ends))
        ),
        log,
    )
    phase2_positions = positions(data)
    phase2_trained = trained.numpy().tolist()

    # Phase 3: a new ShardedInput restored from the phase-1 checkpoint.
    with strategy.scope():
        restored = ShardedInput(size, seed=args.seed)
    tf.train.Checkpoint(data=restored).read(checkpoint_path).assert_consumed()
    restored_log: list = []
    schedule_until(
        restored,
        make_step(restored),
        iter(restored.per_worker_dataset(coordinator, batch)),
        lambda: all(p >= e for p, e in zip(positions(restored), ends)),
        restored_log,
    )

    # Phase 4: another seed.
    with strategy.scope():
        other = ShardedInput(size, seed=args.other_seed)
    other_log: list = []
    schedule_until(
        other,
        make_step(other),
        iter(other.per_worker_dataset(coordinator, batch)),
        lambda: min(positions(other)) >= 4,
        other_log,
    )

    errors = {}
    try:
        data.dataset(0)
    except SafeVarsError as e:
        errors["dataset"] = f"{type(e).__name__}: {e}"
    print(
        json.dumps(
            {
                "size": size,
                "batch": batch,
                "seed": args.seed,
                "other_seed": args.other_seed,
                "num_workers": data.num_workers,
                "lengths": ends,
                "positions_device": data.positions.device,
                "checkpoint": checkpoint_path,
                "at_checkpoint": at_checkpoint,
                "in_flight": taken,
                "positions_when_killed": positions_when_killed,
                "phase2_positions": phase2_positions,
                "committed": committed(log),
                "trained": phase2_trained,
                "restored": committed(restored_log),
                "other": committed(other_log),
                "errors": errors,
            }
        )
    )


if __name__ == "__main__":
    main()
