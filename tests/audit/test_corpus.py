"""The corpus (``corpus.py``): every racy program reported, no safe one, by default.

Each program runs once, inside two audits at the same time: the default
(``predictive=True``) and ``predictive=False``, so both judge the very same execution.
The test prints both modes' recall (racy programs reported) and false alarms (safe
programs reported), and requires a perfect score in the default mode; the other mode's
figures are printed for comparison (it reports only what it saw overlap).
"""

from __future__ import annotations

import os
import re
import select

import numpy as np
import pytest

from safevars.audit import audit
from tests.audit.corpus import PROGRAMS, RACY, SAFE, small_model
from tests.support.threading_harness import JOIN_TIMEOUT, run_threads


def _run(program):
    prepared = program.prepare() if program.prepare else {}
    with audit() as predictive, audit(predictive=False) as observed:
        program.run(**prepared)
    return predictive, observed


def _score(results, mode):
    racy = [name for name, (label, reports) in results.items() if label == RACY]
    safe = [name for name, (label, reports) in results.items() if label == SAFE]
    missed = [n for n in racy if not results[n][1][mode].races]
    alarms = [n for n in safe if results[n][1][mode].races]
    return racy, safe, missed, alarms


def test_the_corpus_has_every_primitive_both_ways():
    assert len(PROGRAMS) >= 30
    assert len({p.name for p in PROGRAMS}) == len(PROGRAMS)
    labels = {}
    for p in PROGRAMS:
        labels.setdefault(p.primitive.split(" (")[0], set()).add(p.label)
    for primitive in (
        "Lock",
        "RLock",
        "Condition",
        "Semaphore",
        "Event",
        "Barrier",
        "Queue",
        "SimpleQueue",
        "Queue.task_done/join",
        "Timer",
        "tf.function",
    ):
        assert labels[primitive] == {RACY, SAFE}, primitive


def test_corpus_recall_and_false_alarms(capsys):
    results = {}
    for program in PROGRAMS:
        predictive, observed = _run(program)
        results[program.name] = (program.label, (predictive, observed))
    lines = [f"{'program':58} {'label':5}  default    predictive=False"]
    for program in PROGRAMS:
        label, (predictive, observed) = results[program.name]
        kinds = sorted({r.kind for r in predictive.races})
        lines.append(
            f"{program.name:58} {label:5}  {len(predictive.races):2} race(s) {len(observed.races):2} "
            f"race(s)  {', '.join(kinds)}"
        )
    summary = []
    for mode, title in ((0, "default (predictive=True)"), (1, "predictive=False")):
        racy, safe, missed, alarms = _score(results, mode)
        summary.append(
            f"{title}: recall {len(racy) - len(missed)}/{len(racy)}, "
            f"false alarms {len(alarms)}/{len(safe)}"
            + (f"; missed {missed}" if missed else "")
            + (f"; alarms {alarms}" if alarms else "")
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines + summary))
    racy, safe, missed, alarms = _score(results, 0)
    details = "\n\n".join(
        f"{name} ({results[name][0]}):\n{results[name][1][0]}" for name in missed + alarms
    )
    assert not missed and not alarms, summary[0] + "\n\n" + details


@pytest.mark.parametrize("name", ["torn_read_of_two_plain_writes", "plain_reads_of_a_section"])
def test_a_torn_read_is_its_own_finding(name):
    (program,) = [p for p in PROGRAMS if p.name == name]
    predictive, _ = _run(program)
    (race,) = predictive.races
    assert race.kind == "torn_read", str(predictive)
    assert race.variables == ("a:0", "b:0")
    assert len(race.threads) == 2
    assert race.read_sites and race.write_sites
    assert all("corpus.py" in site for site in race.read_sites + race.write_sites)
    assert "safevars.snapshot([a, b])" in race.fix


def _program(name):
    (program,) = [p for p in PROGRAMS if p.name == name]
    return program


def test_keras_findings_name_the_weights_the_call_and_the_fix():
    predictive, _ = _run(_program("keras_train_on_batch_from_two_threads"))
    races = predictive.races
    assert {r.kind for r in races} >= {"lost_update", "torn_read"}, str(predictive)
    assert all(r.calls == ("train_on_batch",) for r in races), str(predictive)
    assert all("safevars.scope()" in r.fix for r in races)
    (torn,) = [r for r in races if r.kind == "torn_read"]
    # Keras paths, not TensorFlow's "kernel:0": the layer's weights and the slots.
    assert any(re.fullmatch(r"sequential(_\d+)?/dense(_\d+)?/kernel", v) for v in torn.variables)
    assert any(
        re.fullmatch(r"sgd(_\d+)?/sequential\w*_kernel_momentum", v) for v in torn.variables
    )
    assert "from Keras train_on_batch" in str(predictive)


def test_an_optimizer_step_with_an_unlocked_forward_pass_is_a_torn_read():
    predictive, _ = _run(_program("keras_safe_optimizer_with_unlocked_forward_pass"))
    races = predictive.races
    assert races and {r.kind for r in races} == {"torn_read"}, str(predictive)
    assert all("apply_gradients" in r.calls for r in races)
    assert all("safevars.snapshot(model)" in r.fix for r in races)


def test_train_on_batch_in_turn_is_still_reported():
    # The two threads' calls never overlap: the second starts once the first is done,
    # ordered through a pipe (the audit does not see it). Nothing the audit understands
    # orders them, so the default mode reports them (predicted); predictive=False
    # cannot, having seen nothing overlap.
    model = small_model()
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    read_end, write_end = os.pipe()

    def work(i):
        if i == 1:
            ready, _, _ = select.select([read_end], [], [], JOIN_TIMEOUT)
            assert ready and os.read(read_end, 1) == b"x"
        model.train_on_batch(x, y)
        if i == 0:
            os.write(write_end, b"x")

    try:
        with audit() as predictive, audit(predictive=False) as observed:
            run_threads(2, work)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert predictive.races, str(predictive)
    assert {r.evidence for r in predictive.races} == {"predicted"}, str(predictive)
    assert observed.races == [], str(observed)
