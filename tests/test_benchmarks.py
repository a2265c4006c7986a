"""Tests of the benchmark suite: the runner's logic, and one tiny ``--quick`` run.

No test asserts a timing. The GPU path (device choice, metadata, 1M+ sizes, device sync
before every clock read) is tested on the CPU with fake GPUs and fake clocks.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import (  # noqa: E402
    bench_eager,
    bench_graph,
    cli,
    devices,
    discovery,
    metadata,
    plots,
    report,
    runner,
    schema,
)
from benchmarks.case import Case, size_label  # noqa: E402
from benchmarks.timing import TimingSettings, measure  # noqa: E402

SUITE_TIMEOUT = 100  # seconds; the whole --quick suite must take < 45 s on 2 cores.
TINY = ["--quick", "--rounds", "2", "--min-time", "0.002", "--warmup", "0.002",
        "--sizes", "1,1000", "--threads", "1,2"]
SAFE_CONTENTION_VARIANTS = ("SafeVariable.update", "safevars.locked", "threading.Lock")


# --------------------------------------------------------------------------- fakes


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
    "gpu", "/GPU:0", "NVIDIA A100-SXM4-40GB",
    {"visible_gpus": 1, "compute_capability": "8.0"},
)
CPU = devices.DeviceChoice("cpu", "/CPU:0", "test CPU", {"visible_gpus": 0})

FAKE_FAMILIES = {
    "bench_alpha.py": '''
        from benchmarks.case import Case
        FAMILY = "alpha"
        DESCRIPTION = "two variants"
        def cases(ctx):
            return [Case("alpha", "add", {"plain": lambda: 1, "safe": lambda: {"lost": 0}},
                         goal=("safe", 1.10))]
    ''',
    "bench_broken.py": '''
        FAMILY = "broken"
        DESCRIPTION = "fails to import"
        import a_module_that_does_not_exist_anywhere
    ''',
    "bench_raising.py": '''
        from benchmarks.case import Case
        FAMILY = "raising"
        ORDER = 1
        def boom():
            raise ZeroDivisionError("variant exploded")
        def cases(ctx):
            return [Case("raising", "bad", {"plain": lambda: 1, "bad": boom}),
                    Case("raising", "good", {"plain": lambda: 1, "other": lambda: 2})]
    ''',
    "bench_optional.py": '''
        from benchmarks.case import Case
        FAMILY = "optional"
        DEFAULT = False
        def cases(ctx):
            return [Case("optional", "only", {"plain": lambda: 1})]
    ''',
    "bench_nameless.py": '''
        def cases(ctx):
            return []
    ''',
}


@pytest.fixture
def fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[discovery.FamilyInfo]:
    """A package of fake families: one good, one that fails to import, one raising..."""
    package = tmp_path / "fakebench_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, source in FAKE_FAMILIES.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    return discovery.discover(package, "fakebench_pkg")


def tiny_settings() -> TimingSettings:
    return TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.003)


# --------------------------------------------------------------------------- discovery


def test_discovery_reads_families_without_importing_them(fake_package):
    by_name = {f.name: f for f in fake_package}
    assert [f.name for f in fake_package] == [  # ORDER first, then by file name.
        "raising", "alpha", "broken", "nameless", "optional"]
    assert by_name["broken"].problem is None  # Found statically; fails only on import.
    assert by_name["optional"].default is False
    assert "defines no FAMILY" in by_name["nameless"].problem
    assert "fakebench_pkg.bench_broken" not in sys.modules


def test_select_default_excludes_optional_families(fake_package):
    default = [f.name for f in discovery.select(fake_package, None)]
    assert "optional" not in default and "alpha" in default
    assert [f.name for f in discovery.select(fake_package, "optional")] == ["optional"]
    assert len(discovery.select(fake_package, "all")) == len(fake_package)


def test_select_unknown_family_lists_the_known_ones(fake_package):
    with pytest.raises(discovery.UnknownFamilyError) as info:
        discovery.select(fake_package, "alpha,nope")
    message = str(info.value)
    assert "'nope'" in message
    for name in ("alpha", "broken", "raising", "optional (optional)"):
        assert name in message


def test_cli_unknown_cases_is_a_usage_error(fake_package, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--cases", "nope"], families=fake_package)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown case family 'nope'" in err and "alpha" in err


def test_real_families_are_discovered():
    names = {f.name for f in discovery.discover()}
    assert {"eager", "graph", "contention", "snapshot"} <= names
    assert all(f.problem is None for f in discovery.discover()), discovery.discover()


# --------------------------------------------------------------------------- devices


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


def test_cli_gpu_requested_without_gpu_exits_2(fake_package, tmp_path):
    err = io.StringIO()
    code = cli.main(["--device", "gpu", "--out", str(tmp_path / "out")],
                    stdout=io.StringIO(), stderr=err, gpus=[], families=fake_package)
    assert code == 2
    assert "--device cpu" in err.getvalue()
    assert not (tmp_path / "out").exists()


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


def test_gpu_metadata_is_recorded_and_valid():
    meta = metadata.collect(GPU, quick=True, command="python -m benchmarks --quick")
    assert meta["device"] == {
        "kind": "gpu", "name": "NVIDIA A100-SXM4-40GB", "tf_device": "/GPU:0",
        "details": {"visible_gpus": 1, "compute_capability": "8.0"},
    }
    assert meta["mode"] == "quick"
    assert meta["git_commit"] == "unknown" or len(meta["git_commit"]) == 40
    ctx = devices.make_context(GPU, quick=True)
    document = runner.build_document(meta, tiny_settings(), ctx, [])
    assert schema.validate(document) == []


def test_git_state_outside_a_repository_is_unknown(tmp_path):
    assert metadata.git_state(tmp_path) == ("unknown", None)


# --------------------------------------------------------------------------- timing


def test_device_is_synced_before_every_clock_read_on_gpu():
    log: list[str] = []
    case = Case("f", "c", {"a": lambda: log.append("call a"), "b": lambda: log.append("call b")},
                sync=lambda: log.append("case sync"))
    timings = measure(case, tiny_settings(), clock=FakeClock(log),
                      device_sync=lambda: log.append("device sync"))
    reads = [i for i, event in enumerate(log) if event == "clock"]
    assert reads
    assert all(i > 0 and log[i - 1] == "device sync" for i in reads)
    calls = [i for i, event in enumerate(log) if event.startswith("call")]
    assert all(log[i + 1] == "case sync" for i in calls)
    assert [len(t.samples) for t in timings] == [3, 3]


def test_no_sync_on_cpu():
    log: list[str] = []
    case = Case("f", "c", {"a": lambda: log.append("call")}, sync=lambda: log.append("sync"))
    measure(case, tiny_settings(), clock=FakeClock(log), device_sync=None)
    assert "sync" not in log


def test_rounds_interleave_variants_and_rotate_the_order():
    order: list[str] = []
    variants = {name: (lambda n=name: order.append(n)) for name in "ABC"}
    settings = TimingSettings(rounds=3, warmup_time=0.0, min_batch_time=0.0)
    timings = measure(Case("f", "c", variants), settings, clock=FakeClock([]))
    assert [t.calls_per_batch for t in timings] == [1, 1, 1]
    timed = order[-9:]  # After two warm-up calls per variant: three rounds of three.
    assert timed == ["A", "B", "C", "B", "C", "A", "C", "A", "B"]


def test_extra_figures_are_recorded_per_round():
    counter = iter(range(100))
    case = Case("f", "c", {"base": lambda: None, "x": lambda: {"lost": next(counter)}})
    timings = measure(case, tiny_settings(), clock=FakeClock([]))
    extra_x = timings[1].extra_rounds
    assert len(extra_x) == 3 and timings[1].extra == extra_x[-1]
    assert timings[0].extra == {}


def test_case_result_ratios_and_goal():
    case = Case("f", "c", {"plain": lambda: 0, "safe": lambda: 0, "lock": lambda: 0},
                ops_per_call=2, goal=("safe", 1.10), goal_reference="lock")
    from benchmarks.timing import VariantTiming

    timings = [VariantTiming("plain", 1, [1.0, 2.0, 3.0]),
               VariantTiming("safe", 1, [2.0, 4.0, 6.0]),
               VariantTiming("lock", 1, [2.0, 2.0, 2.0])]
    result = runner.case_result(case, "f", timings, 0.5)
    plain, safe, _ = result["variants"]
    assert plain["ratio_to_baseline"] == 1.0 and safe["ratio_to_baseline"] == 2.0
    assert safe["per_op_median_s"] == 2.0 and safe["ops_per_s"] == 0.5
    assert (safe["min_s"], safe["max_s"]) == (2.0, 6.0)
    assert result["goal"]["reference"] == "lock" and result["goal"]["ratio"] == 2.0
    assert result["goal"]["met"] is False


# --------------------------------------------------------------------------- runner


def test_failing_families_are_reported_and_the_run_goes_on(fake_package):
    selected = discovery.select(fake_package, "alpha,broken,raising,nameless")
    progress = io.StringIO()
    results = runner.run_families(selected, devices.make_context(CPU, True), tiny_settings(),
                                  progress=progress, clock=FakeClock([]))
    by_name = {r["name"]: r for r in results}
    assert by_name["alpha"]["status"] == "ok"
    assert by_name["alpha"]["cases"][0]["variants"][1]["extra"] == {"lost": 0}
    assert by_name["broken"]["status"] == "failed"
    assert "ModuleNotFoundError" in by_name["broken"]["error"]
    assert by_name["nameless"]["status"] == "failed"
    raising = by_name["raising"]
    assert raising["status"] == "failed"
    assert [c["status"] for c in raising["cases"]] == ["failed", "ok"]
    assert "ZeroDivisionError: variant exploded" in raising["cases"][0]["error"]
    assert "FAILED" in progress.getvalue()


def test_cli_with_failures_writes_everything_and_exits_1(fake_package, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["--quick", "--rounds", "2", "--out", str(out), "--no-plots",
                     "--cases", "alpha,broken,raising"],
                    families=fake_package, select_device=lambda *a, **k: CPU)
    assert code == 1
    captured = capsys.readouterr()
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["status"] == "failed"
    assert [f["name"] for f in document["families"]] == ["raising", "alpha", "broken"]
    assert document["goals"][0]["variant"] == "safe"
    markdown = (out / "results.md").read_text()
    assert "FAILED" in markdown and "ModuleNotFoundError" in markdown
    assert "alpha" in captured.out and "x baseline" in captured.out
    assert "FAILED families: raising, broken" in captured.err


def test_cli_gpu_path_with_fake_gpu(fake_package, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["--quick", "--rounds", "1", "--out", str(out), "--no-plots",
                     "--cases", "alpha"],
                    families=fake_package, gpus=[FakeGPU()],
                    select_device=lambda requested, gpus: devices.select_device(
                        requested, gpus=gpus, details=fake_details))
    assert code == 0
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    assert document["metadata"]["device"]["kind"] == "gpu"
    assert document["metadata"]["device"]["name"] == "NVIDIA A100-SXM4-40GB"
    assert 16_000_000 in document["settings"]["sizes"]
    assert "GPU NVIDIA A100" in capsys.readouterr().out


# --------------------------------------------------------------------------- schema, plots


def test_schema_rejects_broken_documents():
    meta = metadata.collect(CPU, quick=False)
    good = runner.build_document(meta, tiny_settings(), devices.make_context(CPU, False), [])
    assert schema.validate(good) == []
    bad = json.loads(json.dumps(good))
    del bad["metadata"]["git_commit"]
    bad["settings"]["rounds"] = "3"
    bad["status"] = "maybe"
    problems = schema.validate(bad)
    assert any("git_commit" in p for p in problems)
    assert any("settings.rounds" in p for p in problems)
    assert any("status" in p for p in problems)


def test_missing_matplotlib_skips_plots_without_crashing(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" fails.
    progress = io.StringIO()
    document = {"families": [{"name": "x", "cases": []}]}
    assert plots.write_plots(document, tmp_path, progress) == []
    assert "matplotlib is not available" in progress.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_format_seconds():
    assert report.format_seconds(1.5e-5) == "15 µs"
    assert report.format_seconds(0.00234) == "2.34 ms"
    assert report.format_seconds(None) == "n/a"


# --------------------------------------------------------------------------- the suite


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("bench") / "results"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO))
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", *TINY, "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SUITE_TIMEOUT,
    )
    return completed, out


def test_quick_suite_runs_every_family_and_writes_valid_results(quick_run):
    completed, out = quick_run
    assert completed.returncode == 0, completed.stderr[-4000:]
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    expected = [f.name for f in discovery.select(discovery.discover(), None)]
    assert [f["name"] for f in document["families"]] == expected
    for family in document["families"]:
        assert family["status"] == "ok", family["error"]
        assert family["cases"], family["name"]
        for case in family["cases"]:
            assert case["status"] == "ok" and case["variants"][0]["baseline"]
            for variant in case["variants"]:
                assert len(variant["samples_s"]) == 2
                assert variant["min_s"] <= variant["median_s"] <= variant["max_s"]
    meta = document["metadata"]
    assert meta["mode"] == "quick" and meta["device"]["kind"] == "cpu"
    assert document["settings"]["sizes"] == [1, 1000]
    assert document["settings"]["threads"] == [1, 2]
    goals = {(g["case"], g["reference"]) for g in document["goals"] if g["family"] == "eager"}
    assert goals == {("assign_add/scalar", "tf.Variable"), ("update/scalar", "threading.Lock")}


def test_quick_suite_safe_variants_never_lose_updates(quick_run):
    _, out = quick_run
    document = json.loads((out / "results.json").read_text())
    (contention,) = [f for f in document["families"] if f["name"] == "contention"]
    assert [c["params"]["threads"] for c in contention["cases"]] == [1, 2]
    for case in contention["cases"]:
        for variant in case["variants"]:
            assert len(variant["extra_rounds"]) == 2
            for extra in variant["extra_rounds"]:
                assert 0 <= extra["lost_updates"] <= extra["updates"]
                if variant["name"] in SAFE_CONTENTION_VARIANTS:
                    assert extra["lost_updates"] == 0, (case["name"], variant["name"])


def test_quick_suite_writes_markdown_plots_and_reports_progress(quick_run):
    completed, out = quick_run
    document = json.loads((out / "results.json").read_text())
    markdown = (out / "results.md").read_text()
    for family in document["families"]:
        assert f"## {family['name']}" in markdown
        assert (out / f"overhead_{family['name']}.png").stat().st_size > 1000 or all(
            len(c["variants"]) == 1 for c in family["cases"]
        )
    assert (out / "throughput_vs_threads.png").stat().st_size > 1000
    assert "| case | variant | median |" in markdown
    assert "x baseline" in completed.stdout and "assign_add/scalar" in completed.stdout
    assert "[1/" in completed.stderr and "eager" in completed.stderr
