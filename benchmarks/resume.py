"""Finishing an interrupted run: ``python -m benchmarks --resume DIR``.

A run writes ``results.json`` after every case (:mod:`benchmarks.runner`), marked
``"complete": false`` until its last family ended; a run stopped by Ctrl-C or SIGTERM
also says which signal (``interrupted_by``), a killed one (SIGKILL, a crash) leaves the
last such file. ``--resume DIR`` reads it and runs the same selection again with the
same settings (mode, rounds, repetitions, sizes, threads, warm-up and batch time, all
taken from the file), skipping every case the file already holds (measured or failed)
and keeping its figures; with ``--repeat`` a case that has fewer repetitions than the
run asked for gets the missing ones, pooled with those it has.

A run is only finished by the code and the device that started it: the file's commit
(``metadata.git_commit``) and device (kind, name, TensorFlow device) must be this
checkout's and this machine's, else :func:`mismatches` says what differs and the CLI
refuses unless ``--force``. Options that define the run (``--quick``, ``--cases``,
``--rounds``...) come from the file; given with ``--resume`` they must agree with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.schema import SCHEMA_VERSION, validate
from benchmarks.timing import VariantTiming

__all__ = ["ResumeError", "case_runs", "finished_cases", "load", "mismatches"]


class ResumeError(ValueError):
    """``--resume DIR`` cannot continue the run in ``DIR``; the message says why."""


def load(directory: Path) -> dict[str, Any]:
    """The ``results.json`` document of ``directory``.

    Raises:
      ResumeError: no such file, not JSON, or not a valid results document.
    """
    path = directory / "results.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResumeError(
            f"--resume {directory}: there is no {path} (the directory a run wrote with --out)."
        ) from None
    except (OSError, ValueError) as e:
        raise ResumeError(f"--resume {directory}: cannot read {path}: {e}") from None
    problems = validate(document)
    if problems:
        version = document.get("schema_version") if isinstance(document, dict) else None
        hint = (
            f" (schema version {version}; this suite writes {SCHEMA_VERSION})"
            if version != SCHEMA_VERSION
            else ""
        )
        raise ResumeError(
            f"--resume {directory}: {path} is not a results document this suite can "
            f"continue{hint}: {'; '.join(problems[:3])}"
        )
    return document


def mismatches(document: Mapping[str, Any], metadata: Mapping[str, Any]) -> list[str]:
    """What differs between the run in ``document`` and this one (``metadata`` as
    :func:`benchmarks.metadata.collect` gives it): the commit and the device."""
    old = document["metadata"]
    found = []
    if old["git_commit"] != metadata["git_commit"]:
        found.append(
            f"commit: the run was started at {old['git_commit'][:12]}, this checkout is at "
            f"{metadata['git_commit'][:12]}"
        )
    for key, label in (("kind", "device kind"), ("name", "device"), ("tf_device", "device")):
        before, now = old["device"][key], metadata["device"][key]
        if before != now:
            found.append(f"{label}: the run was started on {before!r}, this one is on {now!r}")
    return found


def finished_cases(document: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The cases ``document`` holds, by family name, then by case name."""
    return {
        family["name"]: {case["name"]: case for case in family["cases"]}
        for family in document["families"]
    }


def case_runs(case: Mapping[str, Any]) -> list[list[VariantTiming]]:
    """A recorded case's timings, one list of variants per repetition, as
    :func:`benchmarks.timing.measure` returned them (so they pool again with new ones).

    An empty list for a failed case.
    """
    if case["status"] != "ok" or not case["variants"]:
        return []
    repetitions = len(case["variants"][0]["rounds_per_repetition"])
    runs: list[list[VariantTiming]] = [[] for _ in range(repetitions)]
    for variant in case["variants"]:
        start = 0
        blocks = variant["rounds_per_repetition"]
        calls = variant["calls_per_batch_repetitions"]
        extras = variant["extra_rounds"]
        for index, count in enumerate(blocks):
            samples = variant["samples_s"][start : start + count]
            extra = (
                extras[start : start + count] if len(extras) == len(variant["samples_s"]) else []
            )
            runs[index].append(
                VariantTiming(
                    name=variant["name"],
                    calls_per_batch=calls[index] if index < len(calls) else calls[-1],
                    samples=list(samples),
                    extra_rounds=[dict(e) for e in extra],
                    blocks=[count],
                    calls_per_batch_blocks=[calls[index] if index < len(calls) else calls[-1]],
                )
            )
            start += count
    return runs
