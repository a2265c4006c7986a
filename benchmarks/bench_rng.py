"""Family ``rng``: the cost of a ReplicaRNG draw against TensorFlow's own random ops.

For every size of ``ctx.sizes`` (a scalar, 1K and 1M elements by default; ``--quick``
keeps the smallest and the largest) and both modes (eager, and a ``tf.function`` doing
several draws per call, see :func:`graph_draws`, so the call overhead is shared), two
cases time a standard-normal draw of the same shape and dtype:

* ``normal/<mode>/<size>``: ``tf.random.Generator.normal`` (the baseline) against
  ``ReplicaRNG.normal`` (which looks up the current replica, then draws);
* ``normal_vs_stateless/<mode>/<size>``: ``tf.random.stateless_normal`` (the
  baseline; eagerly with a fixed seed tensor, in a graph with one seed per draw derived
  from a function argument, see :func:`_variants`) against the same
  ``ReplicaRNG.normal``.

The issue's goal, recorded on both cases: a ReplicaRNG draw costs at most 1.05× the
baseline's. Every variant returns its draws, so no graph prunes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from benchmarks.case import Case, Context, size_label
from benchmarks.tf_functions import variant_function
from safevars.rng import ReplicaRNG

FAMILY = "rng"
ORDER = 7
SECONDS = {"full": 15, "quick": 2}  # on a quiet 2-core CPU, estimated: see the guide
DESCRIPTION = (
    "ReplicaRNG.normal vs tf.random.Generator.normal and tf.random.stateless_normal, "
    "same shapes, eager and tf.function"
)

GOAL = 1.05
SEED = 1234


def graph_draws(size: int) -> int:
    """Draws per ``tf.function`` call: 8, or 2 from 100K elements (keeps calls short)."""
    return 8 if size < 100_000 else 2


def sizes(ctx: Context) -> tuple[int, ...]:
    """All of ``ctx.sizes``; with ``--quick`` only the smallest and the largest."""
    if ctx.quick and len(ctx.sizes) > 2:
        return (min(ctx.sizes), max(ctx.sizes))
    return tuple(ctx.sizes)


def _variants(
    size: int, shape: list[int], ctx: Context, mode: str
) -> dict[str, Callable[[], Any]]:
    """One call per variant: Generator, stateless, ReplicaRNG, all on ``ctx.device``.

    Eagerly every call draws once. In graph mode every call runs a ``tf.function``
    doing ``graph_draws(size)`` draws and returning them all. The stateless baseline gets its
    seed as a function *argument* and derives one seed per draw from it (``[seed, i]``):
    with a constant seed Grappler would fold the draws into constants and merge the
    identical ones, timing nothing.
    """
    with tf.device(ctx.device):
        generator = tf.random.Generator.from_seed(SEED)
        seed = tf.constant([SEED, 0], tf.int64)
        base = tf.constant(SEED, tf.int64)
        rng = ReplicaRNG(SEED)
    count = graph_draws(size)
    if mode == "eager":
        return {
            "tf.random.Generator.normal": lambda: generator.normal(shape),
            "tf.random.stateless_normal": lambda: tf.random.stateless_normal(shape, seed),
            "ReplicaRNG.normal": lambda: rng.normal(shape),
        }

    def graph(draw: Callable[[Any, int], Any]) -> Callable[[Any], Any]:
        def body(base: Any) -> list[Any]:
            with tf.device(ctx.device):
                return [draw(base, i) for i in range(count)]

        return variant_function(body, autograph=False)

    generator_fn = graph(lambda base, i: generator.normal(shape))
    stateless_fn = graph(
        lambda base, i: tf.random.stateless_normal(
            shape, tf.stack([base, tf.constant(i, tf.int64)])
        )
    )
    rng_fn = graph(lambda base, i: rng.normal(shape))
    return {
        "tf.random.Generator.normal": lambda: generator_fn(base),
        "tf.random.stateless_normal": lambda: stateless_fn(base),
        "ReplicaRNG.normal": lambda: rng_fn(base),
    }


def cases(ctx: Context) -> list[Case]:
    out = []
    for mode in ("eager", "graph"):
        for size in sizes(ctx):
            shape = [] if size == 1 else [size]
            draws = _variants(size, shape, ctx, mode)
            ops = 1 if mode == "eager" else graph_draws(size)
            label = size_label(size)
            params = {"size": size, "mode": mode, "dtype": "float32", "draws_per_call": ops}
            for name, baseline in (
                ("normal", "tf.random.Generator.normal"),
                ("normal_vs_stateless", "tf.random.stateless_normal"),
            ):
                out.append(
                    Case(
                        family=FAMILY,
                        name=f"{name}/{mode}/{label}",
                        variants={
                            baseline: draws[baseline],
                            "ReplicaRNG.normal": draws["ReplicaRNG.normal"],
                        },
                        ops_per_call=ops,
                        params=dict(params, baseline=baseline),
                        goal=("ReplicaRNG.normal", GOAL),
                    )
                )
    return out
