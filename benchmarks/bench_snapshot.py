"""Family 5: a consistent read of N variables against N plain reads.

Variants (scalar float32 variables, each variant its own set):

* ``N plain reads``: ``[v.read_value() for v in variables]``: the baseline, which can
  be torn by a concurrent multi-variable write;
* ``safevars.snapshot``: ``safevars.snapshot(variables)``, the optimistic
  (sequence-lock) reader: values and versions from one instant, no lock taken when no
  writer is active;
* ``safevars.locked``: the N reads inside ``with safevars.locked(*variables):``, the
  pessimistic way to get the same consistency;
* ``tf.CriticalSection``: the N reads inside one ``cs.execute`` (consistent only if
  every writer uses the same critical section).

``busy writer`` case (issue #17): a thread runs back-to-back
``safevars.transaction([a, b], move)`` calls while the timed reader reads ``a, b``
``READS_PER_CALL`` times with plain reads (may be torn), ``safevars.snapshot`` or
``safevars.locked``; the time per call is the inverse of reads completed per second
under that writer. Goal: a snapshot at least as fast as a locked read (time ratio
snapshot/locked <= 1.0).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

import safevars
from benchmarks.background import Background
from benchmarks.case import Case, Context

FAMILY = "snapshot"
DESCRIPTION = (
    "consistent snapshot of N variables: safevars.snapshot vs N plain reads, "
    "safevars.locked, tf.CriticalSection"
)
ORDER = 5
SECONDS = {"full": 8, "quick": 1}  # on a quiet 2-core CPU, estimated: see the guide

COUNTS = (1, 8, 64)
READS_PER_CALL = 50


def _busy_writer(a: Any, b: Any) -> Background:
    """A thread writing ``a, b`` in back-to-back transactions while a case is timed."""

    def move() -> None:
        a.assign_sub(1.0, read_value=False)
        b.assign_add(1.0, read_value=False)

    return Background(lambda: safevars.transaction([a, b], move))


def _busy_writer_case(ctx: Context) -> Case:
    with tf.device(ctx.device):
        a, b = safevars.SafeVariable(1e6, name="busy_a"), safevars.SafeVariable(0.0, name="busy_b")
    writer = _busy_writer(a, b)

    def plain_reads() -> None:
        writer.ensure_running()
        for _ in range(READS_PER_CALL):
            a.read_value(), b.read_value()

    def snapshot() -> None:
        writer.ensure_running()
        for _ in range(READS_PER_CALL):
            safevars.snapshot([a, b])

    def locked_reads() -> None:
        writer.ensure_running()
        for _ in range(READS_PER_CALL):
            with safevars.locked(a, b):
                a.read_value(), b.read_value()

    return Case(
        family=FAMILY,
        name="2 variables, busy writer",
        variants={
            "plain reads (may be torn)": plain_reads,
            "safevars.snapshot": snapshot,
            "safevars.locked": locked_reads,
        },
        ops_per_call=READS_PER_CALL,
        params={"variables": 2, "size": 1, "dtype": "float32", "writer": "busy"},
        goal=("safevars.snapshot", 1.0),
        goal_reference="safevars.locked",
        teardown=writer.close,
    )


def cases(ctx: Context) -> list[Case]:
    out = []
    for count in COUNTS:
        with tf.device(ctx.device):
            plain = [tf.Variable(float(i), name=f"plain_{i}") for i in range(count)]
            safe = [safevars.SafeVariable(float(i), name=f"safe_{i}") for i in range(count)]
            critical = [tf.Variable(float(i), name=f"critical_{i}") for i in range(count)]
            cs = tf.CriticalSection(name="bench_snapshot")

        def plain_reads(variables: list[Any] = plain) -> list[tf.Tensor]:
            return [v.read_value() for v in variables]

        def snapshot(variables: list[Any] = safe) -> Any:
            return safevars.snapshot(variables)

        def locked_reads(variables: list[Any] = safe) -> list[tf.Tensor]:
            with safevars.locked(*variables):
                return [v.read_value() for v in variables]

        def section_reads(variables: list[Any] = critical, cs: Any = cs) -> Any:
            return cs.execute(lambda: [v.read_value() for v in variables])

        out.append(
            Case(
                family=FAMILY,
                name=f"{count} variable{'' if count == 1 else 's'}",
                variants={
                    "N plain reads": plain_reads,
                    "safevars.snapshot": snapshot,
                    "safevars.locked": locked_reads,
                    "tf.CriticalSection": section_reads,
                },
                params={"variables": count, "size": 1, "dtype": "float32"},
            )
        )
    out.append(_busy_writer_case(ctx))
    return out
