"""Family 2: the eager family's operations inside ``tf.function``.

Each call runs one ``tf.function`` doing ``OPS_PER_CALL`` of the operation in sequence
(unrolled at trace time) on a scalar, 1K and 1M elements (16M on a GPU; ``--quick``
keeps the smallest and the largest size: tracing dominates its time), so the figures
are per operation with the call overhead shared. Variants, each on its own variable:

* ``tf.Variable``: the plain ops (the baseline; ``update`` is the racy
  ``v.assign(fn(v.read_value()))``);
* ``SafeVariable``: the same calls on a :class:`safevars.SafeVariable`; inside a graph
  every write runs in the variable's ``tf.CriticalSection`` and bumps its version
  variable (run-time mode);
* ``threading.Lock``: the plain function called inside a hand-written ``with lock:``
  (a Python lock cannot order ops *inside* a graph, so it is held around the call);
* ``tf.CriticalSection``: every plain op wrapped in ``cs.execute`` inside the graph.

Goals (issue 14), one per case: the scalar writes (``assign``, ``assign_add``,
``update``) at most 1.30x ``tf.Variable``; every other case (the reads, 1K and 1M)
at most 1.0x ``tf.CriticalSection``, the peer a ``SafeVariable`` replaces inside a graph.
The report gives every case's ratio to every variant with its interval as well, so the
scalar writes' ratio to ``tf.CriticalSection`` is there too.

The scalar writes' ratio is bimodal between runs: about 1.15-1.20 or about 1.31-1.37, a
case keeping one mode for its few seconds. Inside a graph a ``SafeVariable`` write takes its
lock with TensorFlow's ``MutexLock``, which always hands the rest of the function to the
mutex's own thread, and the caller waits for it: two thread wake-ups per call that a
plain function does not make. Their cost depends on where the scheduler puts the two
threads: in one process, with the process pinned to one core (``taskset -c 0``) the
same functions read 1.21-1.23x; on 2 cores 1.17-1.22x with one or two such functions
timed in turn and 1.31-1.38x with three or more (2026-11-27). A bare ``MutexLock``/``ConsumeMutexLock``
pair around the plain writes read 1.11x in the same A/B as ``SafeVariable`` 1.17x. Since
then the joined writes wait for the ``MutexLock`` itself, not for a gate op behind it
(:mod:`safevars.sections.gate`): over 5 passes ``assign`` 1.20 -> 1.16 and ``assign_add``
1.33 -> 1.27, every pass under 1.30 in either mode.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tensorflow as tf

import safevars
from benchmarks.bench_eager import OPS, shape_of
from benchmarks.case import Case, Context, size_label
from benchmarks.tf_functions import variant_function

FAMILY = "graph"
DESCRIPTION = (
    "the same ops inside tf.function: SafeVariable vs plain, threading.Lock around the "
    "call, tf.CriticalSection"
)
ORDER = 2
SECONDS = {"full": 30, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide

OPS_PER_CALL = 8
SCALAR_GOAL = 1.30  # SafeVariable / tf.Variable, scalar writes
PEER_GOAL = 1.0  # SafeVariable / tf.CriticalSection, the other cases


def _goal(op: str, size: int) -> tuple[tuple[str, float], str | None]:
    """The case's goal and its reference (None: the baseline, ``tf.Variable``)."""
    if size == 1 and op != "read":
        return ("SafeVariable", SCALAR_GOAL), None
    return ("SafeVariable", PEER_GOAL), "tf.CriticalSection"


def _body(
    op: str,
    variable: Any,
    value: tf.Tensor,
    delta: tf.Tensor,
    one: tf.Tensor,
    wrap: Callable[[Callable[[], Any]], Any],
) -> Callable[[], Any]:
    """A function doing ``OPS_PER_CALL`` times ``op`` on ``variable``, each through ``wrap``."""

    def one_op() -> Any:
        if op == "read":
            return variable.read_value()
        if op == "assign":
            return variable.assign(value, read_value=False)
        if op == "assign_add":
            return variable.assign_add(delta, read_value=False)
        if op == "update":
            if isinstance(variable, safevars.SafeVariable):
                return variable.update(lambda x: x + one)
            new = variable.read_value() + one
            variable.assign(new, read_value=False)
            return new
        raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")

    def body() -> Any:
        outputs = [wrap(one_op) for _ in range(OPS_PER_CALL)]
        # Return the reads so that nothing is pruned; writes are kept by auto-deps.
        return [o for o in outputs if isinstance(o, tf.Tensor)]

    return body


def _section(cs: tf.CriticalSection) -> Callable[[Callable[[], Any]], Any]:
    def wrap(fn: Callable[[], Any]) -> Any:
        def returning_tensor() -> Any:
            out = fn()
            return out if isinstance(out, tf.Tensor) else tf.constant(True)

        return cs.execute(returning_tensor)

    return wrap


def _direct(fn: Callable[[], Any]) -> Any:
    return fn()


def sizes(ctx: Context) -> tuple[int, ...]:
    """All of ``ctx.sizes``; with ``--quick`` only the smallest and the largest."""
    if ctx.quick and len(ctx.sizes) > 2:
        return (min(ctx.sizes), max(ctx.sizes))
    return tuple(ctx.sizes)


def cases(ctx: Context) -> list[Case]:
    out = []
    for size in sizes(ctx):
        shape = shape_of(size)
        with tf.device(ctx.device):
            plain = tf.Variable(tf.zeros(shape), name="plain")
            safe = safevars.SafeVariable(tf.zeros(shape), name="safe")
            locked = tf.Variable(tf.zeros(shape), name="locked")
            critical = tf.Variable(tf.zeros(shape), name="critical")
            cs = tf.CriticalSection(name="bench_graph")
            value = tf.fill(shape, 2.0)
            delta = tf.ones(shape)
            one = tf.constant(1.0)
        lock = threading.Lock()
        for op in OPS:

            def function(variable: Any, wrap: Callable[[Callable[[], Any]], Any]) -> Any:
                return variant_function(
                    _body(op, variable, value, delta, one, wrap), autograph=False
                )

            plain_fn = function(plain, _direct)
            safe_fn = function(safe, _direct)
            locked_fn = function(locked, _direct)
            critical_fn = function(critical, _section(cs))

            def with_lock(locked_fn: Callable[[], Any] = locked_fn) -> Any:
                with lock:
                    return locked_fn()

            goal, reference = _goal(op, size)
            out.append(
                Case(
                    family=FAMILY,
                    name=f"{op}/{size_label(size)}",
                    variants={
                        "tf.Variable": plain_fn,
                        "SafeVariable": safe_fn,
                        "threading.Lock": with_lock,
                        "tf.CriticalSection": critical_fn,
                    },
                    ops_per_call=OPS_PER_CALL,
                    params={
                        "op": op,
                        "size": size,
                        "dtype": "float32",
                        "ops_per_call": OPS_PER_CALL,
                    },
                    goal=goal,
                    goal_reference=reference,
                )
            )
    return out
