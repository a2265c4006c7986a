"""Start TensorFlow without its C++ start-up log; ``--verbose`` shows it.

The examples and the benchmark CLI (``python -m benchmarks``) call
:func:`quiet_tensorflow_startup` before anything imports TensorFlow. Importing TensorFlow
2.21 on a machine without a GPU writes these lines to stderr, whatever
``TF_CPP_MIN_LOG_LEVEL`` says, because they are logged before TensorFlow's C++ logging
reads it (twice: two of its libraries each carry their own copy of absl)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:... port.cc:153] oneDNN custom operations are on. ...
    I0000 00:00:... cudart_stub.cc:31] Could not find cuda drivers on your machine, ...

and the first look at the devices adds ``E0000 ... cuda_platform.cc:52] failed call to
cuInit: ...``, which only ``TF_CPP_MIN_LOG_LEVEL=3`` hides (and with it every later C++
error). So, unless verbose, :func:`quiet_tensorflow_startup`:

1. sets ``TF_CPP_MIN_LOG_LEVEL=2`` (unless already set): later C++ INFO and WARNING lines
   are hidden, C++ errors still show;
2. imports TensorFlow and lists the physical devices with file descriptor 2 pointing to a
   temporary file, restores it, and writes back every captured line except the start-up
   chatter above (:func:`is_startup_noise`): a Python warning or any other message printed
   during the import still shows, and an exception raised by the import propagates (its
   traceback is printed after the descriptor is restored).

Python-level logging (``tf.get_logger()``, the ``warnings`` module) is left alone: a
retracing warning, for instance, still shows. Verbose (``--verbose`` on the command line,
or ``SAFEVARS_VERBOSE=1`` in the environment) changes nothing: TensorFlow logs what it
logs by default. Nothing happens when TensorFlow is already imported.

This file lives in ``examples/`` (the examples import it as ``_quiet``; the benchmark CLI
loads it by path) rather than in the ``safevars`` package because it has to run before
TensorFlow is imported, and ``import safevars`` imports TensorFlow.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Sequence

__all__ = [
    "VERBOSE_ENV",
    "add_verbose_argument",
    "is_startup_noise",
    "quiet_tensorflow_startup",
    "startup_noise",
    "verbose_requested",
]

VERBOSE_ENV = "SAFEVARS_VERBOSE"

# One absl/glog line: severity letter, MMDD, time (before absl is initialized it reads
# "00:00:<seconds since 1970>"), thread id, file:line] (TensorFlow 2.18 and newer); or
# TensorFlow's own format up to 2.17: date, time, then ": <severity> file:line] ".
_LOG_LINE = re.compile(
    r"^(?:(?P<severity>[IWEF])\d{4} [\d:.]+\s+\d+ [^:\]\s]+:\d+\] "
    r"|\d{4}-\d\d-\d\d [\d:.]+: (?P<old_severity>[IWEF]) [^:\]\s]+:\d+\] )"
)
_STARTUP_NOISE = (
    # absl's notice, printed once per library that logs before absl::InitializeLog().
    re.compile(
        r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    ),
    # The second line of cpu_feature_guard.cc's INFO message (TF_CPP_MIN_LOG_LEVEL=0 or 1).
    re.compile(
        r"^To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.$"
    ),
)
# ERROR lines that only say there is no usable CUDA driver (a CPU-only machine), or (up
# to TensorFlow 2.17) that a CUDA library's factory was registered twice at import.
_NO_CUDA_ERRORS = re.compile(
    r"failed call to cuInit|Unable to register cu(?:FFT|DNN|BLAS) factory: Attempting to "
    r"register factory for plugin cu(?:FFT|DNN|BLAS) when one has already been registered"
)


def verbose_requested(argv: Sequence[str] | None = None) -> bool:
    """Whether TensorFlow's start-up log is asked for.

    It is when ``--verbose`` is in ``argv`` (default ``sys.argv[1:]``, read before the
    example parses it) or ``SAFEVARS_VERBOSE`` is set to anything but ``""`` or ``"0"``.
    """
    args = sys.argv[1:] if argv is None else argv
    return "--verbose" in args or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def add_verbose_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--verbose`` to an example's ``parser``, so that ``--help`` lists it.

    :func:`verbose_requested` reads it before the parser runs; the parser only has to
    accept it.
    """
    parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"show TensorFlow's C++ start-up log (hidden by default; {VERBOSE_ENV}=1 also shows it)",
    )


def is_startup_noise(line: str) -> bool:
    """Whether ``line`` (without its newline) is TensorFlow start-up chatter.

    That is the absl notice above, any C++ INFO or WARNING line, the second line of the
    CPU-feature notice, and the ERROR line saying ``cuInit`` failed (no CUDA driver).
    Everything else, C++ errors and fatal messages included, is not noise.
    """
    if any(p.match(line) for p in _STARTUP_NOISE):
        return True
    m = _LOG_LINE.match(line)
    if m is None:
        return False
    severity = m["severity"] or m["old_severity"]
    if severity in "IW":
        return True
    return severity == "E" and _NO_CUDA_ERRORS.search(line) is not None


def startup_noise(text: str) -> list[str]:
    """The lines of ``text`` that :func:`is_startup_noise` calls start-up chatter."""
    return [line for line in text.splitlines() if is_startup_noise(line)]


def quiet_tensorflow_startup(verbose: bool | None = None) -> None:
    """Imports TensorFlow, hiding its start-up log unless ``verbose``.

    Call it before anything imports TensorFlow (Keras and ``safevars`` do); the
    ``import tensorflow as tf`` that follows finds it imported.

    Args:
      verbose: ``True`` imports TensorFlow and changes nothing else (its own defaults);
        ``None`` (default) means :func:`verbose_requested`.
    """
    if "tensorflow" in sys.modules:
        return
    if verbose is None:
        verbose = verbose_requested()
    if verbose:
        import tensorflow  # noqa: F401 - the same import, with everything it prints

        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # No usable descriptor 2: nothing to hide it from.
        _import_and_list_devices()
        return
    with tempfile.TemporaryFile() as captured:
        try:
            os.dup2(captured.fileno(), 2)
            try:
                _import_and_list_devices()
            finally:
                _flush_stderr()
                os.dup2(saved, 2)
        finally:
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            kept = [
                line
                for line in text.splitlines(keepends=True)
                if not is_startup_noise(line.rstrip("\r\n"))
            ]
            if kept and sys.stderr is not None:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _flush_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def _import_and_list_devices() -> None:
    import tensorflow as tf

    tf.config.list_physical_devices()  # The cuInit attempt (and its error line) happens here.
