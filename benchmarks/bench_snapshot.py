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
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

import safevars
from benchmarks.case import Case, Context

FAMILY = "snapshot"
DESCRIPTION = (
    "consistent snapshot of N variables: safevars.snapshot vs N plain reads, "
    "safevars.locked, tf.CriticalSection"
)
ORDER = 5

COUNTS = (1, 8, 64)


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

        out.append(Case(
            family=FAMILY,
            name=f"{count} variable{'' if count == 1 else 's'}",
            variants={
                "N plain reads": plain_reads,
                "safevars.snapshot": snapshot,
                "safevars.locked": locked_reads,
                "tf.CriticalSection": section_reads,
            },
            params={"variables": count, "size": 1, "dtype": "float32"},
        ))
    return out
