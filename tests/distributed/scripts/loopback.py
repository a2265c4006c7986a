"""Loopback clusters for the test scripts: TF_CONFIG for MultiWorkerMirroredStrategy
workers, and the cluster spec and worker-server processes of parameter-server scripts.

The ``*_mwms.py`` scripts take ``WORKER_INDEX PORT0,PORT1[,...]``: every worker gets the
same ports list and calls :func:`set_tf_config` before importing TensorFlow. The
``*_ps.py`` scripts that kill workers run them as processes of their own: :func:`ps_spec`
picks the ports, :func:`serve` is what such a process runs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def set_tf_config(index: int, ports: str) -> None:
    """Sets ``TF_CONFIG`` (and quiet TensorFlow logs) for worker ``index`` of ``ports``."""
    workers = [f"127.0.0.1:{p}" for p in ports.split(",")]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def ps_spec(workers: int) -> dict[str, list[str]]:
    """A cluster spec of ``workers`` workers and one parameter server on free 127.0.0.1 ports."""
    import portpicker

    return {
        "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(workers)],
        "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
    }


def start_servers(spec: dict[str, list[str]], tasks: list[tuple[str, int]], threads: int) -> Any:
    """Starts the in-process servers of ``tasks`` (``(job, index)``) of cluster ``spec``.

    Workers get ``threads`` inter-op threads (every scheduled function and the
    coordinator's own need one each); returns the ``tf.train.ClusterSpec``.
    """
    import tensorflow as tf

    cluster = tf.train.ClusterSpec(spec)
    worker_config = tf.compat.v1.ConfigProto()
    worker_config.inter_op_parallelism_threads = threads
    for job, index in tasks:
        tf.distribute.Server(
            cluster,
            job_name=job,
            task_index=index,
            protocol="grpc",
            config=worker_config if job == "worker" else None,
            start=True,
        )
    return cluster


def serve(spec: str, job: str, index: int, threads: int) -> None:
    """Runs task ``job:index`` of the JSON cluster ``spec`` until the parent process ends.

    Prints ``ready`` once the server is up. Exits with the process that started it, even
    if that one is killed (TensorFlow servers cannot be stopped otherwise).
    """
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = threads
    server = tf.distribute.Server(
        tf.train.ClusterSpec(json.loads(spec)),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=config,
        start=True,
    )
    print("ready", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    del server
    os._exit(0)
