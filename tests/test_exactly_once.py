"""safevars.exactly_once: steps retried after worker failures take effect once, for real.

``distributed/scripts/exactly_once_ps.py`` runs a ParameterServerStrategy cluster (3 workers, 1
parameter server, on 127.0.0.1) in a subprocess; workers 1 and 2 are processes of their
own that it kills (SIGKILL) and restarts mid-run, with a step in flight after its writes
reached the parameter server (certain duplicates) and at random moments. Nothing is
mocked. The in-process tests below check arguments and that ordinary writes pay nothing,
and run real tables and sections on this process's CPU through a coordinator stand-in
that runs each call at once: a failed write leaves its section unrecorded, compaction
bounds the tables, section ids are stable. Checkpoints with a killed coordinator are
``test_exactly_once_checkpoints.py``.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

import safevars
from safevars import exactly_once, locking, sections
from tests.distributed.cluster_harness import run_together, script

SEED, STEPS, RUNS, CANCEL_STEPS = 5, 100, 2, 40
TIMEOUT = 480.0  # Seconds for the cluster run; a bound on a hang, not a timing check.
VARIABLES = ("counter", "a", "b", "w")


@pytest.fixture(scope="module")
def cluster() -> dict:
    (result,) = run_together(
        [
            [
                script("exactly_once_ps.py"),
                "--seed",
                str(SEED),
                "--steps",
                str(STEPS),
                "--runs",
                str(RUNS),
                "--cancel-steps",
                str(CANCEL_STEPS),
            ]
        ],
        TIMEOUT,
    )
    return result


def assert_each_write_once(figures: dict, steps: int) -> None:
    """Every kind of write of ``steps`` steps applied exactly once (the main step)."""
    assert figures["counter"] == figures["counter_version"] == steps
    assert figures["a"] + figures["b"] == 1000.0
    assert figures["b"] == figures["a_version"] == figures["b_version"] == steps
    assert figures["accumulated"] == steps  # GradientAccumulator.add
    # add_and_take: each step added one contribution and took it, once.
    assert figures["taking"] == {"added": steps, "taken": steps, "takes": steps, "pending": 0}
    assert figures["w"] == [steps, steps] and figures["iterations"] == steps  # SafeOptimizer


# --------------------------------------------------------------------- worker failure


def test_the_problem_plain_schedule_applies_a_retried_step_twice(cluster):
    plain = cluster["plain"]
    assert plain["done"] == plain["scheduled"]
    assert plain["counter"] == plain["scheduled"] + 1
    assert plain["accumulated"] == plain["iterations"] == plain["scheduled"] + 1
    assert plain["taking"]["takes"] == plain["scheduled"] + 1
    assert plain["discarded"] == dict.fromkeys(VARIABLES, 0)


@pytest.mark.parametrize("run", range(RUNS))
def test_every_write_equals_the_steps_done_with_workers_killed(cluster, run):
    result = cluster["runs"][run]
    assert result["done"] == result["scheduled"] >= STEPS + 2
    assert result["outcomes"] == ["done"]
    assert_each_write_once(result, result["done"])
    assert result["accumulated_sum"] == [result["done"], result["done"]]


@pytest.mark.parametrize("run", range(RUNS))
def test_discarded_retries_are_counted_per_variable(cluster, run):
    result = cluster["runs"][run]
    # The step blocked on worker 1 after its writes was retried elsewhere: each of its
    # four sections was found applied and discarded.
    assert result["discarded_after_first_kill"] == dict.fromkeys(VARIABLES, 1)
    # And the one blocked on worker 2 (random kills may add more).
    assert all(result["discarded"][name] >= 2 for name in VARIABLES)


def test_a_section_waiting_for_a_dead_workers_value_applies_nothing(cluster):
    late = cluster["late"]
    assert late["done"] == late["scheduled"]
    assert late["a"] + late["b"] == 1000.0  # a half-applied attempt would break the sum
    assert late["a_version"] == late["b_version"] == late["scheduled"] == late["b"]


def test_kills_really_happened_on_the_parameter_server_cluster(cluster):
    assert cluster["kills"] == 2 + 4 * RUNS
    assert cluster["lock_device"] == "/job:ps/replica:0/task:0/device:CPU:0"
    assert cluster["table_devices"] == [cluster["lock_device"]]


# --------------------------------------------------------------------- failed and cancelled


def test_failed_and_cancelled_steps_report_exactly_what_they_applied(cluster):
    cancel = cluster["cancel"]
    first, before = cancel["first"], cancel["before_retry"]
    assert cancel["join_error"] == "InvalidArgumentError"
    assert cancel["poisoned_error"] == "InvalidArgumentError"
    assert cancel["poisoned_outcome"] == "applied"  # it failed after its update
    # The step blocked on worker 1 was cancelled after its update reached the PS: the
    # coordinator reports it as CancelledError, and outcome() says it was applied.
    assert cancel["cancelled_but_applied"] >= 1
    assert cancel["errors"]["CancelledError"] >= 1
    assert set(first) <= {"done", "applied", "not_applied"}  # one section: all or nothing
    assert before["counter"] == first["done"] + first["applied"]
    assert before["counter"] == before["counter_version"]
    assert sum(first.values()) == cancel["scheduled"]


def test_scheduling_every_step_again_by_token_completes_each_once(cluster):
    cancel = cluster["cancel"]
    assert cancel["final"] == {"done": cancel["scheduled"]}
    assert cancel["counter"] == cancel["counter_version"] == cancel["scheduled"]
    # Every step already applied (done or not) was discarded when scheduled again.
    assert cancel["discarded"]["counter"] == cancel["before_retry"]["counter"]
    assert cancel["before_retry"]["discarded"]["counter"] == 0


def test_a_discarded_section_returns_zeros_and_reads_are_read_again(cluster):
    retry = cluster["retry_of_done"]
    assert retry["tokens"][0] == retry["tokens"][1]
    # update's value, snapshot value and version, the transaction's b.assign_add value
    assert retry["first"] == [1.0, 1.0, 1.0, 1.0]
    assert retry["again"] == [0.0, 1.0, 1.0, 0.0]
    assert retry["counter"] == 1.0 and retry["a"] == 999.0 and retry["b"] == 1.0
    assert retry["discarded"] == {"counter": 1, "a": 1, "b": 1, "w": 0}


def test_optimizer_and_accumulator_inside_strategy_run_apply_once(cluster):
    replica = cluster["replica"]
    assert replica["merged"] == ["done", "done"]
    assert replica["w"] == [1.0, 1.0] and replica["iterations"] == 1
    assert replica["accumulated"] == 1
    assert replica["discarded"]["w"] == 1


def test_a_write_in_a_replica_function_is_refused_or_applied_once(cluster):
    replica = cluster["replica"]
    if replica["per_graph_hook"]:  # sections wraps sections traced in any thread
        assert replica["write"] == ["done", "done"]
        assert replica["counter"] == 1.0 and replica["discarded"]["counter"] == 1
    else:  # traced in a replica thread, unwrapped: refused rather than unprotected
        assert replica["write"].startswith("UnsupportedStrategyError")
        assert "replica function of strategy.run" in replica["write"]
        assert replica["counter"] == 0.0


@pytest.mark.parametrize(
    "case, message",
    [
        ("loop", "tf.while_loop"),
        ("nested", "another tf.function ('inner')"),
        ("traced_before", "traced outside this step"),
    ],
)
def test_sections_that_could_run_twice_per_step_are_refused(cluster, case, message):
    assert cluster["refused"][case].startswith("UnsupportedStrategyError")
    assert message in cluster["refused"][case]


def test_refused_steps_never_ran(cluster):
    # 1 from the plainly scheduled step that traced traced_before
    assert cluster["counter_after_refusals"] == 1.0


# --------------------------------------------------------------------- in process


def test_fn_must_be_callable():
    with pytest.raises(safevars.NotCallableError, match="fn"):
        exactly_once.schedule(object(), 3)


def test_coordinator_must_schedule():
    with pytest.raises(safevars.InvalidArgumentError, match="ClusterCoordinator"):
        exactly_once.schedule(object(), lambda: None)


@pytest.mark.parametrize("token", [-1, 2**42, 1.5, True, "7"])
def test_token_must_be_an_int_in_range(token):
    class Coordinator:
        def schedule(self, fn, args=None, kwargs=None):
            raise AssertionError("must not be reached")

    with pytest.raises(safevars.InvalidArgumentError, match="token"):
        exactly_once.schedule(Coordinator(), lambda: None, token=token)


def test_ordinary_writes_trace_no_extra_op_and_count_no_duplicates():
    v = safevars.SafeVariable(0.0)

    @tf.function
    def step():
        v.update(lambda x: x + 1.0)
        safevars.transaction([v], lambda: v.assign_add(1.0))

    ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
    assert not sections.body_wrappers()
    assert not any(t.startswith("LookupTable") or t == "If" for t in ops)
    step()
    assert v.numpy() == 2.0
    assert v.statistics().duplicates_discarded == 0
    assert v.guard not in locking.DUPLICATE_COUNTERS


# --------------------------------------------------------------------- in process, run


class _Attempt:
    """What ``_Coordinator.schedule`` returns: the call's result or error, at once."""

    def __init__(self, fn, args, kwargs):
        try:
            self.value, self.error = fn(*args, **kwargs), None
        except tf.errors.OpError as e:
            self.value, self.error = None, e

    def fetch(self):
        if self.error is not None:
            raise self.error
        return self.value


