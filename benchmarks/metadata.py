"""The facts recorded with every run: device, versions, machine, commit, date, mode."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.devices import DeviceChoice

__all__ = ["collect", "git_state"]

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_state(repo: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """``(commit, dirty)`` of ``repo``: ``("unknown", None)`` without git or a repository."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    try:
        dirty: bool | None = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        dirty = None
    return commit or "unknown", dirty


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except Exception:  # noqa: BLE001 - a missing or broken package is just "unknown"
        return "unknown"
    return str(getattr(module, "__version__", "unknown"))


def collect(
    choice: DeviceChoice,
    quick: bool,
    command: str = "python -m benchmarks",
    now: datetime.datetime | None = None,
    repo: Path = REPO_ROOT,
) -> dict[str, Any]:
    """The ``metadata`` object of ``results.json`` (see :mod:`benchmarks.schema`)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    commit, dirty = git_state(repo)
    return {
        "date_utc": now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mode": "quick" if quick else "full",
        "device": {
            "kind": choice.kind,
            "name": choice.name,
            "tf_device": choice.device,
            "details": dict(choice.details),
        },
        "tensorflow_version": _version("tensorflow"),
        "python_version": platform.python_version(),
        "numpy_version": _version("numpy"),
        "safevars_version": _version("safevars"),
        "cpu_count": os.cpu_count() or 1,
        "platform": platform.platform(),
        "git_commit": commit,
        "git_dirty": dirty,
        "command": command,
    }
