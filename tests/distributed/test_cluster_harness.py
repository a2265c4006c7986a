"""The subprocess harness of the distributed tests (``tests/distributed/cluster_harness.py``)."""

from __future__ import annotations

import socket
import time

import pytest

from tests.distributed import cluster_harness
from tests.distributed.cluster_harness import run_on_ports, run_together, script
from tests.support.deadlines import scaled

CLUSTER_TIMEOUT = 300.0  # Seconds (the harness scales them); a bound on a hang.
SLEEPER = ["-c", "import time; time.sleep(120)"]


def test_mwms_group_runs_again_on_fresh_ports_when_a_port_is_taken(monkeypatch):
    # The first port picked is held by a listening socket, as when another process takes
    # it between portpicker finding it free and the worker's server binding it.
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    real = cluster_harness.portpicker.pick_unused_port
    picks: list[int] = []

    def pick() -> int:
        picks.append(real() if picks else port)
        return picks[-1]

    monkeypatch.setattr(cluster_harness.portpicker, "pick_unused_port", pick)
    groups: list[str] = []

    def commands(ports: str) -> list[list[str]]:
        groups.append(ports)
        return [[script("mwms_worker.py"), str(i), ports, "--steps", "2"] for i in range(2)]

    try:
        results = run_on_ports(2, commands, CLUSTER_TIMEOUT)
    finally:
        held.close()
    assert len(groups) == 2 and groups[0].startswith(f"{port},")
    assert str(port) not in groups[1].split(",")
    for result in results:
        assert result["replicas"] == 2
        assert result["counter"] == 4.0 and result["counter_version"] == 4


def test_other_failures_are_not_run_again():
    groups: list[str] = []

    def commands(ports: str) -> list[list[str]]:
        groups.append(ports)
        return [["-c", "import sys; print('Could not start', file=sys.stderr); sys.exit(3)"]]

    with pytest.raises(AssertionError, match=r"failed \(3\)"):
        run_on_ports(1, commands, CLUSTER_TIMEOUT)
    assert len(groups) == 1


def test_a_failed_process_ends_its_group():
    # A worker whose peer died waits forever on its collectives: the sleeper is killed a
    # few seconds after the other failed, not at the deadline.
    started = time.monotonic()
    # Listed after the sleeper, the failed process is still the one reported.
    with pytest.raises(AssertionError, match=r"failed \(3\)"):
        run_together([SLEEPER, ["-c", "import sys; sys.exit(3)"]], CLUSTER_TIMEOUT)
    assert time.monotonic() - started < scaled(CLUSTER_TIMEOUT) / 2


def test_a_process_past_the_deadline_is_killed_and_named():
    with pytest.raises(AssertionError, match=f"did not end within {scaled(3.0)} s"):
        run_together([SLEEPER], 3.0)


FAILS_ONCE = """
import os, sys
path, message = sys.argv[1:3]
first = not os.path.exists(path)
open(path, "a").write("x")
if first:
    sys.exit(print(message, file=sys.stderr) or 1)
print('{"attempts": %d}' % len(open(path).read()))
"""


@pytest.mark.parametrize(
    "message",
    [
        # The parameter-server scripts pick their ports themselves: running them again
        # picks new ones.
        "UnknownError: Could not start gRPC server",
        # TensorFlow's coordinator after a worker was killed (seen once under .ci/run).
        'InternalError: ... {grpc_message:"Unable to parse request", grpc_status:13}',
    ],
)
def test_a_script_that_lost_its_port_or_hit_a_transport_error_runs_again(tmp_path, message):
    command = ["-c", FAILS_ONCE, str(tmp_path / "attempts"), message]
    (result,) = run_together([command], CLUSTER_TIMEOUT)
    assert result == {"attempts": 2}


def test_a_transport_error_that_persists_fails_after_the_last_attempt(tmp_path):
    path = tmp_path / "attempts"
    always = f"open({str(path)!r}, 'a').write('x'); raise SystemExit('Unable to parse request')"
    with pytest.raises(AssertionError, match="Unable to parse request"):
        run_together([["-c", always]], CLUSTER_TIMEOUT)
    assert path.read_text() == "x" * cluster_harness.ATTEMPTS