class _Coordinator:
    """Runs each scheduled call at once, in this process (no cluster): the tables and
    sections are the real ones, on this process's CPU."""

    def schedule(self, fn, args=None, kwargs=None):
        return _Attempt(fn, args or (), kwargs or {})


@pytest.fixture
def fresh_tables(monkeypatch):
    """A new process-wide Tables object for the test (the watermark is per object)."""
    monkeypatch.setattr(exactly_once.state, "TABLES", None)
    return exactly_once.tables


def _counting_step(v):
    @tf.function
    def step():
        v.update(lambda x: x + 1.0)

    return step


def test_a_retry_applies_the_section_whose_write_failed(fresh_tables):
    # The section's write fails (an assertion inside the section, before the write):
    # its table entry must not be recorded, so the retry with the same token applies.
    v = safevars.SafeVariable(0.0)
    failing = tf.Variable(True)

    @tf.function
    def step():
        def checked(x):
            ok = tf.debugging.Assert(tf.logical_not(failing.read_value()), ["injected"])
            with tf.control_dependencies([ok]):
                return x + 1.0

        v.update(checked)

    coordinator = _Coordinator()
    first = exactly_once.schedule(coordinator, step, token=7)
    with pytest.raises(tf.errors.InvalidArgumentError, match="injected"):
        first.fetch()
    assert first.outcome() == "not_applied"
    failing.assign(False)
    again = first.reschedule()
    assert again.outcome() == "done"
    assert v.numpy() == 1.0 and v.version == 1
    assert v.statistics().duplicates_discarded == 0
    assert exactly_once.schedule(coordinator, step, token=7).outcome() == "done"
    assert v.numpy() == 1.0 and v.statistics().duplicates_discarded == 1


