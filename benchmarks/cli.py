"""The command line of ``python -m benchmarks``.

Exit status: 0 when every selected family ran, 1 when a family or case failed (the others
still ran and were written), 2 for a usage error (unknown ``--cases`` name, ``--device gpu``
without a GPU, a ``--resume DIR`` that cannot be continued), 130 after Ctrl-C and 143
after SIGTERM (every case that finished is written, marked incomplete; ``--resume``
finishes the run, see :mod:`benchmarks.resume`). Goals do not change it unless asked:

* ``--check``: also 1 when a goal was **missed** (its whole 95% interval on the wrong side
  of the bound). An **inconclusive** goal (the interval straddles the bound, or too few
  rounds for one) or one **not measured** does not fail the check: it is not evidence of
  a regression, and on a shared or noisy machine most goals near their bound are
  inconclusive. stderr says how many there were, and that ``--strict`` counts them.
* ``--strict``: ``--check``, and an inconclusive or unmeasured goal fails it too (exit 1):
  for a quiet, dedicated machine with enough rounds (``--repeat``, ``--rounds``) that
  every goal is decided.

Either way every result is written first (``results.json``, ``results.md``, the plots),
and stderr ends with one ``check:`` line per goal that failed the check.

TensorFlow's C++ start-up log (the absl notice, oneDNN, CUDA-driver and CPU-feature lines)
is hidden unless ``--verbose`` or ``SAFEVARS_VERBOSE=1``: ``examples/_quiet.py``, shared
with the examples, imports TensorFlow before anything else does.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from benchmarks import devices, discovery, metadata, plots, report, resume, runner, schema
from benchmarks.timing import TimingSettings

__all__ = ["check_goals", "main", "parser"]

QUICK, FULL = TimingSettings.quick(), TimingSettings.full()

EPILOG = """\
examples:
  python -m benchmarks                      # full suite: about 7.5 minutes on a 2-core CPU
  python -m benchmarks --quick              # the whole suite in under 45 s on a 2-core CPU
  python -m benchmarks --resume bench-results   # finish a run stopped by Ctrl-C or a kill
  python -m benchmarks --cases eager,contention --out /tmp/bench
  python -m benchmarks --device gpu         # fail unless TensorFlow sees a GPU
  python -m benchmarks --cases distributed  # optional families run only when named
  python -m benchmarks --cases graph,accumulator --repeat 5   # 5 passes, rounds pooled
  python -m benchmarks --quick --verbose    # with TensorFlow's C++ start-up log
  python -m benchmarks --check              # exit 1 if a goal is missed (a CI gate)

Every ratio is printed with its 95% confidence interval (paired bootstrap of the ratio
of medians over the rounds); a goal is met when its whole interval satisfies the bound,
missed when none of it does, inconclusive otherwise.

results.json and results.md are rewritten after every case, marked incomplete
("complete": false) until the run ends: Ctrl-C, SIGTERM or a kill leaves what finished.

