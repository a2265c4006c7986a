"""Exactly-once steps on ParameterServerStrategy with worker servers killed mid-run.

Usage: python exactly_once_ps.py [--seed 0] [--steps 120] [--runs 2] [--cancel-steps 40]
(``--serve SPEC JOB INDEX`` runs one server: used for workers 1 and 2.)

The cluster is 3 workers and 1 parameter server on 127.0.0.1. The parameter server and
worker 0 run in this process (as ``safevars.local_cluster`` does); workers 1 and 2 run in
processes of their own so that they can be killed (SIGKILL) and restarted. Each start
(12 with ``--runs 2``) forks from a ``multiprocessing`` forkserver that imported
TensorFlow once, started before this process's servers (``loopback.start_server_process``);
with ``SAFEVARS_TEST_FORK=0``, each is a new ``python`` process running this script with
``--serve``. Prints one JSON line.

The main step writes through safevars in every way: ``counter.update(+1)``, a
transaction moving 1 from ``a`` to ``b``, a ``GradientAccumulator.add``, an
``add_and_take`` (deterministic, ``max_pending=1``) and a
``SafeOptimizer.apply_gradients`` (SGD, gradient -1, learning rate 1: the weight counts
the applied steps). A step can be made to block on the parameter server *after* its
writes, on one chosen worker (``armed``); that worker is then killed with the step in
flight, so the coordinator retries a step whose writes already reached the parameter
server: the duplicate the issue measured, made certain instead of left to timing.

Parts (tests/test_exactly_once.py checks the result):

* ``plain``: that kill with ``coordinator.schedule``: the retried step is applied twice.
* ``runs``: ``--runs`` runs with ``safevars.exactly_once.schedule``, each on new state:
  a blocked step killed on worker 1, ``--steps`` steps with workers 1 and 2 killed at
  random moments (from ``--seed``) and restarted, a blocked step killed on worker 2.
* ``late``: a transaction whose second write needs a value its worker is still waiting
  for when the worker is killed: that attempt must apply neither write.
* ``cancel``: one update per step, token = step number. A step blocks on worker 1, then
  another step fails after its update, and the coordinator cancels the blocked one and
  the queued ones. Every step's outcome is read; then every step number is scheduled
  again, done ones included.
* ``retry_of_done``: a done step scheduled again with its token: what it returns.
* ``replica``: SafeOptimizer and GradientAccumulator inside ``strategy.run``, and a
  plain write in a replica function, each scheduled twice with one token.
* ``refused``: steps whose sections could run twice per step are refused at schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from loopback import (  # noqa: E402  (same directory)
    ServerProcess,
    ps_spec,
    serve,
    start_server_process,
    start_servers,
)
from script_common import scaled  # noqa: E402

WORKERS = 3
KILLABLE = (1, 2)
# Bound on every wait for the cluster (a failure, not a timing check), scaled.
WAIT_SECONDS = scaled(120.0)


class Workers:
    """Workers 1 and 2 as processes of their own: killed and restarted on demand."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.procs: dict[int, ServerProcess] = {}
        self.all: list[ServerProcess] = []
        self.kills = 0
        self.lock = threading.Lock()
        starting = [threading.Thread(target=self.start, args=(i,)) for i in KILLABLE]
        for t in starting:
            t.start()
        for t in starting:
            t.join(WAIT_SECONDS)

    def start(self, index: int) -> None:
        proc = start_server_process(
            os.path.abspath(__file__), self.spec, "worker", index, WORKERS + 1, WAIT_SECONDS
        )
        with self.lock:
            self.procs[index] = proc
            self.all.append(proc)

    def kill(self, index: int) -> None:
        with self.lock:
            proc = self.procs.pop(index)
        proc.kill()
        self.kills += 1

    def restart(self, index: int) -> threading.Thread:
        """Starts worker ``index`` again in the background (up to seconds: a new process
        imports TensorFlow, a forked one waits for its server)."""
        thread = threading.Thread(target=self.start, args=(index,))
        thread.start()
        return thread

    def stop(self) -> None:
        for proc in self.all:
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--plain-steps", type=int, default=12)
    parser.add_argument("--cancel-steps", type=int, default=40)
    parser.add_argument("--serve", nargs=3, metavar=("SPEC", "JOB", "INDEX"))
    args = parser.parse_args()
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]), WORKERS + 1)
        return

    spec = ps_spec(WORKERS)
    workers = Workers(spec)
    try:
        result = run(args, spec, workers)
    except BaseException:  # noqa: BLE001 - reported, then the process must end
        traceback.print_exc()
        sys.stderr.flush()
        workers.stop()
        os._exit(1)  # The in-process servers never end.
    workers.stop()
    print(json.dumps(result), flush=True)
    os._exit(0)


