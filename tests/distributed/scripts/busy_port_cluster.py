"""start_in_process_cluster when a port it picks is taken before its server binds it.

Usage: python busy_port_cluster.py
Run it in its own process: in-process servers cannot be shut down.

The first port portpicker hands out is held by a listening socket of this process (as
when another process or an outgoing connection takes it between the pick and the
bind): the server for it cannot start ("Could not start gRPC server"). The cluster must
start on fresh ports and run a ParameterServerStrategy step. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import socket

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import portpicker  # noqa: E402
import tensorflow as tf  # noqa: E402

from safevars.local_cluster import start_in_process_cluster  # noqa: E402


def main() -> None:
    busy = portpicker.pick_unused_port()
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("0.0.0.0", busy))
    holder.listen()
    real, picks = portpicker.pick_unused_port, []

    def pick() -> int:
        port = busy if not picks else real()
        picks.append(port)
        return port

    portpicker.pick_unused_port = pick
    resolver = start_in_process_cluster(num_workers=2, num_ps=1)
    addresses = [
        a for job in resolver.cluster_spec().jobs for a in resolver.cluster_spec().job_tasks(job)
    ]
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        v = tf.Variable(0.0)

    @tf.function
    def step() -> tf.Tensor:
        return v.assign_add(1.0)

    for _ in range(4):
        coordinator.schedule(step)
    coordinator.join()
    print(
        json.dumps(
            {
                "busy_in_cluster": any(a.endswith(f":{busy}") for a in addresses),
                "picks": len(picks),
                "value": float(v.numpy()),
            }
        )
    )


if __name__ == "__main__":
    main()