_WRITES = {"AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp"}


def test_the_table_insert_waits_for_every_write_of_the_section(fresh_tables):
    # Graph check: in the branch that applies a section, each write (value and version)
    # is an ancestor of the LookupTableInsertV2 op (a worker that dies between them
    # must leave the section unrecorded).
    v = safevars.SafeVariable(0.0)
    step = _counting_step(v)
    exactly_once.schedule(_Coordinator(), step, token=1).fetch()
    function = exactly_once.steps._step_function(step).function
    graph_def = function.get_concrete_function(tf.TensorSpec([], tf.int64)).graph.as_graph_def()
    (branch,) = [
        f
        for f in graph_def.library.function
        if any(n.op == "LookupTableInsertV2" for n in f.node_def)
    ]
    nodes = {n.name: n for n in branch.node_def}
    (insert,) = [n for n in branch.node_def if n.op == "LookupTableInsertV2"]
    seen, stack = set(), [insert.name]
    while stack:
        for source in nodes[stack.pop()].input:
            name = source.lstrip("^").split(":")[0]
            if name in nodes and name not in seen:
                seen.add(name)
                stack.append(name)
    writes = [n.name for n in branch.node_def if n.op in _WRITES]
    assert len(writes) >= 2  # the value and its version
    assert set(writes) <= seen


def test_tables_stay_bounded_when_finished_tokens_are_compacted(fresh_tables):
    v = safevars.SafeVariable(0.0)
    step = _counting_step(v)
    coordinator, window, steps = _Coordinator(), 20, 200
    once = exactly_once.tables()
    sizes, removed = [], 0
    for i in range(steps):
        assert exactly_once.schedule(coordinator, step, token=i).outcome() == "done"
        sizes.append(once.size())
        if (i + 1) % window == 0:
            removed += once.compact(below=i + 1 - window)
    assert v.numpy() == steps and v.version == steps
    # One section per step: the entries of the last 2 windows at most, and the watermark.
    assert max(sizes) <= 2 * window + 1
    assert once.size() == window + 1
    assert removed == steps - window
    assert once.watermark == steps - window


