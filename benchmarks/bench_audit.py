"""Family "audit": what ``safevars.audit()`` costs while it is active.

Every case times the same eager work on a plain ``tf.Variable`` twice, A/B interleaved:

* ``inactive`` (the baseline): no audit. Nothing is patched when no audit is active, so
  this is also what code pays after an audit ended (the audit tests check that every
  patched function is the original again);
* ``audit active``: the same work inside ``with safevars.audit():``. The block is
  entered and left once per call of the variant, around ``OPS_PER_CALL`` operations
  (``LARGE_OPS_PER_CALL`` from 100,000 elements), so
  the installation of the patches is amortized; the ``enter_exit`` case times it alone.

Cases: ``read`` (``read_value``), ``assign`` (``read_value=False``) and
``read_modify_write`` (``v.assign(v.read_value() + 1)``, the pattern the audit looks
for) on a scalar, 1K elements and the context's sizes; ``locked_read_modify_write``, the
same under a ``threading.Lock`` made in the timed call (inside the audit it is one of the
audit's tracked locks: each acquire and release also moves a vector clock); a
``tf.function`` call (traced inside an audit, so each call replays its two traced
accesses); and ``enter_exit`` (``with safevars.audit(): pass`` against
``contextlib.nullcontext()``: the patches installed, the project's modules and running
frames searched for locks made before the audit, everything undone). One thread: the
audit's cost is per access (a bookkeeping lock, a short stack walk, the run's record for
torn reads), not contention; every case runs with the synchronization tracking on, as
every audit does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from benchmarks.case import Case, Context, size_label
from safevars.audit import audit

FAMILY = "audit"
DESCRIPTION = "eager reads/writes of a plain tf.Variable: audit active vs inactive"
ORDER = 8
SECONDS = {"full": 12, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide

OPS = ("read", "assign", "read_modify_write", "locked_read_modify_write")
OPS_PER_CALL = 100
#: Operations per call from 100,000 elements: a call of 100 read-modify-writes of 1M
#: elements took about 0.1 s, so its rounds were most of the family's time (issue 44);
#: the audit's cost is per access, so the ratio does not depend on the count.
LARGE_OPS_PER_CALL = 10


def ops_per_call(size: int) -> int:
    """Operations per call of the cases of ``size`` elements."""
    return LARGE_OPS_PER_CALL if size >= 100_000 else OPS_PER_CALL


def _work(op: str, v: tf.Variable, value: tf.Tensor, n: int) -> Callable[[], Any]:
    if op == "read":

        def work() -> None:
            for _ in range(n):
                v.read_value()
    elif op == "assign":

        def work() -> None:
            for _ in range(n):
                v.assign(value, read_value=False)
    elif op == "read_modify_write":

        def work() -> None:
            for _ in range(n):
                v.assign(v.read_value() + value, read_value=False)
    elif op == "locked_read_modify_write":

        def work() -> None:
            lock = threading.Lock()  # inside the audit: a tracked lock
            for _ in range(n):
                with lock:
                    v.assign(v.read_value() + value, read_value=False)
    else:
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")
    return work


def _pair(work: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    def audited() -> dict[str, Any]:
        with audit() as report:
            work()
        return {"races": len(report.races)}

    return {"inactive": work, "audit active": audited}


def cases(ctx: Context) -> list[Case]:
    out = []
    sizes = sorted({1, 1_000, *ctx.sizes})
    for size in sizes:
        n = ops_per_call(size)
        shape = () if size == 1 else (size,)
        with tf.device(ctx.device):
            v = tf.Variable(tf.zeros(shape), name=f"audited_{size_label(size)}")
            value = tf.ones(shape)
        for op in OPS:
            out.append(
                Case(
                    family=FAMILY,
                    name=f"{op}/{size_label(size)}",
                    variants=_pair(_work(op, v, value, n)),
                    ops_per_call=n,
                    params={"op": op, "size": size, "dtype": "float32", "threads": 1},
                )
            )

    with tf.device(ctx.device):
        counter = tf.Variable(0.0, name="audited_function_counter")
    with audit():  # Traced inside an audit: its calls replay the traced accesses.

        @tf.function
        def step() -> None:
            counter.assign(counter.read_value() + 1.0)

        step()

    def calls() -> None:
        for _ in range(OPS_PER_CALL):
            step()

    out.append(
        Case(
            family=FAMILY,
            name="tf.function_call/scalar",
            variants=_pair(calls),
            ops_per_call=OPS_PER_CALL,
            params={"op": "tf.function read_modify_write", "size": 1, "threads": 1},
        )
    )

    def audited_block() -> None:
        with audit():
            pass

    out.append(
        Case(
            family=FAMILY,
            name="enter_exit",
            variants={"nullcontext": contextlib.nullcontext, "audit active": audited_block},
            params={"op": "with safevars.audit(): pass"},
        )
    )
    return out
