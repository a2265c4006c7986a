"""safevars.local_cluster.start_in_process_cluster: a port taken between its pick and its
server's bind does not fail the cluster (it starts again on fresh ports).

Seen in a full test run: two clusters started at once in two processes, one server
"Could not start gRPC server" on a port portpicker had found free.
"""

from __future__ import annotations

from tests.distributed.cluster_harness import run_together, script

CLUSTER_TIMEOUT = 300.0


def test_a_port_taken_before_its_server_binds_it_is_replaced():
    (result,) = run_together([[script("busy_port_cluster.py")]], CLUSTER_TIMEOUT)
    assert not result["busy_in_cluster"]
    assert result["picks"] == 6  # 3 ports, twice: the first attempt failed on the first
    assert result["value"] == 4.0
