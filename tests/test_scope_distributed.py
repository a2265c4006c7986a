"""safevars.scope() under MultiWorkerMirroredStrategy, for real (a process per worker).

``distributed/scope_mwms.py`` builds a Keras model and a plain Keras optimizer inside
``strategy.scope()`` and ``safevars.scope()`` on each of two workers on 127.0.0.1, trains
with all-reduced gradients, then writes by hand; each worker prints one JSON line.
MirroredStrategy is covered in-process by ``test_scope.py``.
"""

from __future__ import annotations

import portpicker
import pytest
from cluster_harness import run_together, script

WORKERS, STEPS = 2, 6
CLUSTER_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def workers() -> list[dict]:
    ports = ",".join(str(portpicker.pick_unused_port()) for _ in range(WORKERS))
    return run_together(
        [[script("scope_mwms.py"), str(i), ports, "--steps", str(STEPS)] for i in range(WORKERS)],
        CLUSTER_TIMEOUT,
    )


def test_every_variable_keras_made_is_safe(workers):
    for result in workers:
        assert result["replicas"] == WORKERS
        assert result["weights_safe"] and result["slots_safe"] and result["iterations_safe"]


def test_versions_count_one_per_optimizer_step_on_every_worker(workers):
    for result in workers:
        assert result["iterations"] == STEPS
        assert result["iterations_version"] == STEPS
        assert result["versions_after_fit"] == {
            "sequential/dense/kernel": STEPS,
            "sequential/dense/bias": STEPS,
        }
        assert result["snapshot_versions"] == [STEPS, STEPS]


def test_workers_hold_the_same_weights_bitwise(workers):
    first = workers[0]
    assert len(first["losses"]) == STEPS
    for result in workers[1:]:
        assert result["fitted"] == first["fitted"]
        assert result["losses"] == first["losses"]


def test_writes_by_hand_are_counted_and_a_snapshot_restores(workers):
    for result in workers:
        assert result["kernel_version_after_assign"] == STEPS + 1
        # set_weights writes each weight once.
        assert result["versions_after_set_weights"] == {
            "sequential/dense/kernel": STEPS + 2,
            "sequential/dense/bias": STEPS + 1,
        }
        assert result["restored"] == result["fitted"]
