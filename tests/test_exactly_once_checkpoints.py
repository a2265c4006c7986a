"""safevars.exactly_once tables in checkpoints: a killed coordinator, restored in a new one.

``distributed/scripts/exactly_once_restart.py`` runs a coordinator process with its own
loopback ParameterServerStrategy cluster (its servers die with it): it schedules every
step (token = step number) and takes checkpoints with a ``CheckpointManager`` while the
steps run; the test kills it (SIGKILL) as soon as it reports the saves. A second
process, on a new cluster, reads every checkpoint, restores the latest and schedules
every step again. Nothing is mocked.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading

import pytest

from tests.distributed.cluster_harness import last_json_line, run_together, script
from tests.support.deadlines import scaled

STEPS, SAVES = 160, 5
TIMEOUT = 240.0  # Seconds for each coordinator process; a bound on a hang, not timing.


def _first_coordinator(directory: str) -> dict:
    """Runs the first coordinator until it reports its saves, then kills it (SIGKILL)."""
    command = [
        sys.executable,
        script("exactly_once_restart.py"),
        "--phase",
        "first",
        "--dir",
        directory,
        "--steps",
        str(STEPS),
        "--saves",
        str(SAVES),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=scaled(TIMEOUT))
            assert line is not None, f"first coordinator ended:\n{proc.stderr.read()[-5000:]}"
            if line.startswith("{"):
                break
        alive_when_killed = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    result = last_json_line(line)
    result["alive_when_killed"] = alive_when_killed
    result["returncode"] = proc.returncode
    return result


@pytest.fixture(scope="module")
def restart(tmp_path_factory) -> dict:
    directory = str(tmp_path_factory.mktemp("exactly_once_checkpoints"))
    first = _first_coordinator(directory)
    (second,) = run_together(
        [
            [
                script("exactly_once_restart.py"),
                "--phase",
                "restore",
                "--dir",
                directory,
                "--steps",
                str(STEPS),
            ]
        ],
        TIMEOUT,
    )
    return {"first": first, "second": second}


def test_the_checkpoints_were_taken_while_steps_ran_and_the_coordinator_was_killed(restart):
    first = restart["first"]
    assert first["scheduled"] == STEPS
    assert first["running_after_each_save"] == [True] * SAVES
    assert first["alive_when_killed"] and first["returncode"] == -9  # SIGKILL
    assert len(first["checkpoints"]) == SAVES


def test_every_checkpoint_holds_an_entry_exactly_for_each_applied_section(restart):
    saved = restart["second"]["saved"]
    assert len(saved) == SAVES
    for entry in saved:
        assert entry["table"] == "exactly_once/ps_0/.ATTRIBUTES/table-keys"
        # Two sections per step (the update, the transaction): one entry for each
        # applied one, none for one whose writes the checkpoint lacks, and no
        # transaction seen half applied.
        assert entry["entries"] == entry["counter"] + entry["b"]
        assert entry["a"] + entry["b"] == 1000.0
        assert entry["b"] <= entry["counter"] <= entry["b"] + 2  # 2 workers: 2 in flight
    assert 0 < saved[-1]["counter"] < STEPS  # mid-run


def test_a_new_coordinator_restores_and_applies_each_step_exactly_once(restart):
    second = restart["second"]
    restored, final = second["restored"], second["final"]
    latest = second["saved"][-1]
    assert second["restored_path"].endswith(f"ckpt-{SAVES}")
    assert restored["counter"] == latest["counter"] and restored["b"] == latest["b"]
    assert restored["entries"] == latest["entries"]
    assert second["outcomes"] == {"done": STEPS}
    assert final["counter"] == final["b"] == STEPS and final["a"] == 1000.0 - STEPS
    assert final["versions"] == [STEPS, STEPS, STEPS]
    # Exactly the sections the checkpoint held were found applied and discarded.
    assert final["discarded"] == [restored["counter"], restored["b"], restored["b"]]
    assert final["entries"] == 2 * STEPS
