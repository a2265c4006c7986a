"""The scope family's cases: which sizes a full run and a quick run measure."""

from __future__ import annotations

import safevars
from benchmarks import bench_scope
from benchmarks.case import Context


def _names(quick: bool) -> list[str]:
    ctx = Context(quick=quick, device="/CPU:0", device_kind="cpu", sizes=(1,), threads=(1,))
    return [case.name for case in bench_scope.cases(ctx)]  # (lazy: nothing is built)


def test_a_full_run_snapshots_a_four_weight_model_and_runs_every_workload_from_20():
    names = _names(quick=False)
    assert len(names) == len(set(names))
    assert [n for n in names if n.endswith("/v4")] == [
        "snapshot/v4",
        "snapshot_while_training/v4",
    ]
    assert [n for n in names if n.startswith("train_on_batch/")] == ["train_on_batch/v20"]
    for size in (20, 50, 100):
        assert {n.split("/")[0] for n in names if n.endswith(f"/v{size}")} == {
            "custom_step",
            "fit_safe",
            "fit_plain_inside",
            "fit_protected",
            "fit_plain_outside",
            "xla_step",
            "snapshot",
            "snapshot_while_training",
        } | ({"train_on_batch"} if size == 20 else set())


def test_a_quick_run_measures_every_workload_at_four_weights_only():
    names = _names(quick=True)
    assert all(n.endswith("/v4") for n in names)
    assert len(names) == 8


def test_the_train_on_batch_case_trains_the_scope_model_against_the_plain_one():
    case = bench_scope._train_on_batch_case(1)
    assert list(case.variants) == ["Adam", "scope + Adam, compiled inside"]
    assert case.goal == ("scope + Adam, compiled inside", bench_scope.GOAL)
    for variant in case.variants.values():
        variant()
    models = [variant.func.__self__ for variant in case.variants.values()]
    assert [safevars.is_protected(model) for model in models] == [False, True]
