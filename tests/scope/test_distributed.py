"""safevars.scope() under MultiWorkerMirroredStrategy and ParameterServerStrategy, for real.

``distributed/scripts/scope_mwms.py`` builds a Keras model and a plain Keras optimizer inside
``strategy.scope()`` and ``safevars.scope()`` on each of two workers on 127.0.0.1 (a
process per worker), trains with all-reduced gradients, then writes by hand.
``distributed/scripts/scope_ps.py`` does the same on an in-process cluster of 3 workers and one
parameter server, with asynchronous workers. Each prints one JSON line. MirroredStrategy
is covered in-process by ``test_scope.py``.
"""

from __future__ import annotations

import pytest

from tests.distributed.cluster_harness import run_on_ports, run_together, script

WORKERS, STEPS = 2, 6
PS_WORKERS, PS_STEPS = 3, 60
CLUSTER_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def workers() -> list[dict]:
    return run_on_ports(
        WORKERS,
        lambda ports: [
            [script("scope_mwms.py"), str(i), ports, "--steps", str(STEPS)] for i in range(WORKERS)
        ],
        CLUSTER_TIMEOUT,
    )


@pytest.fixture(scope="module")
def ps() -> dict:
    command = [script("scope_ps.py"), "--workers", str(PS_WORKERS), "--steps", str(PS_STEPS)]
    (result,) = run_together([command], CLUSTER_TIMEOUT)
    return result


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


# --------------------------------------------------------------------- parameter servers


def test_asynchronous_workers_lose_no_step_of_a_plain_optimizer(ps):
    safe = ps["safe"]
    assert safe["safe"]
    # Constant gradients: any order of atomic steps gives the serial result, bitwise.
    assert safe["kernel"] == ps["reference"]["kernel"]
    assert safe["bias"] == ps["reference"]["bias"]
    assert safe["iterations"] == PS_STEPS
    # The plain run is scheduler-dependent (it loses steps here often); only reported.
    assert 0 < ps["plain"]["iterations"] <= PS_STEPS


def test_versions_on_the_parameter_server_count_the_steps(ps):
    safe = ps["safe"]
    assert safe["versions"] == [PS_STEPS, PS_STEPS]
    assert safe["iterations_version"] == PS_STEPS
    assert safe["slot_versions"] == [PS_STEPS, PS_STEPS]
    assert safe["snapshot_versions"] == [PS_STEPS, PS_STEPS]
    assert safe["bias_version_after_assign"] == PS_STEPS + 1
