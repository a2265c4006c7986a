"""The ``data`` family's pipelines (:mod:`benchmarks.bench_data`)."""

from __future__ import annotations

import math

from benchmarks import bench_data, devices
from tests.support.benchmark_fakes import CPU


def test_data_pipelines_live_from_their_first_call_to_the_case_teardown(monkeypatch):
    # A live pipeline runs threads of its own: none may run while another case is timed.
    # One warm-up call per extra instance, not three, and small pipelines (4,096
    # elements, 64 a call, not 65,536 and 1,024): what is tested is when they live, not
    # their size or warm-up (the next test). At full size this test took 3 s alone and
    # 56-62 s in the suite, where the other worker's load starves tf.data's threads.
    monkeypatch.setattr(bench_data, "WARMUP_CALLS", 1)
    monkeypatch.setattr(bench_data, "ELEMENTS_PER_CALL", 64)
    monkeypatch.setattr(bench_data, "num_elements", lambda ctx: 4_096)
    for quick, single_element_instances in ((True, 1), (False, bench_data.INSTANCES)):
        lazy = bench_data.cases(devices.make_context(CPU, quick=quick))
        batched, elements = (case.build() for case in lazy)  # each built at its turn
        _check_pipelines(batched, 1)
        _check_pipelines(elements, single_element_instances)


def _check_pipelines(case, instances):
    pipelines = list(case.variants.values())
    assert all(not p._reads for p in pipelines)  # nothing built with the case
    assert all(math.isfinite(p()) for p in pipelines)  # a sum of features
    assert all(len(p._reads) == instances for p in pipelines)
    case.teardown()
    assert all(not p._reads for p in pipelines)


def test_data_pipeline_instances_are_read_in_blocks_after_a_warm_up():
    calls: list[int] = []
    built: list[int] = []

    def build():
        index = len(built)
        built.append(index)

        def read() -> int:
            calls.append(index)
            return index

        return read

    pipeline = bench_data._Pipeline(build, instances=3, calls_per_instance=2)
    read = [pipeline() for _ in range(7)]
    assert built == [0, 1, 2]
    assert calls[: 2 * bench_data.WARMUP_CALLS] == [1] * bench_data.WARMUP_CALLS + [2] * (
        bench_data.WARMUP_CALLS
    )  # instances after the first warmed at the first call
    assert read == [0, 0, 1, 1, 2, 2, 0]
