"""What a strategy tells :class:`~safevars.ReplicaRNG`, and which uses it supports.

The worker part of every key: ``worker=`` if given, else the task of the current
strategy's ``cluster_resolver``, else ``TF_CONFIG``, else ``("worker", 0)``
(:func:`_detect_worker`); a ``ParameterServerStrategy`` coordinator is ``("chief", 0)``
by default (:data:`_COORDINATOR`). The supported-strategy check itself is
:func:`safevars.distribute.check_strategy`; :data:`_SUPPORTED_USES` is the sentence the
RNG's strategy errors end with.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from safevars.distribute import SUPPORTED_STRATEGIES

# The default identity of a ParameterServerStrategy coordinator (its TF_CONFIG task).
_COORDINATOR = ("chief", 0)

_SUPPORTED_USES = (
    "Supported: a ReplicaRNG created in (or outside) the scope of "
    + ", ".join(s for s in SUPPORTED_STRATEGIES if not s.startswith("ParameterServer"))
    + " and drawn in that strategy's replicas or outside any strategy; and a ReplicaRNG "
    "created in ParameterServerStrategy.scope() on the coordinator and drawn in "
    "tf.functions run by that strategy's ClusterCoordinator.schedule (or from "
    "rng.for_worker(w))."
)


def _detect_worker() -> tuple[str, int]:
    """``(task_type, task_id)`` of this process: strategy, then TF_CONFIG, then worker:0."""
    resolver = getattr(tf.distribute.get_strategy(), "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    if task_type:
        return str(task_type), int(getattr(resolver, "task_id", 0) or 0)
    try:
        task = json.loads(os.environ.get("TF_CONFIG", "") or "{}").get("task", {})
    except (ValueError, AttributeError):
        task = {}
    if isinstance(task, dict) and task.get("type"):
        return str(task["type"]), int(task.get("index", 0) or 0)
    return "worker", 0
