"""Family 8 (optional): safevars under tf.distribute.

* ``ps/update``: an in-process ParameterServerStrategy cluster (3 workers, 1 PS on
  127.0.0.1) runs ``steps`` scheduled ``tf.function`` steps per call, read-then-write on
  a plain variable (racy, the baseline) against ``SafeVariable.update`` and against the
  same read-then-write inside a ``tf.CriticalSection`` created on the PS (what the issue
  measured at about 1.3x). Lost updates are recorded per call. safevars runs the
  critical section's ops on the PS (see ``safevars.sections.section._section_device``); the
  hand-written section runs its read and add on the worker. Issue goal: safe throughput at least 0.75x racy, i.e. a time ratio
  of at most 1/0.75.
(The MirroredStrategy training-step ratio lives in the ``training`` family.)

Not run by default (``--cases distributed``): it starts gRPC servers that live until the
process exits, and needs ``portpicker``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

import safevars
from benchmarks.case import Case, Context

FAMILY = "distributed"
DESCRIPTION = "ParameterServerStrategy: SafeVariable.update vs racy read-then-write"
DEFAULT = False
ORDER = 9
SECONDS = {"full": 30, "quick": 10}  # on a quiet 2-core CPU, estimated: see the guide

WORKERS = 3
_cluster: dict[str, Any] = {}


def _coordinator() -> tuple[Any, Any]:
    """One in-process cluster per benchmark process (servers cannot be shut down)."""
    if not _cluster:
        from safevars.local_cluster import start_in_process_cluster

        strategy = tf.distribute.experimental.ParameterServerStrategy(
            start_in_process_cluster(WORKERS, 1)
        )
        _cluster["strategy"] = strategy
        _cluster["coordinator"] = tf.distribute.experimental.coordinator.ClusterCoordinator(
            strategy
        )
    return _cluster["strategy"], _cluster["coordinator"]


def _ps_case(ctx: Context) -> Case:
    strategy, coordinator = _coordinator()
    steps = 30 if ctx.quick else 300
    with strategy.scope():
        plain = tf.Variable(0.0)
        safe = safevars.SafeVariable(0.0)
        guarded = tf.Variable(0.0)
        with tf.device(guarded.device):
            section = tf.CriticalSection()

    @tf.function
    def racy_step() -> None:
        plain.assign(plain.read_value() + 1.0)

    @tf.function
    def critical_step() -> None:
        section.execute(lambda: guarded.assign(guarded.read_value() + 1.0))

    @tf.function
    def safe_step() -> None:
        safe.update(lambda x: x + 1.0)

    def schedule(step: Any, variable: Any) -> dict[str, int]:
        before = float(variable.numpy())
        for _ in range(steps):
            coordinator.schedule(step)
        coordinator.join()
        return {"lost_updates": int(steps - (float(variable.numpy()) - before))}

    return Case(
        family=FAMILY,
        name="ps/update",
        variants={
            "tf.Variable read-then-write (racy)": lambda: schedule(racy_step, plain),
            "SafeVariable.update": lambda: schedule(safe_step, safe),
            "tf.CriticalSection on the PS": lambda: schedule(critical_step, guarded),
        },
        ops_per_call=steps,
        params={"workers": WORKERS, "ps": 1, "steps_per_call": steps},
        goal=("SafeVariable.update", round(1 / 0.75, 3)),
    )


def cases(ctx: Context) -> list[Case]:
    return [_ps_case(ctx)]
