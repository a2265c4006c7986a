"""An in-process ``tf.distribute`` cluster on loopback, for trying and testing safevars.

This is TensorFlow's own engine (``tf.distribute.Server``), started the way TensorFlow's
``multi_worker_test_base.create_in_process_cluster`` does: one gRPC server per task, all
in this process, on free ``127.0.0.1`` ports. In-process servers cannot be shut down, so
start one cluster per process (tests run each cluster in a subprocess).
"""

from __future__ import annotations

import tensorflow as tf

from safevars.errors import InvalidArgumentError

__all__ = ["start_in_process_cluster"]

# Tries on fresh ports when a server cannot bind the one picked for it.
_ATTEMPTS = 5


def start_in_process_cluster(
    num_workers: int = 3, num_ps: int = 1
) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
    """Starts ``num_workers`` workers and ``num_ps`` parameter servers on 127.0.0.1.

    Returns:
      A cluster resolver for ``tf.distribute.experimental.ParameterServerStrategy``
      (this process is the coordinator).

    Raises:
      InvalidArgumentError: fewer than one worker or one parameter server.
      ImportError: ``portpicker`` is missing (``pip install portpicker``).
      tf.errors.UnknownError: a server could not bind its port in 5 attempts, each on
        fresh ports (a port found free can be taken before its server binds it).
    """
    if num_workers < 1 or num_ps < 1:
        raise InvalidArgumentError(
            f"start_in_process_cluster needs num_workers >= 1 and num_ps >= 1, got "
            f"num_workers={num_workers}, num_ps={num_ps}."
        )
    try:
        import portpicker
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "start_in_process_cluster needs portpicker: pip install portpicker"
        ) from e
    worker_config = tf.compat.v1.ConfigProto()
    # Workers may hang without enough inter-op threads (TensorFlow b/172296720).
    worker_config.inter_op_parallelism_threads = num_workers + 1
    for attempt in range(_ATTEMPTS):
        spec = {
            "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(num_workers)],
            "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(num_ps)],
        }
        cluster_spec = tf.train.ClusterSpec(spec)
        try:
            for job, config in (("worker", worker_config), ("ps", None)):
                for index in range(len(spec[job])):
                    tf.distribute.Server(
                        cluster_spec,
                        job_name=job,
                        task_index=index,
                        protocol="grpc",
                        config=config,
                        start=True,
                    )
        except tf.errors.UnknownError:
            # A port picked free was taken before its server bound it (another process
            # picking at the same time, or an outgoing connection given it by the OS):
            # "Could not start gRPC server". Servers already started cannot be shut down;
            # they stay idle, and the cluster starts again on fresh ports.
            if attempt == _ATTEMPTS - 1:
                raise
            continue
        break
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster_spec, rpc_layer="grpc")
