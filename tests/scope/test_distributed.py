"""safevars.scope() under MultiWorkerMirroredStrategy and ParameterServerStrategy, for real.

``distributed/scripts/scope_mwms.py`` builds a Keras model and a plain Keras optimizer inside
``strategy.scope()`` and ``safevars.scope()`` on each of two workers on 127.0.0.1 (a
process per worker), trains with all-reduced gradients, then writes by hand.
``distributed/scripts/scope_ps.py`` does the same on an in-process cluster of 3 workers and one
parameter server, with asynchronous workers. Each also protects a model built plainly
(``safevars.protect``) and trains it the same way. Each prints one JSON line. MirroredStrategy
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


def runs(workers: list[dict], how: str) -> list[dict]:
    """Each worker's results for the model built in the scope, or protected after."""
    return workers if how == "scope" else [result["protected"] for result in workers]


@pytest.mark.parametrize("how", ["scope", "protected"])
def test_every_variable_keras_made_is_safe(workers, how):
    assert all(result["replicas"] == WORKERS for result in workers)
    for result in runs(workers, how):
        assert result["weights_safe"] and result["slots_safe"] and result["iterations_safe"]


@pytest.mark.parametrize("how", ["scope", "protected"])
def test_versions_count_one_per_optimizer_step_on_every_worker(workers, how):
    for result in runs(workers, how):
        assert result["iterations"] == STEPS
        assert result["iterations_version"] == STEPS
        assert result["versions_after_fit"] == {"kernel": STEPS, "bias": STEPS}
        assert result["snapshot_versions"] == [STEPS, STEPS]


@pytest.mark.parametrize("how", ["scope", "protected"])
def test_workers_hold_the_same_weights_bitwise(workers, how):
    first, *others = runs(workers, how)
    assert len(first["losses"]) == STEPS
    for result in others:
        assert result["fitted"] == first["fitted"]
        assert result["losses"] == first["losses"]


@pytest.mark.parametrize("how", ["scope", "protected"])
def test_writes_by_hand_are_counted_and_a_snapshot_restores(workers, how):
    for result in runs(workers, how):
        assert result["kernel_version_after_assign"] == STEPS + 1
        # set_weights writes each weight once.
        assert result["versions_after_set_weights"] == {
            "kernel": STEPS + 2,
            "bias": STEPS + 1,
        }
        assert result["restored"] == result["fitted"]


# --------------------------------------------------------------------- parameter servers


@pytest.mark.parametrize("how", ["safe", "protected"])
def test_asynchronous_workers_lose_no_step_of_a_plain_optimizer(ps, how):
    """Built in the scope, or built plainly and then ``safevars.protect`` -ed."""
    safe = ps[how]
    assert safe["safe"]
    # Constant gradients: any order of atomic steps gives the serial result, bitwise.
    assert safe["kernel"] == ps["reference"]["kernel"]
    assert safe["bias"] == ps["reference"]["bias"]
    assert safe["iterations"] == PS_STEPS
    # The plain run is scheduler-dependent (it loses steps here often); only reported.
    assert 0 < ps["plain"]["iterations"] <= PS_STEPS


@pytest.mark.parametrize("how", ["safe", "protected"])
def test_versions_on_the_parameter_server_count_the_steps(ps, how):
    safe = ps[how]
    assert safe["versions"] == [PS_STEPS, PS_STEPS]
    assert safe["iterations_version"] == PS_STEPS
    assert safe["slot_versions"] == [PS_STEPS, PS_STEPS]
    assert safe["snapshot_versions"] == [PS_STEPS, PS_STEPS]
    assert safe["bias_version_after_assign"] == PS_STEPS + 1
