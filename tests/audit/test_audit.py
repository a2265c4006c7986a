"""safevars.audit(): finds the lost-update race reliably, never on correct code, unpatches.

Workers start on a ``threading.Barrier`` (``run_threads``) and are joined with a
timeout. The race detector must not depend on an update actually being lost, so the
racy tests also run workloads where no update can be lost (one iteration per thread,
or threads forced to run one after the other) and still expect the finding.
"""

from __future__ import annotations

import glob
import json
import os
import select
import threading

import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from safevars.audit import CONCURRENT_WRITE, LOST_UPDATE, AuditReport, Race, audit
from safevars.audit import active as audit_active
from safevars.audit import patching as audit_patching
from safevars.audit import sites as audit_sites
from safevars.errors import InvalidArgumentError, RaceDetectedError
from tests.support.threading_harness import JOIN_TIMEOUT, run_threads

THREADS = 4


def _line(marker: str) -> str:
    """``"file:line"`` of the line of this file that ends with ``# <marker>``."""
    with open(__file__) as source:
        lines = [n for n, text in enumerate(source, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(lines) == 1, (marker, lines)
    return f"{__file__}:{lines[0]}"


def one_line_increment(v, iterations):
    for _ in range(iterations):
        v.assign(v.read_value() + 1)  # ONE-LINE


def two_line_increment(v, iterations):
    for _ in range(iterations):
        value = v.read_value()  # READ
        v.assign(value + 1)  # WRITE


def _lost_updates(report: AuditReport) -> list[Race]:
    return [r for r in report.races if r.kind == LOST_UPDATE]


# ---------------------------------------------------------------------- the race


@pytest.mark.parametrize("repeat", range(5))
def test_four_thread_lost_update_is_found_with_both_lines(repeat):
    v = tf.Variable(0.0, name="counter")
    with audit() as report:
        run_threads(THREADS, lambda i: one_line_increment(v, 25))
    races = _lost_updates(report)
    assert len(races) == 1, str(report)
    race = races[0]
    site = _line("ONE-LINE")
    assert race.variable == "counter:0"
    assert race.read_site == site
    assert race.write_sites == (site, site)
    assert len(race.threads) >= 2 and "MainThread" not in race.threads
    assert race.contexts == ("eager",)
    assert report.to_dict()["accesses"]["eager_or_replayed_writes"] == THREADS * 25


@pytest.mark.parametrize("repeat", range(3))
def test_separate_read_and_write_lines_are_named(repeat):
    v = tf.Variable(0.0, name="split")
    with audit() as report:
        run_threads(THREADS, lambda i: two_line_increment(v, 1))  # one RMW per thread
    races = _lost_updates(report)
    assert [(r.variable, r.read_site, r.write_sites) for r in races] == [
        ("split:0", _line("READ"), (_line("WRITE"), _line("WRITE")))
    ], str(report)


def test_found_even_when_the_threads_never_interleave():
    # Thread b starts its read-modify-write only after a has finished, ordered through an
    # OS pipe (another process could be in between: the audit does not see it): no update
    # is lost, yet nothing the audit understands orders the two.
    v = tf.Variable(0.0, name="sequential")
    read_end, write_end = os.pipe()

    def work(index):
        if index == 1:
            ready, _, _ = select.select([read_end], [], [], JOIN_TIMEOUT)
            assert ready and os.read(read_end, 1) == b"x"
        two_line_increment(v, 1)
        if index == 0:
            os.write(write_end, b"x")

    try:
        with audit() as report:
            run_threads(2, work)
        assert float(v.numpy()) == 2.0  # nothing was lost in this run
        (race,) = _lost_updates(report)
        assert race.evidence == "predicted"
        assert race.read_site == _line("READ")

        with audit(predictive=False) as observed_only:
            run_threads(2, work)
        assert observed_only.races == [], str(observed_only)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_an_event_between_the_two_orders_them():
    # The same program ordered by a threading.Event: correctly synchronized, never reported.
    v = tf.Variable(0.0, name="ordered")
    a_done = threading.Event()

    def work(index):
        if index == 1:
            assert a_done.wait(JOIN_TIMEOUT)
        two_line_increment(v, 1)
        if index == 0:
            a_done.set()

    with audit() as report:
        run_threads(2, work)
    assert report.races == [], str(report)


def test_safevariable_assign_of_an_unlocked_read_is_still_a_race():
    v = SafeVariable(0.0, name="safe_but_misused")
    with audit() as report:
        run_threads(THREADS, lambda i: one_line_increment(v, 5))
    (race,) = _lost_updates(report)
    assert race.variable == "safe_but_misused:0"
    # The write is made inside SafeVariable.assign (safevars/variable.py): the site is
    # still the user's line that called it.
    assert race.read_site == _line("ONE-LINE")
    assert race.write_sites == (_line("ONE-LINE"), _line("ONE-LINE"))


def test_concurrent_blind_writes_are_reported_but_commutative_adds_are_not():
    v = tf.Variable(0.0, name="blind")
    w = tf.Variable(0.0, name="adds")

    def work(index):
        for _ in range(5):
            v.assign(float(index))  # BLIND
            w.assign_add(1.0)

    with audit() as report:
        run_threads(THREADS, work)
    assert float(w.numpy()) == THREADS * 5
    assert [(r.kind, r.variable, r.write_sites) for r in report.races] == [
        (CONCURRENT_WRITE, "blind:0", (_line("BLIND"), _line("BLIND")))
    ], str(report)


# ---------------------------------------------------------------------- no false positives


def test_safevariable_update_has_no_finding():
    v = SafeVariable(0.0)
    with audit() as report:
        run_threads(THREADS, lambda i: [v.update(lambda x: x + 1) for _ in range(50)])
    assert report.races == [], str(report)
    assert float(v.numpy()) == THREADS * 50
    assert report.to_dict()["accesses"]["eager_or_replayed_writes"] == THREADS * 50


def test_locked_read_then_assign_has_no_finding():
    v = SafeVariable(0.0)

    def work(index):
        for _ in range(50):
            with safevars.locked(v):
                v.assign(v.read_value() + 1)

    with audit() as report:
        run_threads(THREADS, work)
    assert report.races == [], str(report)
    assert float(v.numpy()) == THREADS * 50


def test_plain_variable_inside_a_safevars_lock_has_no_finding():
    guard = SafeVariable(0.0)
    plain = tf.Variable(0.0)

    def work(index):
        for _ in range(20):
            with safevars.locked(guard):
                plain.assign(plain.read_value() + 1)

    with audit() as report:
        run_threads(THREADS, work)
    assert report.races == [], str(report)
    assert float(plain.numpy()) == THREADS * 20


def test_compare_and_assign_loop_has_no_finding():
    v = SafeVariable(0.0)

    def work(index):
        done = 0
        while done < 10:
            snap = v.snapshot()
            if v.compare_and_assign(snap.value + 1, snap.version):
                done += 1

    with audit() as report:
        run_threads(THREADS, work)
    assert report.races == [], str(report)
    assert float(v.numpy()) == THREADS * 10


def test_single_thread_and_reads_only_have_no_finding():
    v = tf.Variable(0.0)
    with audit() as report:
        one_line_increment(v, 20)
        run_threads(THREADS, lambda i: [v.read_value() + v.numpy() for _ in range(20)])
    assert report.races == [], str(report)
    assert report.to_dict()["accesses"]["eager_or_replayed_reads"] == 20 + THREADS * 40


def test_accesses_ordered_by_start_and_join_are_not_reported():
    v = tf.Variable(0.0, name="phased")
    with audit() as report:
        one_line_increment(v, 3)  # before the workers start
        run_threads(THREADS, lambda i: two_line_increment(v, 3))
        one_line_increment(v, 3)  # after they were joined
    (race,) = report.races
    assert (race.read_site, race.write_sites) == (_line("READ"), (_line("WRITE"),) * 2)
    assert "MainThread" not in race.threads


# ---------------------------------------------------------------------- tf.function


def test_tf_function_read_then_write_in_two_threads_is_found():
    v = tf.Variable(0.0, name="graph_counter")

    with audit() as report:

        @tf.function
        def step():
            value = v.read_value()  # GRAPH-READ
            v.assign(value + 1)  # GRAPH-WRITE

        run_threads(2, lambda i: [step() for _ in range(3)])
    (race,) = report.races
    assert race.kind == LOST_UPDATE and race.variable == "graph_counter:0"
    assert race.read_site == _line("GRAPH-READ")
    assert race.write_sites == (_line("GRAPH-WRITE"), _line("GRAPH-WRITE"))
    assert race.contexts == ("tf.function 'step'",)
    data = report.to_dict()
    assert data["accesses"]["traced"] == 2 and data["functions"]["calls"] == {"step": 6}
    assert "traced inside tf.function" in str(report)


def test_tf_function_variable_argument_is_attributed_to_the_variable_passed():
    traced_with = tf.Variable(0.0, name="traced_with")
    shared = tf.Variable(0.0, name="passed_in")

    with audit() as report:

        @tf.function
        def bump(var):
            var.assign(var.read_value() + 1)  # ARG-RMW

        bump(traced_with)  # traces with one variable...
        run_threads(2, lambda i: [bump(shared) for _ in range(2)])  # ...runs with another
    assert [(r.variable, r.read_site) for r in report.races] == [
        ("passed_in:0", _line("ARG-RMW"))
    ], str(report)
    assert float(traced_with.numpy()) == 1.0  # its one call was not mistaken for others


def test_tf_function_update_and_traced_before_the_audit():
    v = SafeVariable(0.0)
    plain = tf.Variable(0.0)

    @tf.function
    def old_step():
        plain.assign(plain.read_value() + 1)

    old_step()  # traced outside any audit: its calls cannot be analysed
    with audit() as report:

        @tf.function
        def safe_step():
            v.update(lambda x: x + 1)
            v.assign_add(1.0)

        run_threads(2, lambda i: [safe_step() for _ in range(3)])
        old_step()
    assert report.races == [], str(report)
    assert float(v.numpy()) == 12.0
    assert report.to_dict()["functions"]["not_analysed"] == {"old_step": 1}
    assert "traced before the audit began: 'old_step'" in str(report)


# ---------------------------------------------------------------------- sites


def cs_read_then_write(cs, v):
    value = cs.execute(v.read_value)  # CS-READ
    v.assign(value + 1)  # CS-WRITE


def test_a_site_is_the_users_line_never_a_frame_of_the_audit(mode):
    # The read in ``cs.execute(v.read_value)`` is made by TensorFlow code called from
    # the audit's own CriticalSection.execute wrapper (safevars/audit/recording.py): the
    # first frame that is not TensorFlow is the audit's, and the site must skip it (and
    # every other safevars file) to reach the line of this file that called execute.
    v = tf.Variable(0.0, name="cs_read")
    cs = tf.CriticalSection(name="cs_read_section")
    with audit() as report:
        step = mode(lambda: cs_read_then_write(cs, v))
        run_threads(2, lambda i: [step() for _ in range(2)])
    assert [(r.kind, r.read_site, r.write_sites) for r in report.races] == [
        (LOST_UPDATE, _line("CS-READ"), (_line("CS-WRITE"), _line("CS-WRITE")))
    ], str(report)


def test_every_safevars_file_is_safevars_code_and_this_file_is_user_code():
    safevars_dir = os.path.dirname(os.path.abspath(safevars.__file__))
    files = glob.glob(os.path.join(safevars_dir, "**", "*.py"), recursive=True)
    audit_files = [f for f in files if os.sep + "audit" + os.sep in f]
    assert len(audit_files) >= 5 and audit_sites.__file__ in audit_files
    assert {f: audit_sites._file_kind(f) for f in files} == dict.fromkeys(
        files, audit_sites._SAFEVARS
    )
    assert audit_sites._file_kind(__file__) == audit_sites._USER
    assert audit_sites._file_kind(threading.__file__) == audit_sites._INTERNAL
    assert audit_sites._file_kind(tf.Variable.assign.__code__.co_filename) == (
        audit_sites._INTERNAL
    )


# ---------------------------------------------------------------------- report and raising


def test_report_is_live_structured_and_readable():
    v = tf.Variable(0.0, name="live")
    with audit() as report:
        run_threads(THREADS, lambda i: one_line_increment(v, 3))
        assert report.active and len(report.races) == 1
    assert not report.active
    data = json.loads(json.dumps(report.to_dict()))
    (race,) = data["races"]
    assert race["kind"] == LOST_UPDATE and race["read_site"] == _line("ONE-LINE")
    assert race["variable"] == "live:0" and data["variables"] == ["live:0"]
    text = str(report)
    assert "1 race(s)" in text and "lost update on 'live:0'" in text
    assert "v.assign(v.read_value() + 1)" in text and "safevars.locked" in text
    with pytest.raises(dataclasses_frozen_error()):
        report.races[0].variable = "other"  # type: ignore[misc]


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_raise_on_race_raises_at_the_end_of_the_block():
    v = tf.Variable(0.0, name="raising")
    with pytest.raises(RaceDetectedError) as caught:
        with audit(raise_on_race=True):
            run_threads(THREADS, lambda i: one_line_increment(v, 3))
    assert isinstance(caught.value, AssertionError)
    assert "lost update on 'raising:0'" in str(caught.value)
    assert audit_active._SESSION is None


def test_raise_on_race_keeps_the_blocks_own_exception_and_passes_clean_code():
    v = tf.Variable(0.0)
    with pytest.raises(KeyError):
        with audit(raise_on_race=True):
            run_threads(THREADS, lambda i: one_line_increment(v, 3))
            raise KeyError("from the block")
    safe = SafeVariable(0.0)
    with audit(raise_on_race=True) as report:
        run_threads(THREADS, lambda i: [safe.update(lambda x: x + 1) for _ in range(5)])
    assert report.races == []


def test_invalid_arguments_are_refused():
    with pytest.raises(InvalidArgumentError, match="raise_on_race must be a bool"):
        audit(raise_on_race=1)
    with pytest.raises(ValueError, match="predictive must be a bool"):
        audit(predictive="yes")


# ---------------------------------------------------------------------- patching


def _current_functions() -> dict[tuple[type, str], object]:
    return {
        (owner, name): owner.__dict__[name] for owner, name, _ in audit_patching._patch_targets()
    }


def test_everything_is_unpatched_after_the_block_even_on_exception():
    originals = _current_functions()
    assert len(originals) >= 20
    with pytest.raises(RuntimeError, match="boom"):
        with audit():
            patched = _current_functions()
            assert [k for k in originals if patched[k] is originals[k]] == []
            raise RuntimeError("boom")
    assert _current_functions() == originals
    assert all(_current_functions()[k] is originals[k] for k in originals)
    assert audit_active._ACTIVE == () and audit_active._SESSION is None
    assert not audit_patching._ORIGINALS


def test_nested_audits_share_the_patches_and_see_their_own_period():
    originals = _current_functions()
    v = tf.Variable(0.0, name="outer_only")
    w = tf.Variable(0.0, name="both")
    with audit() as outer:
        run_threads(2, lambda i: one_line_increment(v, 2))
        with audit() as inner:
            run_threads(2, lambda i: one_line_increment(w, 2))
        assert not inner.active and outer.active
        assert _current_functions() != originals  # still patched for the outer audit
    assert _current_functions() == originals
    assert [r.variable for r in inner.races] == ["both:0"]
    assert sorted(r.variable for r in outer.races) == ["both:0", "outer_only:0"]
