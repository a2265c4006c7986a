"""Loopback clusters for the test scripts: TF_CONFIG for MultiWorkerMirroredStrategy
workers, and the cluster spec and worker-server processes of parameter-server scripts.

The ``*_mwms.py`` scripts take ``WORKER_INDEX PORT0,PORT1[,...]``: every worker gets the
same ports list and calls :func:`set_tf_config` before importing TensorFlow. The
``*_ps.py`` scripts that kill workers run them as processes of their own: :func:`ps_spec`
picks the ports, :func:`serve` is what such a process runs when it is a new ``python``
process (``script --serve SPEC JOB INDEX``); :func:`start_server_process` forks it
instead from a ``multiprocessing`` forkserver that imported TensorFlow once (as
``tests/support/forked.py`` does for whole scripts), unless ``SAFEVARS_TEST_FORK=0``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
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


def _server(spec: str, job: str, index: int, threads: int) -> Any:
    """The started server of task ``job:index`` of the JSON cluster ``spec``."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = threads
    return tf.distribute.Server(
        tf.train.ClusterSpec(json.loads(spec)),
        job_name=job,
        task_index=index,
        protocol="grpc",
        config=config,
        start=True,
    )


def serve(spec: str, job: str, index: int, threads: int) -> None:
    """Runs task ``job:index`` of the JSON cluster ``spec`` until the parent process ends.

    Prints ``ready`` once the server is up. Exits with the process that started it, even
    if that one is killed (TensorFlow servers cannot be stopped otherwise).
    """
    server = _server(spec, job, index, threads)
    print("ready", flush=True)
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    del server
    os._exit(0)


def forking() -> bool:
    """Whether :func:`start_server_process` forks (the default), as
    ``tests/support/forked.py`` decides: not with ``SAFEVARS_TEST_FORK=0``."""
    return (
        os.environ.get("SAFEVARS_TEST_FORK", "1") != "0"
        and "forkserver" in multiprocessing.get_all_start_methods()
    )


class ServerProcess:
    """A server's process started by :func:`start_server_process`, up and serving."""

    def __init__(
        self,
        process: subprocess.Popen[str] | multiprocessing.process.BaseProcess,
        lifeline: Connection | None = None,
    ) -> None:
        self._process = process
        self._lifeline = lifeline
        self.pid = process.pid

    def poll(self) -> int | None:
        """The exit code, None while the process runs."""
        if isinstance(self._process, subprocess.Popen):
            return self._process.poll()
        return self._process.exitcode

    def kill(self) -> None:
        """Kills the process (SIGKILL) and waits for its end."""
        if self.poll() is None:
            self._process.kill()
        if isinstance(self._process, subprocess.Popen):
            self._process.wait()
        else:
            self._process.join()
        if self._lifeline is not None:
            self._lifeline.close()


def start_server_process(
    script: str, spec: dict[str, list[str]], job: str, index: int, threads: int, timeout: float
) -> ServerProcess:
    """Starts task ``job:index`` of cluster ``spec`` in a process of its own; returns once
    its server is up (it failed to start if nothing says so within ``timeout`` seconds).

    The process is forked from a forkserver that imported TensorFlow once: a new
    ``python`` process pays about 3.5 CPU-seconds importing it again. The first call
    starts the forkserver, a new executed ``python`` that only imports TensorFlow: it
    inherits no server, thread or eager context of the caller's. With
    ``SAFEVARS_TEST_FORK=0`` (or no forkserver start method) it is ``python script
    --serve SPEC JOB INDEX`` instead: ``script`` then calls :func:`serve`. Either way
    the process ends with the caller's, even if that one is killed.
    """
    if not forking():
        proc = subprocess.Popen(
            [sys.executable, script, "--serve", json.dumps(spec), job, str(index)],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline().strip() if proc.stdout else ""
        assert line == "ready", f"{job} {index} did not start: {line!r}"
        return ServerProcess(proc)
    context = multiprocessing.get_context("forkserver")
    # TensorFlow only (what serve imports); not __main__, the default: a script's
    # main would run in the forkserver.
    context.set_forkserver_preload(["tensorflow"])
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_serve_forked,
        args=(json.dumps(spec), job, index, threads, theirs),
        daemon=True,  # or multiprocessing's exit handler would wait for it for ever
    )
    process.start()
    theirs.close()  # Our copy of its end would hide its death: no EOF below.
    try:
        said = ours.recv() if ours.poll(timeout) else f"nothing within {timeout} s"
    except EOFError:  # it ended before its server was up
        process.join(timeout)
        said = f"exit code {process.exitcode}"
    started = ServerProcess(process, ours)
    if said != "ready":
        started.kill()
        raise AssertionError(f"{job} {index} did not start: {said!r}")
    return started


def _serve_forked(spec: str, job: str, index: int, threads: int, caller: Connection) -> None:
    """:func:`serve` in a forked process: says ``ready`` on ``caller``, then runs until
    the caller's end of it closes (its process ended, killed or not).

    Not until its parent ends, as serve waits: the parent is the forkserver, which ends
    only once every process it forked has closed its "alive" pipe (each inherits the
    pipe's write end), so a server waiting for the forkserver to end keeps it alive for
    ever, the caller killed or not.
    """
    server = _server(spec, job, index, threads)
    caller.send("ready")
    try:
        caller.recv()  # the caller sends nothing: EOF when its process ends
    except EOFError:
        pass
    del server
    os._exit(0)  # Not the forkserver's exit handlers (they are the forkserver's).