def run(args: argparse.Namespace, spec: dict, workers: Workers) -> dict:
    import keras
    import tensorflow as tf

    import safevars
    from safevars import exactly_once

    cluster = start_servers(spec, [("worker", 0), ("ps", 0)], WORKERS + 1)
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    worker_index = tf.distribute.coordinator.experimental_get_current_worker_index
    rng = random.Random(args.seed)
    ps = "/job:ps/replica:0/task:0/device:CPU:0"
    with tf.device(ps):
        armed = tf.Variable(tf.constant(-1, tf.int64), trainable=False)  # whose step blocks
        blocked = tf.Variable(tf.constant(0, tf.int64), trainable=False)  # one is blocked
        poison = tf.Variable(tf.constant(-1, tf.int64), trainable=False)  # step that raises
        gate = tf.queue.FIFOQueue(64, tf.int64, shapes=[])  # a blocked step waits on it
        late = tf.queue.FIFOQueue(64, tf.float32, shapes=[])  # a value that comes late

    def mine() -> tf.Tensor:
        return tf.equal(tf.cast(worker_index(), tf.int64), armed.read_value())

    def hang() -> tf.Tensor:
        with tf.control_dependencies([blocked.assign(1)]):
            return gate.dequeue()

    def block_then_check(written: list, number: tf.Tensor) -> tf.Tensor:
        """After ``written``: block if this worker is armed; fail if ``number`` is poison."""
        with tf.control_dependencies(written):
            held = tf.cond(mine(), hang, lambda: tf.constant(0, tf.int64))
            check = tf.debugging.Assert(
                tf.not_equal(number, poison.read_value()), ["poisoned step", number]
            )
        with tf.control_dependencies([held, check]):
            return tf.identity(number)

    def make_state():
        with strategy.scope():
            state = {
                "counter": safevars.SafeVariable(0.0),
                "a": safevars.SafeVariable(1000.0),
                "b": safevars.SafeVariable(0.0),
                "w": safevars.SafeVariable(tf.zeros([2])),
                "g": tf.Variable(tf.zeros([2])),
            }
            state["acc"] = safevars.GradientAccumulator(
                [state["g"]], reduction="sum", deterministic=False
            )
            # add_and_take at every step, deterministic and bounded: each step adds one
            # contribution and takes it.
            state["taking"] = safevars.GradientAccumulator(
                [tf.Variable(tf.zeros([2]))], reduction="sum", max_pending=1
            )
            state["opt"] = safevars.SafeOptimizer(keras.optimizers.SGD(1.0))
            state["opt"].build([state["w"]])
        return state

    def make_step(state):
        """Every kind of safevars write, then (maybe) block or fail."""
        counter, a, b, w = state["counter"], state["a"], state["b"], state["w"]
        acc, opt = state["acc"], state["opt"]

        def step(number):
            written = [counter.update(lambda x: x + 1.0)]

            def move():
                a.assign_sub(1.0)
                b.assign_add(1.0)
                return a.read_value() + b.read_value()

            written.append(safevars.transaction([a, b], move))
            written.append(acc.add([tf.ones([2])]))
            written.append(state["taking"].add_and_take([tf.ones([2])])[0])
            opt.apply_gradients([(-tf.ones([2]), w)])  # SGD(1.0): w counts the steps
            written.append(w.read_value())
            return block_then_check(written, number)

        return tf.function(step)

    def figures(state) -> dict:
        counter, a, b, w = state["counter"], state["a"], state["b"], state["w"]
        return {
            "counter": float(counter.numpy()),
            "counter_version": int(counter.version),
            "a": float(a.numpy()),
            "b": float(b.numpy()),
            "a_version": int(a.version),
            "b_version": int(b.version),
            "accumulated": state["acc"].statistics().added,
            "taking": {
                key: getattr(state["taking"].statistics(), key)
                for key in ("added", "taken", "takes", "pending")
            },
            "w": w.numpy().tolist(),
            "iterations": int(state["opt"].iterations.numpy()),
            "discarded": {
                name: state[name].statistics().duplicates_discarded
                for name in ("counter", "a", "b", "w")
            },
        }

    def drain() -> None:
        for queue in (gate, late):
            size = int(queue.size())
            if size:
                queue.dequeue_many(size)

    def until_blocked(step_fn, schedule, index: int, handles: list) -> None:
        """Schedules steps until one blocks on worker ``index`` (after its writes)."""
        blocked.assign(0)
        armed.assign(index)
        deadline = time.monotonic() + WAIT_SECONDS
        while int(blocked.numpy()) == 0:
            assert time.monotonic() < deadline, f"no step blocked on worker {index}"
            if coordinator.done():
                handles += [schedule(step_fn, len(handles) + k) for k in range(WORKERS)]
            time.sleep(0.02)
        armed.assign(-1)

    def kill_blocked(step_fn, schedule, index: int, handles: list) -> None:
        """A step blocks on worker ``index`` after its writes; the worker is killed."""
        until_blocked(step_fn, schedule, index, handles)
        workers.kill(index)
        gate.enqueue(0)  # Frees the parameter server's thread if the dequeue still waits.
        restarting = workers.restart(index)
        coordinator.join()
        restarting.join(WAIT_SECONDS)
        drain()
        log(
            f"worker {index} killed with a step in flight, restarted; "
            f"{len(handles)} steps scheduled"
        )

    def plain_schedule(step_fn, i):
        return coordinator.schedule(step_fn, args=(tf.constant(i, tf.int64),))

    def once_schedule(step_fn, i):
        return exactly_once.schedule(coordinator, step_fn, args=(tf.constant(i, tf.int64),))

    result: dict = {"steps": args.steps}
    started = time.monotonic()

    # ------------------------------------------------------------- plain (the problem)
    state = make_state()
    step = make_step(state)
    handles: list = []
    kill_blocked(step, plain_schedule, 1, handles)
    result["plain"] = {
        "scheduled": len(handles),
        "done": sum(map(_fetched, handles)),
        **figures(state),
    }
    log(f"plain: {result['plain']}")

    # ------------------------------------------------------------- exactly-once runs
    result["runs"] = []
    for _ in range(args.runs):
        state = make_state()
        step = make_step(state)
        run_started = time.monotonic()
        handles = []
        kill_blocked(step, once_schedule, 1, handles)
        after_first = figures(state)["discarded"]
        handles += [once_schedule(step, i) for i in range(args.steps)]
        for index in KILLABLE:  # random moments, one worker after the other
            time.sleep(rng.uniform(0.05, 0.5))
            workers.kill(index)
            workers.restart(index).join(WAIT_SECONDS)
        coordinator.join()
        kill_blocked(step, once_schedule, 2, handles)
        outcomes = [h.outcome() for h in handles]
        result["runs"].append(
            {
                "scheduled": len(handles),
                "done": outcomes.count("done"),
                "outcomes": sorted(set(outcomes)),
                "discarded_after_first_kill": after_first,
                "seconds": round(time.monotonic() - run_started, 1),
                **figures(state),
                "accumulated_sum": [float(x) for x in state["acc"].take()[0].numpy()],
            }
        )
        log(f"run: {result['runs'][-1]}")

    # ------------------------------------------------------------- late input
    # A transaction whose second write needs a value the worker computes from a queue
    # that has nothing yet; the worker is killed while it waits. Nothing of the section
    # may be applied by that attempt: its retry applies both writes, once.
    state = make_state()
    a, b = state["a"], state["b"]

    @tf.function
    def late_step(number):
        def wait_for_late_value() -> tf.Tensor:
            with tf.control_dependencies([blocked.assign(1)]):
                return late.dequeue()

        # Computed on the worker (``* 1.0``), from a queue on the parameter server.
        x = tf.cond(mine(), wait_for_late_value, lambda: tf.constant(1.0)) * 1.0

        def move():
            a.assign_sub(1.0)  # needs nothing from the worker
            b.assign_add(x)  # needs x

        safevars.transaction([a, b], move)
        return number

    handles = []
    until_blocked(late_step, once_schedule, 1, handles)
    workers.kill(1)
    late.enqueue(1.0)  # Frees the parameter server's dequeue if it still waits.
    restarting = workers.restart(1)
    coordinator.join()
    restarting.join(WAIT_SECONDS)
    drain()
    result["late"] = {
        "scheduled": len(handles),
        "done": sum(map(_fetched, handles)),
        **figures(state),
    }
    log(f"late: {result['late']}")

    # ------------------------------------------------------------- cancelled steps
    # One section per step, so a step is applied or not; the token is the step number.
    # A step blocks on worker 1 after its update; then step ``poisoned`` fails (its
    # assertion, after its update): the coordinator cancels the blocked step and every
    # queued one. Afterwards every step number is scheduled again, done ones included.
    state = make_state()
    counter = state["counter"]
    with tf.device(ps):
        go = tf.queue.FIFOQueue(4, tf.int64, shapes=[])

    @tf.function
    def count_step(number):
        new = counter.update(lambda x: x + 1.0)
        with tf.control_dependencies([new]):
            poisoned = tf.equal(number, poison.read_value())
            held = tf.cond(mine(), hang, lambda: tf.constant(0, tf.int64))
            waited = tf.cond(poisoned, go.dequeue, lambda: tf.constant(0, tf.int64))
        with tf.control_dependencies([waited]):
            check = tf.debugging.Assert(tf.logical_not(poisoned), ["poisoned step", number])
        with tf.control_dependencies([held, check]):
            return tf.identity(number)

    def by_number(step_fn, i):
        return exactly_once.schedule(
            coordinator, step_fn, args=(tf.constant(i, tf.int64),), token=i
        )

    handles = []
    until_blocked(count_step, by_number, 1, handles)
    in_flight = len(handles)
    poison.assign(in_flight)
    handles += [by_number(count_step, in_flight + i) for i in range(args.cancel_steps)]
    go.enqueue(0)  # the poisoned step fails now, with steps still queued
    releaser = threading.Thread(
        target=_release_after_error, args=(handles[in_flight], handles[:in_flight], gate)
    )
    releaser.start()
    try:
        coordinator.join()
        join_error = "none"
    except Exception as e:  # noqa: BLE001 - reported
        join_error = type(e).__name__
    releaser.join(WAIT_SECONDS)
    poison.assign(-1)
    drain()
    errors = [_error_name(h) for h in handles]
    first = [h.outcome() for h in handles]
    before_retry = figures(state)
    again = [by_number(count_step, i) for i in range(len(handles))]  # every step again
    coordinator.join()
    final = [h.outcome() for h in again]
    result["cancel"] = {
        "scheduled": len(handles),
        "poisoned": in_flight,
        "join_error": join_error,
        "errors": {e: errors.count(e) for e in sorted(set(errors))},
        "first": {o: first.count(o) for o in sorted(set(first))},
        "by_error": sorted({f"{e}: {o}" for e, o in zip(errors, first)}),
        "cancelled_but_applied": sum(
            e == "CancelledError" and o == "applied" for e, o in zip(errors, first)
        ),
        "poisoned_outcome": first[in_flight],
        "poisoned_error": errors[in_flight],
        "before_retry": before_retry,
        "final": {o: final.count(o) for o in sorted(set(final))},
        **figures(state),
    }
    log(f"cancel: {result['cancel']}")

    # ------------------------------------------------------------- retry of a done step
    state = make_state()
    counter, a, b = state["counter"], state["a"], state["b"]

    @tf.function
    def returns_step():
        new = counter.update(lambda x: x + 1.0)
        snap = counter.snapshot()
        moved = safevars.transaction([a, b], lambda: (a.assign_sub(1.0), b.assign_add(1.0)))
        return new, snap.value, snap.version, moved[1]

    first_step = exactly_once.schedule(coordinator, returns_step)
    coordinator.join()
    again = first_step.reschedule()
    coordinator.join()
    result["retry_of_done"] = {
        "first": [float(x) for x in first_step.fetch()],
        "again": [float(x) for x in again.fetch()],
        "tokens": [first_step.token, again.token],
        **figures(state),
    }

    # ------------------------------------------------------------- inside strategy.run
    # SafeOptimizer and GradientAccumulator merge the replicas first (merge_call, in the
    # tracing thread); a plain write in the replica function is traced in a replica
    # thread of its own: refused, unless sections wraps per graph (every thread).
    state = make_state()
    w, acc, opt, counter = state["w"], state["acc"], state["opt"], state["counter"]

    @tf.function
    def merged_in_run():
        def replica():
            opt.apply_gradients([(-tf.ones([2]), w)])
            acc.add([tf.ones([2])])

        strategy.run(replica)

    @tf.function
    def write_in_run():
        strategy.run(lambda: counter.assign_add(1.0))

    replica: dict = {
        "per_graph_hook": hasattr(exactly_once.recording.sections, "graph_body_wrappers")
    }
    for name, fn in (("merged", merged_in_run), ("write", write_in_run)):
        try:
            once = exactly_once.schedule(coordinator, fn)
            coordinator.join()
            again = once.reschedule()
            coordinator.join()
            replica[name] = [once.outcome(), again.outcome()]
        except safevars.UnsupportedStrategyError as e:
            replica[name] = f"UnsupportedStrategyError: {e}"
    result["replica"] = {**replica, **figures(state)}

    # ------------------------------------------------------------- refused steps
    state = make_state()
    counter = state["counter"]
    refused = {}

    @tf.function
    def in_loop():
        for _ in tf.range(3):
            counter.update(lambda x: x + 1.0)

    @tf.function
    def inner():
        counter.update(lambda x: x + 1.0)

    @tf.function
    def calls_inner():
        inner()

    @tf.function
    def traced_before():
        counter.assign_add(1.0)

    @tf.function
    def calls_traced_before():
        traced_before()

    coordinator.schedule(calls_traced_before)  # traces traced_before outside the wrapper
    coordinator.join()
    for name, fn in (
        ("loop", in_loop),
        ("nested", calls_inner),
        ("traced_before", calls_traced_before),
    ):
        try:
            exactly_once.schedule(coordinator, fn)
            refused[name] = "accepted"
        except safevars.UnsupportedStrategyError as e:
            refused[name] = f"UnsupportedStrategyError: {e}"
    coordinator.join()
    result["refused"] = refused
    result["counter_after_refusals"] = float(counter.numpy())

    result["kills"] = workers.kills
    result["seconds"] = round(time.monotonic() - started, 1)
    result["lock_device"] = state["counter"].guard.cs._handle.device
    result["table_devices"] = sorted(
        {r.table.resource_handle.device for r in exactly_once.recording._RECORDS.values()}
    )
    return result


def _release_after_error(poisoned, earlier: list, gate) -> None:
    """Frees a step still blocked on ``gate`` once the coordinator cancelled the others.

    The coordinator's cancellation reaches the blocked dequeue on the parameter server
    (the step ends with CancelledError); if it did not, the coordinator would wait for
    the step forever, so after a bound the gate is opened (drained afterwards).
    """
    _error_name(poisoned)
    waiter = threading.Thread(target=lambda: [_error_name(h) for h in earlier], daemon=True)
    waiter.start()
    waiter.join(WAIT_SECONDS / 3)
    gate.enqueue(0)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _fetched(handle) -> bool:
    try:
        handle.fetch()
        return True
    except Exception:  # noqa: BLE001
        return False


def _error_name(handle) -> str:
    try:
        handle.fetch()
        return "none"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__


if __name__ == "__main__":
    main()
