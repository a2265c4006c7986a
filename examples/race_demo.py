"""The lost-update race: threads doing read-then-assign, plain tf.Variable vs safevars.

Run: python examples/race_demo.py [--threads 8] [--iterations 500] [--verbose]

Each thread adds 1 to a shared variable ``iterations`` times. With a plain
``tf.Variable`` and ``v.assign(v.read_value() + 1)`` updates are lost whenever two threads
interleave between the read and the write (how many depends on the scheduler). The same
loop written with ``SafeVariable.update`` or ``safevars.locked`` loses none.
"""

from __future__ import annotations

import argparse
import threading
import time

from _quiet import add_verbose_argument, quiet_tensorflow_startup  # examples/_quiet.py

quiet_tensorflow_startup()  # before TensorFlow is imported; --verbose shows its C++ start-up log

import tensorflow as tf  # noqa: E402

import safevars  # noqa: E402


def hammer(threads: int, work) -> float:
    barrier = threading.Barrier(threads)

    def run() -> None:
        barrier.wait()
        work()

    workers = [threading.Thread(target=run) for _ in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=500)
    add_verbose_argument(parser)
    args = parser.parse_args()
    expected = args.threads * args.iterations

    plain = tf.Variable(0.0)

    def plain_work() -> None:
        for _ in range(args.iterations):
            plain.assign(plain.read_value() + 1.0)

    safe = safevars.SafeVariable(0.0)

    def safe_update_work() -> None:
        for _ in range(args.iterations):
            safe.update(lambda x: x + 1.0)

    locked = safevars.SafeVariable(0.0)

    def safe_locked_work() -> None:
        for _ in range(args.iterations):
            with safevars.locked(locked):
                locked.assign(locked.read_value() + 1.0)

    print(
        f"{args.threads} threads x {args.iterations} read-then-assign increments "
        f"(expected {expected})"
    )
    for label, variable, work in [
        ("plain tf.Variable", plain, plain_work),
        ("SafeVariable.update", safe, safe_update_work),
        ("safevars.locked", locked, safe_locked_work),
    ]:
        seconds = hammer(args.threads, work)
        final = int(variable.numpy())
        lost = expected - final
        extra = (
            f", version {variable.version}" if isinstance(variable, safevars.SafeVariable) else ""
        )
        print(
            f"{label:22s} final {final:6d}  lost {lost:6d} ({100.0 * lost / expected:5.1f}%)"
            f"  {seconds:5.2f} s{extra}"
        )


if __name__ == "__main__":
    main()
