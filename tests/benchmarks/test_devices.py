"""Choosing the device and its sizes (:mod:`benchmarks.devices`), with fake GPUs."""

from __future__ import annotations

import pytest

from benchmarks import bench_eager, bench_graph, devices
from benchmarks.case import size_label
from tests.support.benchmark_fakes import CPU, GPU, FakeGPU, fake_details


def test_default_device_is_the_gpu_when_one_is_visible():
    choice = devices.select_device(None, gpus=[FakeGPU()], details=fake_details)
    assert (choice.kind, choice.device) == ("gpu", "/GPU:0")
    assert choice.name == "NVIDIA A100-SXM4-40GB"
    assert choice.details == {"visible_gpus": 1, "compute_capability": "8.0"}


def test_cpu_is_chosen_without_gpu_or_on_request():
    assert devices.select_device(None, gpus=[]).kind == "cpu"
    chosen = devices.select_device("cpu", gpus=[FakeGPU()], details=fake_details)
    assert (chosen.kind, chosen.device) == ("cpu", "/CPU:0")


def test_gpu_requested_without_gpu_names_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(devices.DeviceUnavailableError) as info:
        devices.select_device("gpu", gpus=[])
    message = str(info.value)
    assert "--device cpu" in message and "tensorflow[and-cuda]" in message


def test_gpu_context_includes_gpu_only_large_sizes():
    gpu_ctx = devices.make_context(GPU, quick=True)
    cpu_ctx = devices.make_context(CPU, quick=True)
    assert gpu_ctx.device == "/GPU:0" and gpu_ctx.device_kind == "gpu"
    assert max(gpu_ctx.sizes) >= 16_000_000 and 1_000_000 in gpu_ctx.sizes
    assert max(cpu_ctx.sizes) == 1_000_000
    assert ("assign_add", 16_000_000) in bench_eager.plan(gpu_ctx)
    assert ("update", 16_000_000) in bench_eager.plan(gpu_ctx)
    assert all(size <= 1_000_000 for _, size in bench_eager.plan(cpu_ctx))
    assert 16_000_000 in bench_graph.sizes(gpu_ctx)
    assert size_label(16_000_000) == "16M"


def test_device_sync_only_on_gpu():
    import tensorflow as tf

    assert devices.device_sync_for(CPU) is None
    assert devices.device_sync_for(GPU) is tf.test.experimental.sync_devices
