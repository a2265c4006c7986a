"""Family 1: eager single operations, SafeVariable against plain ``tf.Variable``.

For ``read``, ``assign``, ``assign_add`` and ``update`` (read-modify-write ``x + 1``) on a
scalar, 1K and 1M elements (and 16M on a GPU), four variants, each on its own variable:

* ``tf.Variable``: the plain, unprotected op (the baseline; for ``update`` the racy
  ``v.assign(fn(v.read_value()))``);
* ``SafeVariable``: the same call on a :class:`safevars.SafeVariable` (``update`` is
  ``v.update(fn)``);
* ``threading.Lock``: the plain op inside a hand-written ``with lock:``;
* ``tf.CriticalSection``: the plain op inside ``cs.execute`` (TensorFlow's own mutex).

Writes are called with ``read_value=False`` everywhere, so the baseline does not pay for
the lazy read object that ``tf.Variable.assign*`` builds by default; the extra case
``assign_add(default)/scalar`` times the default call of both classes.

Goals (issue 7): scalar ``SafeVariable.assign_add`` at most 1.10x plain, and scalar
``SafeVariable.update`` at most 1.10x the hand-written lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

import safevars
from benchmarks.case import Case, Context, size_label

FAMILY = "eager"
DESCRIPTION = (
    "eager read/assign/assign_add/update: SafeVariable vs plain, threading.Lock, "
    "tf.CriticalSection"
)
ORDER = 1
SECONDS = {"full": 28, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide

OPS = ("read", "assign", "assign_add", "update")
GOAL_RATIO = 1.10


def shape_of(size: int) -> tuple[int, ...]:
    """A scalar for size 1, else a vector of ``size`` elements."""
    return () if size == 1 else (size,)


def plan(ctx: Context) -> list[tuple[str, int]]:
    """The ``(op, size)`` pairs measured on ``ctx`` (1M+ sizes on a GPU come from ctx)."""
    return [(op, size) for size in ctx.sizes for op in OPS]


class Subjects:
    """One variable per variant, all of one shape, on the context's device."""

    def __init__(self, size: int, device: str) -> None:
        shape = shape_of(size)
        with tf.device(device):
            self.plain = tf.Variable(tf.zeros(shape), name="plain")
            self.safe = safevars.SafeVariable(tf.zeros(shape), name="safe")
            self.locked = tf.Variable(tf.zeros(shape), name="locked")
            self.critical = tf.Variable(tf.zeros(shape), name="critical")
            self.cs = tf.CriticalSection(name="bench_eager")
            self.value = tf.fill(shape, 2.0)
            self.delta = tf.ones(shape)
            self.one = tf.constant(1.0)
        self.lock = threading.Lock()

    def increment(self, x: tf.Tensor) -> tf.Tensor:
        return x + self.one

    def variants(self, op: str) -> dict[str, Callable[[], Any]]:
        """The four variants of ``op``, in order (baseline first)."""
        plain, safe, locked, critical = self.plain, self.safe, self.locked, self.critical
        lock, cs, value, delta, inc = self.lock, self.cs, self.value, self.delta, self.increment

        if op == "read":

            def with_lock() -> Any:
                with lock:
                    return locked.read_value()

            return {
                "tf.Variable": lambda: plain.read_value(),
                "SafeVariable": lambda: safe.read_value(),
                "threading.Lock": with_lock,
                "tf.CriticalSection": lambda: cs.execute(lambda: critical.read_value()),
            }
        if op == "assign":

            def with_lock() -> Any:
                with lock:
                    return locked.assign(value, read_value=False)

            return {
                "tf.Variable": lambda: plain.assign(value, read_value=False),
                "SafeVariable": lambda: safe.assign(value, read_value=False),
                "threading.Lock": with_lock,
                "tf.CriticalSection": lambda: cs.execute(
                    lambda: critical.assign(value, read_value=False)
                ),
            }
        if op == "assign_add":

            def with_lock() -> Any:
                with lock:
                    return locked.assign_add(delta, read_value=False)

            return {
                "tf.Variable": lambda: plain.assign_add(delta, read_value=False),
                "SafeVariable": lambda: safe.assign_add(delta, read_value=False),
                "threading.Lock": with_lock,
                "tf.CriticalSection": lambda: cs.execute(
                    lambda: critical.assign_add(delta, read_value=False)
                ),
            }
        if op == "update":

            def racy() -> Any:
                new = inc(plain.read_value())
                plain.assign(new, read_value=False)
                return new

            def with_lock() -> Any:
                with lock:
                    new = inc(locked.read_value())
                    locked.assign(new, read_value=False)
                    return new

            def in_section() -> Any:
                new = inc(critical.read_value())
                critical.assign(new, read_value=False)
                return new

            return {
                "tf.Variable": racy,
                "SafeVariable": lambda: safe.update(inc),
                "threading.Lock": with_lock,
                "tf.CriticalSection": lambda: cs.execute(in_section),
            }
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def _goal(op: str, size: int) -> tuple[tuple[str, float] | None, str | None]:
    if size != 1:
        return None, None
    if op == "assign_add":
        return ("SafeVariable", GOAL_RATIO), None
    if op == "update":
        return ("SafeVariable", GOAL_RATIO), "threading.Lock"
    return None, None


def cases(ctx: Context) -> list[Case]:
    subjects: dict[int, Subjects] = {}
    out = []
    for op, size in plan(ctx):
        if size not in subjects:
            subjects[size] = Subjects(size, ctx.device)
        goal, reference = _goal(op, size)
        out.append(
            Case(
                family=FAMILY,
                name=f"{op}/{size_label(size)}",
                variants=subjects[size].variants(op),
                params={"op": op, "size": size, "dtype": "float32"},
                goal=goal,
                goal_reference=reference,
            )
        )
    # The default call (read_value=True): what most code writes.
    with tf.device(ctx.device):
        plain = tf.Variable(0.0, name="plain_default")
        safe = safevars.SafeVariable(0.0, name="safe_default")
        delta = tf.constant(1.0)
    out.append(
        Case(
            family=FAMILY,
            name="assign_add(default)/scalar",
            variants={
                "tf.Variable": lambda: plain.assign_add(delta),
                "SafeVariable": lambda: safe.assign_add(delta),
            },
            params={"op": "assign_add", "size": 1, "dtype": "float32", "read_value": True},
        )
    )
    return out
