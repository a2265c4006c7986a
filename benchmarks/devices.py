"""Choosing the device the suite runs on, and the sizes that matter on it.

The default is the GPU whenever TensorFlow sees one, else the CPU. ``--device gpu``
without a visible GPU is an error that says how to get one. Everything that asks
TensorFlow about devices is injectable (``gpus=``, ``details=``) so the GPU path is
tested on machines without one.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.case import Context

__all__ = [
    "CPU_SIZES",
    "GPU_ONLY_SIZES",
    "THREADS",
    "DeviceChoice",
    "DeviceUnavailableError",
    "device_sync_for",
    "list_gpus",
    "make_context",
    "select_device",
    "sizes_for",
]

#: Element counts of size-parametrized cases on every device: a scalar, 1K and 1M.
CPU_SIZES: tuple[int, ...] = (1, 1_000, 1_000_000)
#: Extra element counts on a GPU, where large tensors are what the device is for.
GPU_ONLY_SIZES: tuple[int, ...] = (16_000_000,)
#: Thread counts of the contention cases.
THREADS: tuple[int, ...] = (1, 2, 4, 8)


class DeviceUnavailableError(RuntimeError):
    """``--device gpu`` was asked for but TensorFlow sees no GPU. Says how to fix it."""


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """The device the suite runs on.

    Attributes:
      kind: ``"cpu"`` or ``"gpu"``.
      device: The TensorFlow device string variables are placed on (``"/GPU:0"``).
      name: A human-readable name (GPU model, or CPU model from ``/proc/cpuinfo``).
      details: Extra facts for the metadata (compute capability, visible GPU count...).
    """

    kind: str
    device: str
    name: str
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


def list_gpus() -> list[Any]:
    """The physical GPUs TensorFlow sees (imports TensorFlow)."""
    import tensorflow as tf

    return list(tf.config.list_physical_devices("GPU"))


def _gpu_details(gpu: Any) -> dict[str, Any]:
    import tensorflow as tf

    try:
        return dict(tf.config.experimental.get_device_details(gpu))
    except (ValueError, RuntimeError, AttributeError):
        return {}


def cpu_name() -> str:
    """The CPU model: ``/proc/cpuinfo``'s model name, else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def select_device(
    requested: str | None,
    gpus: Sequence[Any] | None = None,
    details: Callable[[Any], dict[str, Any]] = _gpu_details,
) -> DeviceChoice:
    """The device to run on.

    Args:
      requested: ``"cpu"``, ``"gpu"`` or ``None`` (the GPU if there is one, else the CPU).
      gpus: The visible physical GPUs (default: ask TensorFlow).
      details: Returns a GPU's details (``tf.config.experimental.get_device_details``).

    Raises:
      DeviceUnavailableError: ``requested == "gpu"`` and there is no GPU.
      ValueError: ``requested`` is something else.
    """
    if requested not in (None, "cpu", "gpu"):
        raise ValueError(f"--device must be 'cpu' or 'gpu', got {requested!r}.")
    if gpus is None:
        gpus = list_gpus()
    gpus = list(gpus or [])
    if requested == "gpu" and not gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = (
            f" CUDA_VISIBLE_DEVICES is set to {visible!r}; unset it or list a GPU there."
            if visible is not None
            else ""
        )
        raise DeviceUnavailableError(
            "--device gpu: TensorFlow sees no GPU on this machine. Install a CUDA build "
            "of TensorFlow (pip install 'tensorflow[and-cuda]'), check that nvidia-smi "
            f"lists a GPU, or run on the CPU with --device cpu.{hint}"
        )
    if gpus and requested != "cpu":
        info = details(gpus[0])
        capability = info.get("compute_capability")
        extra: dict[str, Any] = {"visible_gpus": len(gpus)}
        if capability is not None:
            extra["compute_capability"] = ".".join(str(x) for x in capability)
        name = str(info.get("device_name") or getattr(gpus[0], "name", "GPU"))
        return DeviceChoice("gpu", "/GPU:0", name, extra)
    return DeviceChoice("cpu", "/CPU:0", cpu_name(), {"visible_gpus": len(gpus)})


def sizes_for(kind: str) -> tuple[int, ...]:
    """Element counts for size-parametrized cases: 1M+ extra ones on a GPU."""
    return CPU_SIZES + GPU_ONLY_SIZES if kind == "gpu" else CPU_SIZES


def make_context(
    choice: DeviceChoice,
    quick: bool,
    sizes: Sequence[int] | None = None,
    threads: Sequence[int] | None = None,
) -> Context:
    """The :class:`~benchmarks.case.Context` handed to every family."""
    return Context(
        quick=quick,
        device=choice.device,
        device_kind=choice.kind,
        sizes=tuple(sizes) if sizes else sizes_for(choice.kind),
        threads=tuple(threads) if threads else THREADS,
    )


def device_sync_for(choice: DeviceChoice) -> Callable[[], None] | None:
    """What to call before reading a clock: a device sync on a GPU, nothing on a CPU.

    A GPU runs ops asynchronously: without a sync, a clock read after a call measures
    the time to *enqueue* the work, not to do it.
    """
    if choice.kind != "gpu":
        return None
    import tensorflow as tf

    return tf.test.experimental.sync_devices