exit status: 0 everything ran (and, with --check, no goal was missed); 1 a family or
case failed, or --check found a missed goal (--strict: a goal not met); 2 usage error;
130 interrupted by Ctrl-C, 143 by SIGTERM (what finished is written).
The stdout table fits 120 columns; results.md has every column.
"""


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """The argument parser (its ``--help`` is the suite's reference)."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="The cost of safety: safevars against plain tf.Variable, A/B "
        "interleaved in one process, on the default device.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        default=None,
        help="small sizes and few rounds: the whole suite in under 45 s on a 2-core CPU",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "gpu"),
        default=None,
        help="where to place the variables (default: the GPU if TensorFlow "
        "sees one, else the CPU)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for results.json, results.md and the PNG plots (default: "
        "./bench-results; with --resume, the directory resumed). results.json and "
        "results.md are rewritten after every case, marked incomplete until the run ends",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="finish the interrupted run whose results are in DIR: the same families and "
        "settings (read from DIR/results.json), skipping the cases it has; refused if "
        "DIR comes from another commit or device (see --force)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: continue a run started at another commit or on another device",
    )
    p.add_argument(
        "--cases",
        default=None,
        metavar="FAMILIES",
        help="comma-separated case families to run, or 'all' (default: every "
        "non-optional family; see --list)",
    )
    p.add_argument("--list", action="store_true", help="list the case families and exit")
    p.add_argument(
        "--schema", action="store_true", help="print the JSON schema of results.json and exit"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help=f"timed rounds per case (default: {QUICK.rounds} quick, {FULL.rounds} full)",
    )
    p.add_argument(
        "--repeat",
        type=_positive_int,
        default=None,
        metavar="N",
        help="run the selected families N times, one pass after another "
        "(each builds its cases afresh), and pool every case's rounds: "
        "medians over all of them, confidence intervals resampling the passes, "
        "then rounds within each (default: 1)",
    )
    p.add_argument(
        "--min-time",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="target duration of one timed batch (default: "
        f"{QUICK.min_batch_time:g} quick, {FULL.min_batch_time:g} full)",
    )
    p.add_argument(
        "--warmup",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help=f"warm-up per variant (default: {QUICK.warmup_time:g} quick, {FULL.warmup_time:g} full)",
    )
    p.add_argument(
        "--sizes",
        type=_positive_ints,
        default=None,
        metavar="N,N,...",
        help="element counts for size-parametrized cases (default: 1,1000,"
        "1000000, plus 16000000 on a GPU)",
    )
    p.add_argument(
        "--threads",
        type=_positive_ints,
        default=None,
        metavar="N,N,...",
        help="thread counts for contention cases (default: 1,2,4,8)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a goal is missed (its whole 95%% interval on the wrong side of "
        "the bound); inconclusive and unmeasured goals are reported on stderr but pass",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="--check, and an inconclusive or unmeasured goal fails it too",
    )
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    # A run's isolated family, in the process the run starts for it (ISOLATED families).
    p.add_argument("--_only", dest="only", default=None, help=argparse.SUPPRESS)
    # With --repeat, the pass it measures (one process per pass: each resumes the last).
    p.add_argument("--_until", dest="until", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show TensorFlow's C++ start-up log (absl, oneDNN, CUDA-driver and CPU-feature "
        "lines), hidden by default; SAFEVARS_VERBOSE=1 does the same",
    )
    return p


QUIET_MODULE = Path(__file__).resolve().parent.parent / "examples" / "_quiet.py"


