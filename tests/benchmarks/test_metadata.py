"""The run's metadata (:mod:`benchmarks.metadata`)."""

from __future__ import annotations

from benchmarks import devices, metadata, runner, schema
from tests.support.benchmark_fakes import GPU, tiny_settings


def test_gpu_metadata_is_recorded_and_valid():
    meta = metadata.collect(GPU, quick=True, command="python -m benchmarks --quick")
    assert meta["device"] == {
        "kind": "gpu",
        "name": "NVIDIA A100-SXM4-40GB",
        "tf_device": "/GPU:0",
        "details": {"visible_gpus": 1, "compute_capability": "8.0"},
    }
    assert meta["mode"] == "quick"
    assert meta["git_commit"] == "unknown" or len(meta["git_commit"]) == 40
    ctx = devices.make_context(GPU, quick=True)
    document = runner.build_document(meta, tiny_settings(), ctx, [])
    assert schema.validate(document) == []


def test_git_state_outside_a_repository_is_unknown(tmp_path):
    assert metadata.git_state(tmp_path) == ("unknown", None)
