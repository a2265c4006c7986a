"""safevars.audit() points at the lost-update race in existing code, then clears the fix.

Run: python examples/audit_demo.py [--threads 4] [--iterations 50] [--verbose]

Four threads each add 1 to a shared ``tf.Variable`` with the usual
``v.assign(v.read_value() + 1)``. Inside ``safevars.audit()`` every variable access is
recorded; the report names the variable, the threads, and the file:line of the read and
of the writes that can interleave with it, whether or not an update was actually lost in
this run. The same loop written with ``SafeVariable.update`` gives an empty report.
"""

from __future__ import annotations

import argparse
import threading
import time

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import tensorflow as tf  # noqa: E402

import safevars  # noqa: E402
from safevars.audit import audit  # noqa: E402

JOIN_TIMEOUT = 120.0


def run_in_threads(threads: int, work) -> None:
    """Starts ``threads`` workers together on a barrier and joins them."""
    barrier = threading.Barrier(threads)

    def run() -> None:
        barrier.wait()
        work()

    workers = [threading.Thread(target=run, name=f"worker-{i}") for i in range(threads)]
    for t in workers:
        t.start()
    deadline = time.monotonic() + JOIN_TIMEOUT  # one deadline for all
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise RuntimeError(f"{t.name} did not finish in {JOIN_TIMEOUT} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=50)
    add_verbose_argument(parser)
    args = parser.parse_args()
    expected = args.threads * args.iterations

    counter = tf.Variable(0.0, name="counter")

    def racy() -> None:
        for _ in range(args.iterations):
            value = counter.read_value()  # 1. read
            counter.assign(value + 1.0)  # 2. write back: another thread may have written

    print(f"--- plain tf.Variable, {args.threads} threads x {args.iterations} increments")
    with audit() as report:
        run_in_threads(args.threads, racy)
    print(f"final value {int(counter.numpy())} of {expected} expected")
    print(report)

    safe = safevars.SafeVariable(0.0, name="safe_counter")

    def fixed() -> None:
        for _ in range(args.iterations):
            safe.update(lambda x: x + 1.0)  # one atomic read-modify-write

    print("\n--- SafeVariable.update, same workload")
    with audit() as report:
        run_in_threads(args.threads, fixed)
    print(f"final value {int(safe.numpy())} of {expected} expected")
    print(report)


if __name__ == "__main__":
    main()
