"""Recovering from a failed step on parameter servers without counting anything twice.

Run: python examples/exactly_once_ps.py [--workers 3] [--steps 60] [--verbose]

Starts an in-process ``ParameterServerStrategy`` cluster on 127.0.0.1 and schedules
``--steps`` steps with a ``ClusterCoordinator``. Each step adds 1 to a step counter and
its batch size to an examples-seen counter (``SafeVariable.update`` on the parameter
server), then checks its batch; one batch is bad, so that step fails *after* its updates,
and the coordinator cancels the steps still queued and raises from ``join()``. The loop
then does what a training loop does after an error: it schedules again every step that
did not come back, and joins.

1. ``plain``: ``coordinator.schedule``. The failed step had applied its updates, so
   scheduling it again applies them twice, and so does a step that was running when the
   coordinator cancelled it, if its updates had reached the parameter server first: the
   counters end one step or more too high. (In a real cluster the same happens without
   any error when a worker dies after its update reached the parameter server: the
   coordinator retries the step by itself.)
2. ``exactly_once``: ``safevars.exactly_once.schedule(..., token=step_number)``. Before
   scheduling again, ``outcome()`` says what each unfinished step did ("applied",
   "not_applied", or "partly_applied" for a step cancelled between its two updates);
   scheduling *every* step again with its token is safe: sections already applied are
   discarded (``statistics().duplicates_discarded``), the rest run once.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import re

from _quiet import (  # examples/_quiet.py
    add_verbose_argument,
    quiet_tensorflow_startup,
    verbose_requested,
)

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import tensorflow as tf  # noqa: E402

import safevars  # noqa: E402
from safevars import exactly_once  # noqa: E402
from safevars.local_cluster import start_in_process_cluster  # noqa: E402

BATCH = 32


class HideTheBadBatch(logging.Filter):
    """Drops the coordinator's log of the deliberate failure.

    ``ClusterCoordinator`` logs the failed step's error, traceback and all, for every step
    that meets it (about 300 lines), and sometimes the ``CancelledError`` of a step it
    cancelled because of it, which it says it ignores; the example reports the failure in
    one line. Any other record passes; ``--verbose`` shows them all.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "bad batch" in message:
            return False
        return not ("CancelledError" in message and "derived error is ignored" in message)


def run(strategy, coordinator, steps: int, once: bool) -> dict:
    with strategy.scope():
        counter = safevars.SafeVariable(0, dtype=tf.int64)
        seen = safevars.SafeVariable(0, dtype=tf.int64)
    with tf.device("/job:ps/replica:0/task:0"):
        bad = tf.Variable(tf.constant(steps // 3, tf.int64))  # the bad batch, once

    @tf.function
    def step(number):
        updates = [counter.update(lambda c: c + 1), seen.update(lambda s: s + BATCH)]
        with tf.control_dependencies(updates):
            ok = tf.not_equal(number, bad.read_value())
            tf.debugging.Assert(ok, ["bad batch", number])
        return number

    def schedule(number: int):
        args = (tf.constant(number, tf.int64),)
        if once:
            return exactly_once.schedule(coordinator, step, args=args, token=number)
        return coordinator.schedule(step, args=args)

    results = {i: schedule(i) for i in range(steps)}
    try:
        coordinator.join()
    except tf.errors.InvalidArgumentError as e:
        which = re.search(r"bad batch\] \[(\d+)\]", e.message)
        print(f"  join() raised {type(e).__name__}: bad batch {which and which[1]}")
    bad.assign(-1)  # the batch is fixed (skipped, retried...): from now on every step works

    def finished(result) -> bool:
        try:
            result.fetch()
            return True
        except (tf.errors.CancelledError, tf.errors.InvalidArgumentError):
            return False

    if once:  # everything again: applied steps are discarded, the rest run
        outcomes = collections.Counter(r.outcome() for r in results.values())
        print(f"  before scheduling again: {dict(sorted(outcomes.items()))}")
        again = list(results)
    else:  # only what did not come back: the failed step's updates were applied, though
        again = [i for i, r in results.items() if not finished(r)]
    for i in again:
        results[i] = schedule(i)
    coordinator.join()
    return {
        "done": sum(finished(r) for r in results.values()),
        "counter": int(counter.numpy()),
        "seen": int(seen.numpy()),
        "discarded": counter.statistics().duplicates_discarded,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    add_verbose_argument(parser)
    args = parser.parse_args()
    if not (args.verbose or verbose_requested()):
        tf.get_logger().addFilter(HideTheBadBatch())
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        start_in_process_cluster(args.workers, 1)
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    rows = []
    for name, once in (("plain", False), ("exactly_once", True)):
        print(f"{name}:")
        rows.append((name, run(strategy, coordinator, args.steps, once)))
    print(f"\n{args.steps} steps of batch {BATCH}, one failing once after its updates")
    print(f"{'':14}{'done':>6}{'counter':>9}{'seen':>7}{'discarded':>11}")
    for name, r in rows:
        print(f"{name:14}{r['done']:>6}{r['counter']:>9}{r['seen']:>7}{r['discarded']:>11}")


if __name__ == "__main__":
    main()
    os._exit(0)  # The in-process servers never end.
