"""Exactly-once tables in checkpoints: a coordinator killed mid-run, restored in a new one.

Usage: python exactly_once_restart.py --phase first|restore --dir DIR [--steps 120]
[--saves 3] [--unfenced]

Each phase is a coordinator process with its own loopback ParameterServerStrategy
cluster (1 parameter server, 2 workers, in process: they die with it). The step, with
token = step number, is two sections: ``counter.update(+1)``, then a transaction moving
1 from ``a`` to ``b`` that computes for a while between its two writes (so a save
that did not exclude sections would often read ``a`` after and ``b`` before).

* ``first``: schedules every step, takes ``--saves`` checkpoints with a
  ``CheckpointManager`` while they run (``tf.train.Checkpoint`` of the variables and
  ``exactly_once.tables(strategy)``), prints one JSON line and waits: the test kills
  this process (SIGKILL) as soon as it reads the line, with steps still running.
* ``restore``: a new cluster; reads every checkpoint's raw entries (is each one a state
  where the table holds an entry exactly for each applied section?), restores the
  latest, schedules every step again with the same tokens, joins, prints the figures.

``--unfenced`` (a mutation check, by hand) saves without the exactly-once fence.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from loopback import ps_spec, start_servers  # noqa: E402  (same directory)
from script_common import scaled  # noqa: E402

WORKERS = 2
WAIT_SECONDS = scaled(120.0)  # Bound on a wait for the cluster (a failure, not timing).
HEAVY = 6  # 300x300 matmuls between the transaction's two writes


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("first", "restore"), required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--unfenced", action="store_true")
    parser.add_argument("--dump-after", type=float, default=0.0)
    args = parser.parse_args()
    if args.dump_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)
    try:
        result = run(args)
    except BaseException:  # noqa: BLE001 - reported, then the process must end
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # The in-process servers never end.
    print(json.dumps(result), flush=True)
    if args.phase == "first":
        time.sleep(WAIT_SECONDS)  # Killed by the test before this ends.
    os._exit(0)


def run(args) -> dict:
    import tensorflow as tf

    import safevars
    from safevars import exactly_once

    spec = ps_spec(WORKERS)
    cluster = start_servers(
        spec, [*(("worker", i) for i in range(WORKERS)), ("ps", 0)], WORKERS + 2
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        counter = safevars.SafeVariable(0.0)
        a = safevars.SafeVariable(1000.0)
        b = safevars.SafeVariable(0.0)
    once = exactly_once.tables(strategy)
    if args.unfenced:
        exactly_once.checkpoints._fenced_locks = list  # no lock fenced: the mutation
    ckpt = tf.train.Checkpoint(counter=counter, a=a, b=b, exactly_once=once)
    manager = tf.train.CheckpointManager(ckpt, args.dir, max_to_keep=args.saves + 1)

    @tf.function
    def step(number):
        counter.update(lambda x: x + 1.0)

        def move():
            a.assign_sub(1.0)
            m = tf.ones([300, 300]) + tf.cast(number, tf.float32) * 0.0
            with tf.control_dependencies([a.read_value()]):
                for _ in range(HEAVY):
                    m = tf.matmul(m, m) * 1e-6
            b.assign_add(1.0 + tf.reduce_sum(m) * 0.0)

        safevars.transaction([a, b], move)
        return number

    def schedule_all():
        return [
            exactly_once.schedule(coordinator, step, args=(tf.constant(i, tf.int64),), token=i)
            for i in range(args.steps)
        ]

    def figures() -> dict:
        return {
            "counter": float(counter.numpy()),
            "a": float(a.numpy()),
            "b": float(b.numpy()),
            "versions": [int(counter.version), int(a.version), int(b.version)],
            "discarded": [v.statistics().duplicates_discarded for v in (counter, a, b)],
            "entries": once.size(),
        }

    if args.phase == "first":
        handles = schedule_all()
        deadline = time.monotonic() + WAIT_SECONDS
        while float(counter.numpy()) < 1.0:  # the first steps have run
            assert time.monotonic() < deadline, "no step ran"
            time.sleep(0.01)
        running = []
        for _ in range(args.saves):
            manager.save()
            running.append(not coordinator.done())
        return {
            "phase": "first",
            "scheduled": len(handles),
            "running_after_each_save": running,
            "checkpoints": list(manager.checkpoints),
        }

    # ------------------------------------------------------------- restore
    saved = []
    for path in manager.checkpoints:
        reader = tf.train.load_checkpoint(path)
        names = reader.get_variable_to_shape_map()
        (keys_name,) = [n for n in names if n.startswith("exactly_once/") and "keys" in n]
        keys = reader.get_tensor(keys_name)
        saved.append(
            {
                "counter": float(reader.get_tensor("counter/.ATTRIBUTES/VARIABLE_VALUE")),
                "a": float(reader.get_tensor("a/.ATTRIBUTES/VARIABLE_VALUE")),
                "b": float(reader.get_tensor("b/.ATTRIBUTES/VARIABLE_VALUE")),
                "entries": int((keys >= 0).sum()),
                "table": keys_name,
            }
        )
    restored_path = manager.restore_or_initialize()
    restored = figures()
    started = time.monotonic()
    handles = schedule_all()
    coordinator.join()
    outcomes = [h.outcome() for h in handles]
    return {
        "phase": "restore",
        "saved": saved,
        "restored_path": restored_path,
        "restored": restored,
        "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
        "final": figures(),
        "rerun_seconds": round(time.monotonic() - started, 1),
    }


if __name__ == "__main__":
    main()