def _quiet() -> ModuleType:
    """Loads ``examples/_quiet.py`` by path.

    One implementation serves the examples and the CLI; it cannot live in ``safevars``,
    whose import imports TensorFlow, and ``benchmarks`` is not on the examples' path.
    """
    spec = importlib.util.spec_from_file_location("_safevars_examples_quiet", QUIET_MODULE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {QUIET_MODULE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(args: argparse.Namespace) -> TimingSettings:
    base = TimingSettings.quick() if args.quick else TimingSettings.full()
    return TimingSettings(
        rounds=args.rounds if args.rounds is not None else base.rounds,
        warmup_time=args.warmup if args.warmup is not None else base.warmup_time,
        min_batch_time=args.min_time if args.min_time is not None else base.min_batch_time,
        max_calls_per_batch=base.max_calls_per_batch,
    )


def _list(families: Sequence[discovery.FamilyInfo], out: TextIO) -> None:
    width = max((len(f.name) for f in families), default=0)
    for f in families:
        flag = "" if f.default else " (optional: run with --cases " + f.name + ")"
        problem = f"  [cannot load: {f.problem}]" if f.problem else ""
        print(f"{f.name.ljust(width)}  {f.description}{flag}{problem}", file=out)


def check_goals(goals: Sequence[dict[str, Any]], strict: bool) -> tuple[bool, list[str]]:
    """Whether ``goals`` fail ``--check`` (``--strict`` if ``strict``), and the lines
    saying why, for stderr.

    A missed goal fails the check; with ``strict`` an inconclusive or unmeasured one
    fails it too, otherwise one line counts them. A run without goals passes.
    """
    failing = {"missed", "inconclusive", "not measured"} if strict else {"missed"}
    failed = [g for g in goals if g["verdict"] in failing]
    lines = [
        f"check: goal {g['family']}/{g['case']} {g['verdict'].upper()}: {g['variant']} "
        f"over {g['reference']} {g['operator']} {g['bound']:.2f}x, measured "
        + (
            "nothing"
            if g["ratio"] is None
            else report.format_ratio(g["ratio"], g["ratio_ci_95"], digits=3, unit="x")
        )
        for g in failed
    ]
    undecided = [g for g in goals if g["verdict"] in ("inconclusive", "not measured")]
    if undecided and not strict:
        lines.append(
            f"check: {len(undecided)} goal(s) inconclusive or not measured, not counted "
            "(--strict counts them; --repeat or --rounds narrows the intervals)"
        )
    mode = "--strict" if strict else "--check"
    if not goals:
        lines.append(f"check: {mode} passed: the selected families have no goals")
    elif failed:
        lines.append(f"check: {mode} FAILED: {len(failed)} of {len(goals)} goal(s)")
    else:
        lines.append(f"check: {mode} passed: {report.goal_summary(goals)}")
    return bool(failed), lines


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


@contextlib.contextmanager
def _signals(handler: Any, which: Sequence[signal.Signals]) -> Iterator[None]:
    """``handler`` for ``which`` during the block (only in the main thread, where
    Python runs signal handlers; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, handler) for sig in which}
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


#: Options that define a run: with --resume they come from DIR/results.json.
_RUN_OPTIONS = (
    "quick",
    "cases",
    "device",
    "rounds",
    "repeat",
    "warmup",
    "min_time",
    "sizes",
    "threads",
)


def _apply_resumed(
    args: argparse.Namespace, document: dict[str, Any], known: Sequence[discovery.FamilyInfo]
) -> list[str]:
    """Sets the run's options from the ``document`` being resumed; returns the options
    given on the command line that disagree with it."""
    settings = document["settings"]
    resumed = {
        "quick": document["metadata"]["mode"] == "quick",
        "cases": ",".join(settings["families_selected"]),
        "device": document["metadata"]["device"]["kind"],
        "rounds": settings["rounds"],
        "repeat": settings.get("repeat", 1),
        "warmup": settings["warmup_time_s"],
        "min_time": settings["min_batch_time_s"],
        "sizes": tuple(settings["sizes"]),
        "threads": tuple(settings["threads"]),
    }
    conflicts = []
    for key in _RUN_OPTIONS:
        given, value = getattr(args, key), resumed[key]
        if key == "cases" and given is not None:
            try:
                same = [f.name for f in discovery.select(known, given)] == list(
                    settings["families_selected"]
                )
            except discovery.UnknownFamilyError:
                same = False
        else:
            same = given is None or given == value
        if not same:
            option = "--" + key.replace("_", "-")
            shown = "" if given is True else f" {given!r}"
            conflicts.append(f"{option}{shown} (the run has {value!r})")
        setattr(args, key, value)
    return conflicts


def _child_command() -> list[str]:
    """How to start this suite again: ``python -m benchmarks``, or the script that ran it
    (a test's driver)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "benchmarks.__main__":
        return [sys.executable, "-m", "benchmarks"]
    return [sys.executable, sys.argv[0]]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A child stops when this process is killed (Linux ``PR_SET_PDEATHSIG``), so a
    killed run leaves no benchmark running on its own."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _isolated_arguments(args: argparse.Namespace, names: Sequence[str], out: Path) -> list[str]:
    """The options of the child that measures one isolated family: this run's."""
    options = ["--cases", ",".join(names), "--out", str(out), "--no-plots"]
    if args.quick:
        options.append("--quick")
    for flag, value in (
        ("--rounds", args.rounds),
        ("--warmup", args.warmup),
        ("--min-time", args.min_time),
        ("--repeat", args.repeat if args.repeat != 1 else None),
        ("--device", args.device),
    ):
        if value is not None:
            options += [flag, str(value)]
    for flag, values in (("--sizes", args.sizes), ("--threads", args.threads)):
        if values:
            options += [flag, ",".join(str(v) for v in values)]
    if args.verbose:
        options.append("--verbose")
    return options


def _run_isolated(
    info: discovery.FamilyInfo,
    options: list[str],
    resume_from: Path | None,
    force: bool,
    out: Path,
    command: Sequence[str],
    stderr: TextIO,
) -> int | None:
    """Measures the family ``info`` in a process of its own (see the module docstring);
    it writes ``out/results.json`` as this run's: its family beside the others of
    ``resume_from/results.json`` (the run so far), if given.

    Returns None once it ended, or the exit status of this run when it was interrupted.
    """
    argv = [*command, *options, "--_only", info.name]
    if resume_from is not None:
        argv += ["--resume", str(resume_from)] + (["--force"] if force else [])
    inherit = stderr is sys.stderr  # else (a test's stream) its output is copied after
    process = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=None if inherit else subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent,
    )
    try:
        with _signals(_raise_terminated, [signal.SIGTERM]):
            _, errors = process.communicate()
            status = process.returncode
            if not inherit:
                stderr.write(errors)
    except KeyboardInterrupt as e:
        # Ctrl-C reached the child too; SIGTERM is handed on. Either way it writes what
        # finished, marked interrupted, and ends: that file is the run's.
        terminated = isinstance(e, _Terminated)
        if terminated:
            process.send_signal(signal.SIGTERM)
        with _signals(signal.SIG_IGN, [signal.SIGINT, signal.SIGTERM]):
            process.wait()
        signame = "SIGTERM" if terminated else "SIGINT"
        print(
            f"\ninterrupted ({signame}) while {info.name} ran in a process of its own: "
            f"{out / 'results.json'} holds what finished, marked incomplete. Finish the "
            f"run with: python -m benchmarks --resume {out}",
            file=stderr,
            flush=True,
        )
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    if status not in (0, 1):
        print(
            f"{info.name}: its process ended with status {status}; the run goes on.",
            file=stderr,
            flush=True,
        )
    return None


def _carried(
    document: dict[str, Any] | None, names: set[str], only: str | None, error: str
) -> list[dict[str, Any]]:
    """The records of the families ``names`` in ``document`` (a failed record, saying
    ``error``, for one that is not there)."""
    found = {f["name"]: f for f in (document or {}).get("families", [])}
    records = []
    for name in sorted(names):
        record = found.get(name)
        if record is None and name != only:
            record = {
                "name": name,
                "description": "",
                "module": f"benchmarks.bench_{name}",
                "default": True,
                "status": "failed",
                "error": error,
                "traceback": None,
                "duration_s": 0.0,
                "cases": [],
            }
        if record is not None:
            records.append(record)
    return records


def main(
    argv: Sequence[str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    gpus: Sequence[Any] | None = None,
    families: Sequence[discovery.FamilyInfo] | None = None,
    select_device: Callable[..., devices.DeviceChoice] = devices.select_device,
    child_command: Sequence[str] | None = None,
) -> int:
    """Runs the suite; returns the exit status (see the module docstring).

    ``gpus``, ``families``, ``select_device`` and ``child_command`` (how to start the
    suite in a child process) are for tests (fake GPUs, fake families).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.schema:
        print(json.dumps(schema.SCHEMA, indent=2), file=stdout)
        return 0
    if args.force and args.resume is None:
        p.error("--force only applies to --resume DIR")
    known = list(families) if families is not None else discovery.discover()
    if args.list:  # --list imports no TensorFlow: keep it fast.
        _list(known, stdout)
        return 0
    previous: dict[str, Any] | None = None
    if args.resume is not None:
        try:
            previous = resume.load(args.resume)
        except resume.ResumeError as e:
            print(f"error: {e}", file=stderr)
            return 2
        if previous.get("complete", True):
            print(
                f"{args.resume / 'results.json'} is a complete run: nothing to resume.",
                file=stderr,
            )
            return 0
        conflicts = _apply_resumed(args, previous, known)
        if conflicts:
            p.error(
                f"--resume {args.resume} continues the run as it was started (its options "
                f"come from {args.resume / 'results.json'}); these disagree with it: "
                + "; ".join(conflicts)
            )
    args.quick = bool(args.quick)
    args.repeat = args.repeat or 1
    if args.until is not None and not 1 <= args.until <= args.repeat:
        p.error(f"--_until {args.until}: a pass from 1 to --repeat ({args.repeat})")
    try:
        selected = discovery.select(known, args.cases)
    except discovery.UnknownFamilyError as e:
        p.error(str(e))
    names = [f.name for f in selected]
    if args.only is not None and args.only not in names:
        p.error(f"--_only {args.only!r} is not among the families selected")
    out: Path = args.out or args.resume or Path("bench-results")
    command = " ".join(["python -m benchmarks", *argv])
    # A full run measures its isolated families first, each in a process of its own,
    # before this one imports TensorFlow; then it goes on from what they wrote. Alone,
    # such a family runs here, unless it has several passes.
    isolated = (
        [f for f in selected if f.isolated]
        if args.only is None and not args.quick and (len(selected) > 1 or args.repeat > 1)
        else []
    )
    if _main_started(previous, {f.name for f in isolated}):
        isolated = []  # they ended before this process's families started
    isolated_names = {f.name for f in selected if f.isolated} if isolated else set()
    continued_by_us = False
    if isolated:
        out.mkdir(parents=True, exist_ok=True)
        options = _isolated_arguments(args, names, out)
        # One process per pass: TensorFlow keeps memory for every function a process
        # traced, so passes in one process would add up (the models family: 3.4 GB for
        # one pass, 7.8 GB for three); each process resumes what the one before wrote.
        passes: list[int | None] = list(range(1, args.repeat + 1)) if args.repeat > 1 else [None]
        for info in isolated:
            for until in passes:
                interrupted = _run_isolated(
                    info,
                    options + ([] if until is None else ["--_until", str(until)]),
                    out if continued_by_us else args.resume,
                    args.force,
                    out,
                    child_command or _child_command(),
                    stderr,
                )
                if interrupted is not None:
                    return interrupted
                continued_by_us = True
        try:
            previous = resume.load(out)
        except resume.ResumeError:
            previous = None  # nothing written: the isolated families are reported failed
    quiet = _quiet()
    verbose = args.verbose or quiet.verbose_requested([])
    quiet.quiet_tensorflow_startup(verbose)
    try:
        choice = select_device(args.device, gpus=gpus)
    except devices.DeviceUnavailableError as e:
        hint = "" if verbose else " --verbose shows TensorFlow's start-up log, which may say why."
        print(f"error: {e}{hint}", file=stderr)
        return 2
    ctx = devices.make_context(choice, args.quick, sizes=args.sizes, threads=args.threads)
    settings = _settings(args)
    meta = metadata.collect(choice, args.quick, command=command)
    resumed: list[dict[str, Any]] = []
    if previous is not None:
        differences = resume.mismatches(previous, meta)
        if differences and not args.force:
            print(
                f"error: --resume {out}: the run there was not started by this "
                "checkout on this device, so its figures would not compare with the new "
                "ones:\n  " + "\n  ".join(differences) + "\nRun it afresh (--out "
                "another directory), or pass --force to finish it anyway.",
                file=stderr,
            )
            return 2
        for line in differences:
            print(f"warning: --resume --force: {line}", file=stderr)
        resumed = list(previous.get("resumed", []))
        if args.resume is not None and args.only is None:
            resumed.append({"date_utc": meta["date_utc"], "command": command})
        started_here = meta
        meta = dict(previous["metadata"])
        if args.resume is None:  # this run's own isolated families wrote it
            meta["command"], meta["date_utc"] = command, started_here["date_utc"]
    # What other processes measured (the isolated families), reported as they wrote it.
    carried = _carried(
        previous, isolated_names, args.only, "its process of its own wrote no results"
    )
    running = [
        f
        for f in selected
        if f.name not in isolated_names and (args.only is None or f.name == args.only)
    ]
    if args.only is not None:  # the other families' results stay as they were
        carried = [f for f in (previous or {}).get("families", []) if f["name"] != args.only]
    done = sum(len(f["cases"]) for f in previous["families"]) if previous else 0
    print(
        f"safevars benchmarks ({meta['mode']}"
        f"{f', {args.repeat} passes' if args.repeat > 1 else ''}) on "
        f"{choice.kind.upper()} {choice.name} ({choice.device}): "
        f"{', '.join(f.name for f in running) or 'no families'}"
        + (f"; resuming {args.resume} ({done} case(s) done)" if args.resume else "")
        + (f"; {', '.join(sorted(isolated_names))} measured already" if isolated_names else ""),
        file=stderr,
        flush=True,
    )
    progress: list[list[dict[str, Any]]] = [
        [f for f in previous["families"] if f["name"] not in isolated_names] if previous else []
    ]

    def merged(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        by_name = {f["name"]: f for f in carried}
        by_name.update({f["name"]: f for f in results})
        return [by_name[name] for name in names if name in by_name]

    def document(results: list[dict[str, Any]], **state: Any) -> dict[str, Any]:
        return runner.build_document(
            meta, settings, ctx, merged(results), args.repeat, names, resumed=resumed, **state
        )

    def checkpoint(results: list[dict[str, Any]]) -> None:
        progress[0] = results
        partial = document(results, complete=False)
        report.write_json(partial, out / "results.json", compact=True)
        report.write_markdown(partial, out / "results.md")

    out.mkdir(parents=True, exist_ok=True)
    try:
        with _signals(_raise_terminated, [signal.SIGTERM]):
            results = runner.run_families(
                running,
                ctx,
                settings,
                progress=stderr,
                device_sync=devices.device_sync_for(choice),
                repeat=args.repeat,
                previous=[f for f in previous["families"] if f["name"] not in isolated_names]
                if previous
                else (),
                checkpoint=checkpoint,
                numbering={f.name: (names.index(f.name) + 1, len(names)) for f in running},
                until=args.until,
            )
    except KeyboardInterrupt as e:
        signame = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
        with _signals(signal.SIG_IGN, [signal.SIGINT, signal.SIGTERM]):
            partial = document(progress[0], complete=False, interrupted_by=signame)
            report.write_json(partial, out / "results.json")
            report.write_markdown(partial, out / "results.md")
        cases = sum(len(f["cases"]) for f in merged(progress[0]))
        print(
            f"\ninterrupted ({signame}): {out / 'results.json'} and results.md hold the "
            f"{cases} case(s) that finished, marked incomplete. Finish the run with: "
            f"python -m benchmarks --resume {out}",
            file=stderr,
            flush=True,
        )
        return 128 + (signal.SIGTERM if signame == "SIGTERM" else signal.SIGINT)
    if args.only is not None:  # a part of a run: the run's process writes the rest
        partial = document(results, complete=False)
        report.write_json(partial, out / "results.json")
        report.write_markdown(partial, out / "results.md")
        return 1 if any(f["status"] != "ok" for f in results) else 0
    document_ = document(results, complete=True)
    problems = schema.validate(document_)
    if problems:  # A bug in the runner: say so, still write what we have.
        print(
            "results.json does not match its schema:\n  " + "\n  ".join(problems[:20]),
            file=stderr,
        )
    report.write_json(document_, out / "results.json")
    written: list[Path] = []
    if not args.no_plots:
        try:
            written = plots.write_plots(document_, out, stderr)
        except Exception as e:  # noqa: BLE001 - plots are a convenience; never fail the run
            print(f"could not draw the plots ({type(e).__name__}: {e}); skipped.", file=stderr)
    report.write_markdown(document_, out / "results.md", [p.name for p in written])
    print(report.text_table(document_), file=stdout, end="", flush=True)
    print(
        f"wrote {out / 'results.json'}, {out / 'results.md'}"
        + (f" and {len(written)} plot(s)" if written else ""),
        file=stderr,
    )
    failed = [f["name"] for f in document_["families"] if f["status"] != "ok"]
    if failed:
        print(f"FAILED families: {', '.join(failed)} (see results.md)", file=stderr)
    missed = False
    if args.check or args.strict:
        missed, lines = check_goals(document_["goals"], strict=args.strict)
        print("\n".join(lines), file=stderr)
    return 1 if failed or problems or missed else 0


def _main_started(document: dict[str, Any] | None, isolated: set[str]) -> bool:
    """Whether the run being resumed got past its isolated families: it measures them
    first, so a family of its own process (any other) means they ended."""
    if document is None or not isolated:
        return False
    return any(f["name"] not in isolated for f in document["families"])
