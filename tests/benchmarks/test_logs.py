"""Holding log records and warnings while a progress line is open (:mod:`benchmarks.logs`,
used by :func:`benchmarks.runner.run_families`)."""

from __future__ import annotations

import io
import logging
import warnings

import pytest

from benchmarks import devices, logs, runner
from tests.support.benchmark_fakes import CPU, FakeClock, tiny_settings

NOISY_FAMILY = {
    "bench_noisy.py": """
        import logging, warnings
        from benchmarks.case import Case
        FAMILY = "noisy"
        def chatty():
            logging.getLogger("tensorflow").warning("5 out of the last 9 calls retraced")
            warnings.warn("a warning from a variant", UserWarning)
            return 1
        def cases(ctx):
            return [Case("noisy", f"case{i}", {"plain": lambda: 1, "chatty": chatty})
                    for i in (1, 2)]
    """,
}


@pytest.fixture
def one_stream(monkeypatch):
    """One stream for progress, TensorFlow's log and warnings, as stderr is for the CLI."""
    stream = io.StringIO()
    logger = logging.getLogger("tensorflow")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    monkeypatch.setattr(logger, "handlers", [handler])
    monkeypatch.setattr(logger, "propagate", False)
    monkeypatch.setattr(
        warnings,
        "showwarning",
        lambda message, category, *a, **k: stream.write(f"{category.__name__}: {message}\n"),
    )
    return stream


def test_runner_prints_logs_and_warnings_after_the_progress_line(family_package, one_stream):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        runner.run_families(
            family_package("noisybench_pkg", NOISY_FAMILY),
            devices.make_context(CPU, True),
            tiny_settings(),
            progress=one_stream,
            clock=FakeClock([]),
        )
    lines = one_stream.getvalue().splitlines()
    progress = [line for line in lines if line.startswith("[1/1 noisy | ") and " ... " in line]
    assert len(progress) == 2
    for line in progress:  # whole: the name, then the figures, nothing in between
        assert " ... " in line and " s: plain " in line and "WARNING" not in line, line
    for line in lines:
        if "retraced" in line:
            assert line == "WARNING:tensorflow:5 out of the last 9 calls retraced"
        if "a warning from a variant" in line:
            assert line == "UserWarning: a warning from a variant"
    # Held, then printed right after their case's line.
    first = lines.index(progress[0])
    assert "retraced" in lines[first + 1] and "UserWarning" in " ".join(lines[first + 1 :])


def test_held_records_are_replayed_once_in_order_through_the_restored_handlers():
    stream = io.StringIO()
    root, tf_logger = logging.getLogger(), logging.getLogger("tensorflow")
    handler = logging.StreamHandler(stream)
    saved = root.handlers[:], tf_logger.handlers[:], tf_logger.propagate
    try:
        root.handlers, tf_logger.handlers = [handler], [handler]
        tf_logger.propagate = True  # the record reaches both held loggers
        with logs.held() as held:
            tf_logger.warning("first")
            logging.getLogger("tensorflow.child").warning("second")
            assert stream.getvalue() == ""
            assert root.handlers == tf_logger.handlers == [held.collector]
        assert root.handlers == [handler] and tf_logger.handlers == [handler]
        assert stream.getvalue() == ""
        held.replay()
    finally:
        root.handlers, tf_logger.handlers, tf_logger.propagate = saved
    # Each record once per handler it reaches, as without the hold: the tensorflow
    # logger's handler, then the root's.
    assert stream.getvalue().splitlines() == ["first", "first", "second", "second"]


def test_held_warnings_are_shown_after_the_block(monkeypatch):
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(message))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with logs.held() as held:
            warnings.warn("held", UserWarning, stacklevel=1)
            assert shown == []
        held.replay()
    assert [str(m) for m in shown] == ["held"]
