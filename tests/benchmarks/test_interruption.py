"""Nothing lost when a run stops (issue 44): ``python -m benchmarks`` killed or interrupted
in a subprocess leaves a readable ``results.json`` marked incomplete, and ``--resume``
finishes it without measuring again what it has.

The runs use fake families (below): tiny cases, one of which waits at its first call
until the test creates a file, so the run is stopped at a known place, never by a timer.
Every wait here is a deadlock detector with a generous bound, not a timing assertion.
TensorFlow is not imported (see ``DRIVER``), so each run takes about a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from benchmarks import schema

REPO = Path(__file__).resolve().parents[2]
WAIT = 300.0  # seconds: a hang guard for a busy machine, far above what a run needs

FAMILIES = {
    "bench_first.py": """
        import os
        from benchmarks.case import Case, LazyCase
        FAMILY = "first"
        ORDER = 1
        SECONDS = {"quick": 1}
        def _case(name):
            def variant():
                return {"pid": os.getpid()}
            return Case("first", name, {"plain": variant, "safe": variant},
                        goal=("safe", 1000.0))
        def cases(ctx):
            return [LazyCase("first", f"case{i}", lambda i=i: _case(f"case{i}"))
                    for i in range(3)]
    """,
    "bench_second.py": """
        import os, time
        from benchmarks.case import Case
        FAMILY = "second"
        ORDER = 2
        def gate():  # waits until the test opens it: the run is stopped in here
            while not os.path.exists(os.environ["GATE_FILE"]):
                time.sleep(0.01)
            return {"pid": os.getpid()}
        def plain():
            return {"pid": os.getpid()}
        def cases(ctx):
            return [Case("second", "before", {"plain": plain, "safe": plain}),
                    Case("second", "gated", {"plain": plain, "safe": gate}),
                    Case("second", "after", {"plain": plain, "safe": plain})]
    """,
}

# The suite's CLI on the fake families and a fake CPU, without importing TensorFlow (the
# fakes do not need it; its start-up would be most of each run's time).
DRIVER = """
import sys, types
from pathlib import Path
sys.path[:0] = [{repo!r}, {packages!r}]
from benchmarks import cli, devices, discovery, metadata
cli._quiet = lambda: types.SimpleNamespace(
    verbose_requested=lambda argv: False, quiet_tensorflow_startup=lambda verbose: None
)
metadata._version = lambda module: "not imported"
families = discovery.discover(Path({package!r}), "interruptbench_pkg")
cpu = devices.DeviceChoice("cpu", "/CPU:0", "test CPU", {{"visible_gpus": 0}})
sys.exit(cli.main(sys.argv[1:], families=families, select_device=lambda *a, **k: cpu))
"""

OPTIONS = ["--quick", "--rounds", "3", "--warmup", "0", "--min-time", "0.001", "--no-plots"]


@pytest.fixture
def bench(tmp_path: Path):
    """Returns ``start(*args) -> Popen`` running the fake families' suite, and the paths."""
    package = tmp_path / "packages" / "interruptbench_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for name, source in FAMILIES.items():
        (package / name).write_text(textwrap.dedent(source))
    driver = tmp_path / "driver.py"
    driver.write_text(
        DRIVER.format(repo=str(REPO), packages=str(package.parent), package=str(package))
    )
    gate = tmp_path / "gate-open"
    env = dict(os.environ, GATE_FILE=str(gate), TF_CPP_MIN_LOG_LEVEL="2")
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        log = open(tmp_path / f"stderr-{len(started)}.txt", "w")  # noqa: SIM115 - closed below
        process = subprocess.Popen(
            [sys.executable, str(driver), *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        process.log = log  # type: ignore[attr-defined]
        process.log_path = Path(log.name)  # type: ignore[attr-defined]
        started.append(process)
        return process

    yield start, tmp_path / "out", gate
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT)
        process.log.close()  # type: ignore[attr-defined]


def finished(out: Path) -> list[str]:
    """``family/case`` of every case in ``out/results.json`` (none while there is no file)."""
    try:
        document = json.loads((out / "results.json").read_text())
    except FileNotFoundError:
        return []
    return [f"{f['name']}/{c['name']}" for f in document["families"] for c in f["cases"]]


def wait_for_gate(process: subprocess.Popen, out: Path) -> None:
    """Waits until the run has written every case before the gated one and is in it."""
    deadline = time.monotonic() + WAIT
    while "second/before" not in finished(out):
        assert process.poll() is None, process.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the gated case"
        time.sleep(0.05)


def load(out: Path) -> dict:
    document = json.loads((out / "results.json").read_text())
    assert schema.validate(document) == []
    return document


BEFORE_GATE = ["first/case0", "first/case1", "first/case2", "second/before"]
EVERY_CASE = [*BEFORE_GATE, "second/gated", "second/after"]


def pids(document: dict) -> dict[str, set[int]]:
    """The processes that measured each case (its variants return their pid)."""
    return {
        f"{f['name']}/{c['name']}": {e["pid"] for v in c["variants"] for e in v["extra_rounds"]}
        for f in document["families"]
        for c in f["cases"]
    }


def test_a_killed_run_leaves_its_cases_and_resume_finishes_it(bench):
    start, out, gate = bench
    run = start(*OPTIONS, "--out", str(out))
    wait_for_gate(run, out)
    run.kill()  # SIGKILL: no handler runs, the last file written is what is left
    assert run.wait(WAIT) == -signal.SIGKILL
    left = load(out)
    assert left["complete"] is False and left["interrupted_by"] is None
    assert left["settings"]["families_selected"] == ["first", "second"]
    assert finished(out) == BEFORE_GATE
    assert "INCOMPLETE run" in (out / "results.md").read_text()
    before = pids(left)
    assert all(found == {run.pid} for found in before.values())

    gate.touch()
    resumed = start("--resume", str(out), "--no-plots")
    assert resumed.wait(WAIT) == 0, resumed.log_path.read_text()[-3000:]
    done = load(out)
    assert done["complete"] is True and done["interrupted_by"] is None
    assert finished(out) == EVERY_CASE
    assert [r["command"] for r in done["resumed"]] == [
        f"python -m benchmarks --resume {out} --no-plots"
    ]
    after = pids(done)
    for case in BEFORE_GATE:  # kept as they were, not measured again
        assert after[case] == {run.pid}
    for case in ("second/gated", "second/after"):
        assert after[case] == {resumed.pid}
    first_case = done["families"][0]["cases"][0]
    assert first_case == left["families"][0]["cases"][0]
    assert [g["case"] for g in done["goals"]] == ["case0", "case1", "case2"]
    assert done["metadata"] == left["metadata"]  # the run's start, not the resume's
    assert "INCOMPLETE" not in (out / "results.md").read_text()


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_writes_what_finished_marked_interrupted(bench, signum, status):
    start, out, _ = bench
    run = start(*OPTIONS, "--out", str(out))
    wait_for_gate(run, out)
    run.send_signal(signum)
    assert run.wait(WAIT) == status
    left = load(out)
    assert left["complete"] is False
    assert left["interrupted_by"] == signal.Signals(signum).name
    assert finished(out) == BEFORE_GATE
    message = run.log_path.read_text()
    assert f"interrupted ({signal.Signals(signum).name})" in message
    assert f"python -m benchmarks --resume {out}" in message
    assert f"interrupted by {signal.Signals(signum).name}" in (out / "results.md").read_text()


def test_resume_refuses_another_commit_unless_forced(bench):
    start, out, gate = bench
    run = start(*OPTIONS, "--out", str(out))
    wait_for_gate(run, out)
    run.kill()
    run.wait(WAIT)
    document = json.loads((out / "results.json").read_text())
    document["metadata"]["git_commit"] = "0" * 40
    (out / "results.json").write_text(json.dumps(document))
    gate.touch()
    refused = start("--resume", str(out), "--no-plots")
    assert refused.wait(WAIT) == 2
    message = refused.log_path.read_text()
    assert "commit: the run was started at 000000000000" in message and "--force" in message
    assert finished(out) == BEFORE_GATE  # nothing written
    other_mode = start("--resume", str(out), "--rounds", "5", "--no-plots")
    assert other_mode.wait(WAIT) == 2
    assert "--rounds 5 (the run has 3)" in other_mode.log_path.read_text()
    forced = start("--resume", str(out), "--force", "--no-plots")
    assert forced.wait(WAIT) == 0, forced.log_path.read_text()[-3000:]
    assert finished(out) == EVERY_CASE
    assert "warning: --resume --force: commit" in forced.log_path.read_text()


ISOLATED_FAMILY = {
    "bench_iso.py": """
        import os, time
        from benchmarks.case import Case
        FAMILY = "iso"
        ORDER = 2
        ISOLATED = True
        def variant():
            return {"pid": os.getpid()}
        def gate():
            while not os.path.exists(os.environ["GATE_FILE"]):
                time.sleep(0.01)
            return {"pid": os.getpid()}
        def cases(ctx):
            return [Case("iso", "one", {"plain": variant, "safe": variant}),
                    Case("iso", "gated", {"plain": variant, "safe": gate})]
    """,
}
FULL = ["--rounds", "3", "--warmup", "0", "--min-time", "0.001", "--no-plots"]


@pytest.fixture
def isolated_bench(bench):
    start, out, gate = bench
    package = out.parent / "packages" / "interruptbench_pkg"
    for name, source in ISOLATED_FAMILY.items():
        (package / name).write_text(textwrap.dedent(source))
    return start, out, gate


def wait_for_case(process: subprocess.Popen, out: Path, case: str) -> None:
    deadline = time.monotonic() + WAIT
    while case not in finished(out):
        assert process.poll() is None, process.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the run never wrote {case}"
        time.sleep(0.05)


def test_an_isolated_family_runs_first_in_a_process_of_its_own(isolated_bench):
    start, out, gate = isolated_bench
    gate.touch()
    run = start(*FULL, "--out", str(out))
    assert run.wait(WAIT) == 0, run.log_path.read_text()[-3000:]
    done = load(out)
    assert done["complete"] is True and done["resumed"] == []
    # In the order of the selection, whatever the order they ran in.
    assert finished(out) == [*BEFORE_GATE[:3], "iso/one", "iso/gated", *EVERY_CASE[3:]]
    measured_by = pids(done)
    (isolated,) = {measured_by["iso/one"].pop()}
    assert isolated != run.pid and measured_by["iso/gated"] == {isolated}
    assert all(measured_by[case] == {run.pid} for case in EVERY_CASE)
    assert done["metadata"]["command"] == "python -m benchmarks " + " ".join(
        [*FULL, "--out", str(out)]
    )
    log = run.log_path.read_text()
    assert log.index("[2/3 iso") < log.index("[1/3 first")  # measured first
    # --quick runs every family in one process (small models: nothing to isolate).
    quick = start(*OPTIONS, "--out", str(out))
    assert quick.wait(WAIT) == 0
    assert pids(load(out))["iso/one"] == {quick.pid}


def test_each_pass_of_an_isolated_family_runs_in_a_process_of_its_own(isolated_bench, tmp_path):
    """With --repeat, every pass of an isolated family is a process of its own (the memory
    TensorFlow keeps for traced functions does not add up), pooled into one result."""
    start, out, gate = isolated_bench
    gate.touch()
    run = start(*FULL, "--repeat", "2", "--out", str(out))
    assert run.wait(WAIT) == 0, run.log_path.read_text()[-3000:]
    done = load(out)
    assert done["complete"] is True and done["resumed"] == []
    measured_by = pids(done)
    passes = measured_by["iso/one"]
    assert len(passes) == 2 and run.pid not in passes, passes
    assert measured_by["iso/gated"] == passes
    assert all(measured_by[case] == {run.pid} for case in EVERY_CASE)
    iso = next(f for f in done["families"] if f["name"] == "iso")
    assert [c["repetitions"] for c in iso["cases"]] == [2, 2]
    # Alone, its passes still run apart; the run's own process measures nothing.
    alone_out = tmp_path / "alone"
    alone = start(*FULL, "--repeat", "2", "--cases", "iso", "--out", str(alone_out))
    assert alone.wait(WAIT) == 0, alone.log_path.read_text()[-3000:]
    passes = pids(load(alone_out))["iso/one"]
    assert len(passes) == 2 and alone.pid not in passes, passes


# The isolated family again, its gated case blocking only in a process other than the
# first that measured it: in a --repeat 2 run, in the second pass.
SECOND_PASS_GATED = ISOLATED_FAMILY["bench_iso.py"].replace(
    """        def gate():
            while not os.path.exists(os.environ["GATE_FILE"]):""",
    """        def gate():
            first = os.environ["GATE_FILE"] + ".first-pass"
            if not os.path.exists(first):
                with open(first, "w") as f:
                    f.write(str(os.getpid()))
            with open(first) as f:
                mine = f.read() == str(os.getpid())
            while not mine and not os.path.exists(os.environ["GATE_FILE"]):""",
)


def test_a_run_killed_in_the_second_pass_of_its_isolated_family_resumes_that_pass(
    isolated_bench,
):
    """Killed while the second pass's process measures, the run keeps the first pass and
    the second pass's finished case, and ``--resume`` measures only what is left."""
    start, out, gate = isolated_bench
    assert ISOLATED_FAMILY["bench_iso.py"] != SECOND_PASS_GATED  # the gate was replaced
    package = out.parent / "packages" / "interruptbench_pkg"
    (package / "bench_iso.py").write_text(textwrap.dedent(SECOND_PASS_GATED))
    run = start(*FULL, "--repeat", "2", "--out", str(out))
    deadline = time.monotonic() + WAIT
    while True:  # until the second pass wrote iso/one
        cases = {c["name"]: c for f in load_if_any(out) for c in f["cases"] if f["name"] == "iso"}
        if cases.get("one", {}).get("repetitions") == 2:
            break
        assert run.poll() is None, run.log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the second pass never wrote iso/one"
        time.sleep(0.05)
    run.kill()
    assert run.wait(WAIT) == -signal.SIGKILL
    left = load(out)
    assert left["complete"] is False
    iso = {c["name"]: c for f in left["families"] if f["name"] == "iso" for c in f["cases"]}
    assert (iso["one"]["repetitions"], iso["gated"]["repetitions"]) == (2, 1)
    measured_before = pids(left)
    gate.touch()
    resumed = start("--resume", str(out), "--no-plots")
    assert resumed.wait(WAIT) == 0, resumed.log_path.read_text()[-3000:]
    done = load(out)
    assert done["complete"] is True and len(done["resumed"]) == 1
    iso = {c["name"]: c for f in done["families"] if f["name"] == "iso" for c in f["cases"]}
    assert (iso["one"]["repetitions"], iso["gated"]["repetitions"]) == (2, 2)
    measured_by = pids(done)
    assert measured_by["iso/one"] == measured_before["iso/one"]  # kept, not measured again
    (new,) = measured_by["iso/gated"] - measured_before["iso/gated"]
    assert new not in measured_before["iso/one"] and new != resumed.pid


def load_if_any(out: Path) -> list[dict]:
    """The families of ``out/results.json``, none while it is missing or being written."""
    try:
        return json.loads((out / "results.json").read_text())["families"]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def test_a_run_killed_in_its_isolated_family_is_resumed_there(isolated_bench):
    start, out, gate = isolated_bench
    run = start(*FULL, "--out", str(out))
    wait_for_case(run, out, "iso/one")
    run.kill()  # the isolated family's process goes with it (PR_SET_PDEATHSIG)
    assert run.wait(WAIT) == -signal.SIGKILL
    left = load(out)
    assert left["complete"] is False and finished(out) == ["iso/one"]
    (isolated,) = pids(left)["iso/one"]
    deadline = time.monotonic() + WAIT
    while _alive(isolated):
        assert time.monotonic() < deadline, "the isolated family's process outlived its run"
        time.sleep(0.05)
    gate.touch()
    resumed = start("--resume", str(out), "--no-plots")
    assert resumed.wait(WAIT) == 0, resumed.log_path.read_text()[-3000:]
    done = load(out)
    assert done["complete"] is True and len(done["resumed"]) == 1
    assert finished(out)[3:5] == ["iso/one", "iso/gated"]
    assert pids(done)["iso/one"] == {isolated}  # kept, not measured again


def test_sigterm_reaches_the_isolated_family_and_what_finished_is_written(isolated_bench):
    start, out, _ = isolated_bench
    run = start(*FULL, "--out", str(out))
    wait_for_case(run, out, "iso/one")
    run.send_signal(signal.SIGTERM)
    assert run.wait(WAIT) == 143
    left = load(out)
    assert left["complete"] is False and left["interrupted_by"] == "SIGTERM"
    assert finished(out) == ["iso/one"]
    assert f"python -m benchmarks --resume {out}" in run.log_path.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
