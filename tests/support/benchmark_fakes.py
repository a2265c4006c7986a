"""Fakes shared by the benchmark suite's tests: a clock, a GPU, device choices, a
package of fake case families, and builders of result objects for the plots.

Nothing here times anything: the clock advances a fixed step per read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import devices, runner
from benchmarks.case import Case
from benchmarks.timing import TimingSettings, VariantTiming


class FakeClock:
    """A clock that advances ``step`` seconds per read and logs every read."""

    def __init__(self, log: list[str], step: float = 0.001) -> None:
        self.log = log
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.log.append("clock")
        self.now += self.step
        return self.now


class FakeGPU:
    """Stands for a ``tf.config.PhysicalDevice`` of type GPU."""

    name = "/physical_device:GPU:0"
    device_type = "GPU"


def fake_details(gpu: Any) -> dict[str, Any]:
    return {"device_name": "NVIDIA A100-SXM4-40GB", "compute_capability": (8, 0)}


GPU = devices.DeviceChoice(
    "gpu",
    "/GPU:0",
    "NVIDIA A100-SXM4-40GB",
    {"visible_gpus": 1, "compute_capability": "8.0"},
)
CPU = devices.DeviceChoice("cpu", "/CPU:0", "test CPU", {"visible_gpus": 0})

FAKE_FAMILIES = {
    "bench_alpha.py": """
        from benchmarks.case import Case
        FAMILY = "alpha"
        DESCRIPTION = "two variants"
        def cases(ctx):
            return [Case("alpha", "add", {"plain": lambda: 1, "safe": lambda: {"lost": 0}},
                         goal=("safe", 1.10))]
    """,
    "bench_broken.py": """
        FAMILY = "broken"
        DESCRIPTION = "fails to import"
        import a_module_that_does_not_exist_anywhere
    """,
    "bench_raising.py": """
        from benchmarks.case import Case
        FAMILY = "raising"
        ORDER = 1
        def boom():
            raise ZeroDivisionError("variant exploded")
        def cases(ctx):
            return [Case("raising", "bad", {"plain": lambda: 1, "bad": boom}),
                    Case("raising", "good", {"plain": lambda: 1, "other": lambda: 2}),
                    Case("raising", "bad goal", {"plain": lambda: 1}, goal=("plain", "<", 1))]
    """,
    "bench_counted.py": """
        import itertools
        from benchmarks.case import Case
        FAMILY = "counted"
        DEFAULT = False
        BUILDS = itertools.count(1)
        def cases(ctx):
            build = next(BUILDS)
            return [Case("counted", "pair", {"plain": lambda: 1,
                                             "safe": lambda: {"build": build}},
                         goal=("safe", ">=", 0.5))]
    """,
    "bench_optional.py": """
        from benchmarks.case import Case
        FAMILY = "optional"
        DEFAULT = False
        def cases(ctx):
            return [Case("optional", "only", {"plain": lambda: 1})]
    """,
    "bench_nameless.py": """
        def cases(ctx):
            return []
    """,
}


#: Families whose goal's verdict does not depend on the machine: two trivial calls are
#: within a factor of 1,000 of each other, so "at most 1000x" is met and "at least
#: 1000x" missed, once there are rounds enough for an interval (3).
GOAL_FAMILIES = {
    "bench_meets.py": """
        from benchmarks.case import Case
        FAMILY = "meets"
        def cases(ctx):
            return [Case("meets", "pair", {"plain": lambda: 1, "safe": lambda: 2},
                         goal=("safe", "<=", 1000.0))]
    """,
    "bench_misses.py": """
        from benchmarks.case import Case
        FAMILY = "misses"
        def cases(ctx):
            return [Case("misses", "pair", {"plain": lambda: 1, "safe": lambda: 2},
                         goal=("safe", ">=", 1000.0))]
    """,
    "bench_goalless.py": """
        from benchmarks.case import Case
        FAMILY = "goalless"
        def cases(ctx):
            return [Case("goalless", "pair", {"plain": lambda: 1, "safe": lambda: 2})]
    """,
}


def tiny_settings() -> TimingSettings:
    return TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.003)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def thread_family(workloads: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A family result with one case per (workload, thread count)."""
    cases = []
    for workload, counts in workloads.items():
        for threads in counts:
            cases.append(
                {
                    "name": f"{workload}/{threads}",
                    "status": "ok",
                    "params": {"op": workload, "threads": threads},
                    "variants": [
                        {"name": n, "ops_per_s": 1000.0 * threads / (i + 1)}
                        for i, n in enumerate(("plain", "safe"))
                    ],
                }
            )
    return {"name": "fam", "cases": cases}


def family_result(name: str, cases: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A ``family`` object of ``results.json`` built by the runner from synthetic rounds.

    Each entry of ``cases``: ``name``; ``variants``, variant name -> per-round seconds,
    the first the baseline (or -> ``(seconds, extra_rounds)``); and optionally ``goal``,
    ``goal_reference`` and ``params`` as for :class:`benchmarks.case.Case`. ``fields``
    adds keys to the family (``plot_against``).
    """
    results = []
    for spec in cases:
        timings = []
        for variant, samples in spec["variants"].items():
            samples, extra = samples if isinstance(samples, tuple) else (samples, [])
            timings.append(VariantTiming(variant, 1, list(samples), list(extra)))
        case = Case(
            name,
            spec["name"],
            dict.fromkeys(spec["variants"], int),
            params=spec.get("params", {}),
            goal=spec.get("goal"),
            goal_reference=spec.get("goal_reference"),
        )
        results.append(runner.case_result(case, name, timings, 0.1))
    return {
        "name": name,
        "description": "",
        "module": f"benchmarks.bench_{name}",
        "default": True,
        "status": "ok",
        "error": None,
        "traceback": None,
        "duration_s": 0.1,
        "cases": results,
        **fields,
    }


def rounds(ratio: float, count: int = 7, spread: float = 0.02) -> list[float]:
    """``count`` per-round seconds around ``ratio`` (a baseline's are ``rounds(1.0)``)."""
    return [ratio * (1 + spread * ((i % 3) - 1)) for i in range(count)]