def test_a_compacted_token_is_refused_and_a_late_attempt_of_it_writes_nothing(fresh_tables):
    v = safevars.SafeVariable(0.0)
    step = _counting_step(v)
    coordinator = _Coordinator()
    done = [exactly_once.schedule(coordinator, step, token=i) for i in range(5)]
    once = exactly_once.tables()
    assert once.compact(below=3) == 3
    assert once.compact(below=1) == 0 and once.watermark == 3  # never goes down
    with pytest.raises(safevars.InvalidArgumentError, match="watermark 3"):
        exactly_once.schedule(coordinator, step, token=2)
    with pytest.raises(safevars.InvalidArgumentError, match="watermark 3"):
        done[0].reschedule()
    # An attempt already on its way (scheduled before compact) is discarded on arrival.
    late = exactly_once.ScheduledStep(
        coordinator, exactly_once.steps._step_function(step), (), {}, 1
    )
    assert late.fetch() is None
    assert v.numpy() == 5.0 and v.statistics().duplicates_discarded == 1
    exactly_once.schedule(coordinator, step, token=3)  # at the watermark: a duplicate
    assert exactly_once.schedule(coordinator, step, token=5).outcome() == "done"
    assert v.numpy() == 6.0 and v.statistics().duplicates_discarded == 2


@pytest.mark.parametrize("below", [-1, 2**42 + 1, 1.5, True])
def test_compact_needs_a_token(fresh_tables, below):
    with pytest.raises(safevars.InvalidArgumentError, match="compact"):
        exactly_once.tables().compact(below)


def test_the_watermark_and_entries_are_restored_from_a_checkpoint(
    fresh_tables, monkeypatch, tmp_path
):
    v = safevars.SafeVariable(0.0)
    step = _counting_step(v)
    coordinator = _Coordinator()
    for i in range(4):
        exactly_once.schedule(coordinator, step, token=i)
    once = exactly_once.tables()
    once.compact(below=2)
    path = tf.train.Checkpoint(v=v, exactly_once=once).write(str(tmp_path / "ckpt"))
    for i in range(4, 6):
        exactly_once.schedule(coordinator, step, token=i)
    assert v.numpy() == 6.0 and once.size() == 5
    # What a new coordinator does: new variables, new tables, restored, every step again.
    monkeypatch.setattr(exactly_once.state, "TABLES", None)
    w = safevars.SafeVariable(0.0)
    restored = exactly_once.tables()
    restored.table_for(w.device)  # tables(strategy) creates them for parameter servers
    tf.train.Checkpoint(v=w, exactly_once=restored).read(path).assert_consumed()
    assert w.numpy() == 4.0 and restored.size() == 3
    step_w = _counting_step(w)  # the same step (qualified name): the same section ids
    with pytest.raises(safevars.InvalidArgumentError, match="watermark 2"):
        exactly_once.schedule(coordinator, step_w, token=1)
    assert restored.watermark == 2
    for i in range(2, 6):  # 2 and 3 are in the checkpoint; 4 and 5 apply, once
        assert exactly_once.schedule(coordinator, step_w, token=i).outcome() == "done"
    assert w.numpy() == 6.0 and w.statistics().duplicates_discarded == 2


def test_tables_requires_a_parameter_server_strategy():
    with pytest.raises(safevars.InvalidArgumentError, match="ParameterServerStrategy"):
        exactly_once.tables(tf.distribute.get_strategy())


def test_section_ids_are_the_same_in_a_new_process(fresh_tables):
    # A restored coordinator traces its steps again: each section must get the id it
    # had, whatever else was traced first (ids come from the step's name and the
    # section's place, not from a process-wide counter).
    a, b = safevars.SafeVariable(0.0), safevars.SafeVariable(0.0)

    @tf.function
    def step():
        a.update(lambda x: x + 1.0)
        safevars.transaction([a, b], lambda: b.assign_add(1.0))

    coordinator = _Coordinator()
    exactly_once.schedule(coordinator, step, token=0)
    first = [sid for _, sid in exactly_once.steps._step_function(step).traces[0].sections]
    exactly_once.schedule(coordinator, _counting_step(a), token=0)  # other sections
    again = exactly_once.steps._StepFunction(step)  # what a new process builds
    coordinator.schedule(again.function, args=(tf.constant(0, tf.int64),))
    assert [sid for _, sid in again.traces[0].sections] == first
    assert len(set(first)) == 2
    assert a.numpy() == 2.0 and b.numpy() == 1.0  # the retrace's sections: discarded
