"""Lock coarsening: consecutive graph sections on the same locks share one mutex.

Each test checks both what is traced (how many mutexes a function takes: the point of
coarsening) and that the function still runs and keeps the guarantees; the cases where a
join would make a cycle or a wait out of lock order must trace separate sections.
"""

from __future__ import annotations

import tensorflow as tf

from safevars import SafeVariable
from tests.support.threading_harness import call_bounded, run_threads


def mutex_locks(function, *args) -> int:
    graph = function.get_concrete_function(*args).graph
    return sum(op.type == "MutexLock" for op in graph.get_operations())


def version_counts(graph, variable) -> list[int]:
    """What each version count of ``variable`` traced in ``graph`` adds, in order."""
    inner = {id(outer): inner for outer, inner in graph.captures}
    handle = inner[id(variable._self_guard.version_var.handle)]
    return [
        int(tf.get_static_value(op.inputs[1]))
        for op in graph.get_operations()
        if op.type == "AssignAddVariableOp" and op.inputs[0] is handle
    ]


def test_consecutive_writes_of_one_variable_take_one_mutex():
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def eight_writes():
        for _ in range(4):
            v.assign_add(1.0, read_value=False)
            v.update(lambda x: x * 2.0)
        return v.read_value()

    assert mutex_locks(eight_writes) == 1
    value = 0.0
    for _ in range(4):
        value = (value + 1.0) * 2.0
    assert float(eight_writes()) == value
    assert v.version == 8


def test_writes_of_a_variable_form_one_chain_and_joined_writes_share_one_count():
    """Each write waits for the write before it (one chain, not a fork after each write,
    where TensorFlow's executor hands the next large write to another thread: see
    safevars.variable.write_order), also across a section on other locks; the two
    joined writes of v are counted by one op adding 2, after both."""
    v, w = SafeVariable(tf.zeros([4])), SafeVariable(0.0)

    @tf.function(autograph=False)
    def writes():
        v.assign_add(tf.ones([4]), read_value=False)
        v.assign_add(tf.ones([4]), read_value=False)
        w.assign_add(1.0, read_value=False)
        v.assign(tf.fill([4], 5.0), read_value=False)

    graph = writes.get_concrete_function().graph
    inner = {id(outer): inner for outer, inner in graph.captures}
    value_handle = inner[id(v.handle)]
    count_handle = inner[id(v._self_guard.version_var.handle)]
    ops = [op for op in graph.get_operations() if op.type.startswith("Assign")]
    of_v = [op for op in ops if op.inputs[0] is value_handle]
    v_counts = [op for op in ops if op.inputs[0] is count_handle]
    assert len(of_v) == 3 and len(v_counts) == 2
    for previous, write in zip(of_v, of_v[1:]):
        assert previous in write.control_inputs
    assert [tf.get_static_value(count.inputs[1]) for count in v_counts] == [2, 1]
    assert set(of_v[:2]) <= set(v_counts[0].control_inputs)
    assert of_v[2] in v_counts[1].control_inputs
    assert mutex_locks(writes) == 3  # the first two joined; w's section; v's again
    writes()
    assert (v.numpy().tolist(), v.version, w.version) == ([5.0] * 4, 3, 1)


def test_a_version_read_between_joined_writes_sees_the_writes_before_it():
    """A count is not merged past a use of the version variable: the read between the
    writes sees 1, the one after them 3, with one mutex for the three writes."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def read_between():
        v.assign_add(1.0, read_value=False)
        between = v.version
        v.assign_add(1.0, read_value=False)
        v.assign_add(1.0, read_value=False)
        return between, v.version

    counts = version_counts(read_between.get_concrete_function().graph, v)
    assert counts == [1, 2]
    assert mutex_locks(read_between) == 1
    between, after = read_between()
    assert (int(between), int(after), v.version, float(v.numpy())) == (1, 3, 3, 3.0)


def test_a_long_run_of_joined_writes_is_one_count():
    """300 writes in a row: one mutex, one count adding 300 (each merge checks only the
    ops traced since the previous one)."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def many():
        for _ in range(300):
            v.assign_add(1.0, read_value=False)

    counts = version_counts(many.get_concrete_function().graph, v)
    assert counts == [300] and mutex_locks(many) == 1
    many()
    assert (v.version, float(v.numpy())) == (300, 300.0)


def test_a_write_that_may_not_join_after_tracing_counts_in_its_own_section():
    """The value comes from another section (w's), which the joined section must not wait
    for: the traced write gets mutexes of its own, and its count goes with it."""
    v, w = SafeVariable(0.0), SafeVariable(0.0)

    @tf.function(autograph=False)
    def from_other_section():
        from_w = w.assign_add(5.0)
        v.assign_add(1.0, read_value=False)
        v.assign(from_w, read_value=False)
        return v.read_value()

    counts = version_counts(from_other_section.get_concrete_function().graph, v)
    assert counts == [1, 1]
    assert mutex_locks(from_other_section) == 3
    assert float(from_other_section()) == 5.0
    assert (v.version, w.version) == (2, 1)


def test_eight_joined_writes_count_once_and_other_threads_see_whole_counts():
    """Eight assign_add in one function: one mutex and one count adding 8. Readers in
    other threads, taking the lock, see value and version move together: the version
    is always the value (each write adds 1.0), never in between."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def eight():
        for _ in range(8):
            v.assign_add(1.0, read_value=False)

    graph = eight.get_concrete_function().graph
    adds = [op for op in graph.get_operations() if op.type == "AssignAddVariableOp"]
    assert len(adds) == 9 and mutex_locks(eight) == 1  # 8 writes, 1 count
    seen = []

    def worker(index: int) -> None:
        for _ in range(50):
            if index == 0:
                eight()
            else:
                snap = v.snapshot()
                seen.append((float(snap.value), int(snap.version)))

    call_bounded(lambda: run_threads(3, worker), timeout=120)
    assert v.version == 400 and float(v.numpy()) == 400.0
    assert seen and all(value == version and version % 8 == 0 for value, version in seen)


def test_a_section_on_other_locks_in_between_ends_the_join():
    v, w = SafeVariable(0.0), SafeVariable(0.0)

    @tf.function(autograph=False)
    def alternate():
        v.assign_add(1.0, read_value=False)
        w.assign_add(1.0, read_value=False)
        v.assign_add(1.0, read_value=False)

    assert mutex_locks(alternate) == 3
    alternate()
    assert (float(v.numpy()), v.version, float(w.numpy()), w.version) == (2.0, 2, 1.0, 1)


def test_a_value_computed_from_the_earlier_result_does_not_join():
    """Joining would make the earlier result wait for the write it feeds: a cycle."""
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def chained():
        first = v.assign_add(1.0)  # 2
        v.assign(first * 10.0, read_value=False)  # 20
        return v.read_value()

    assert mutex_locks(chained) == 2
    assert float(chained()) == 20.0 and v.version == 2


def test_a_body_using_the_earlier_result_does_not_join():
    """The same cycle, through a tensor the update's fn captures instead of the value."""
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def captured():
        first = v.assign_add(1.0)  # 2
        v.update(lambda x: x + first * 10.0)  # 22
        return v.read_value()

    assert mutex_locks(captured) == 2
    assert float(captured()) == 22.0 and v.version == 2


def test_an_assertion_traced_between_two_sections_ends_the_join():
    """TensorFlow orders the assertion after the earlier release; a value that waits for
    it, written in a joined section, would close a cycle (seen in the accumulator)."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def checked_between(delta):
        v.assign_add(1.0, read_value=False)
        check = tf.debugging.Assert(delta > 0.0, ["delta must be positive"])
        with tf.control_dependencies([check]):
            value = tf.identity(delta)
        v.assign_add(value, read_value=False)
        return v.read_value()

    spec = tf.TensorSpec([], tf.float32)
    assert mutex_locks(checked_between, spec) == 2
    assert float(checked_between(tf.constant(2.0))) == 3.0 and v.version == 2


def test_a_read_after_the_earlier_result_ends_the_join():
    """TensorFlow orders the next write after a read of the same variable; a read that
    waits for the earlier section's result would close a cycle through a joined write."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def read_between():
        first = v.assign_add(1.0)
        with tf.control_dependencies([first]):
            seen = v.read_value()
        v.assign_add(2.0, read_value=False)
        return seen

    assert mutex_locks(read_between) == 2
    assert float(read_between()) == 1.0 and float(v.numpy()) == 3.0 and v.version == 2


def test_a_value_from_another_section_does_not_join():
    """A joined section would hold v's lock while waiting for w's section: out of order."""
    v, w = SafeVariable(0.0), SafeVariable(5.0)

    @tf.function(autograph=False)
    def reads_w_between():
        v.assign_add(1.0, read_value=False)
        seen = w.snapshot().value  # a section on w, then the open section is w's
        v.assign_add(seen, read_value=False)

    @tf.function(autograph=False)
    def reads_w_first():
        seen = w.snapshot().value  # computed before v's first section
        v.assign_add(1.0, read_value=False)
        v.assign_add(seen, read_value=False)

    assert mutex_locks(reads_w_between) == 3
    assert mutex_locks(reads_w_first) == 3
    reads_w_between()
    reads_w_first()
    assert float(v.numpy()) == 12.0 and v.version == 4


def test_a_function_call_or_a_dequeue_in_between_ends_the_join():
    """A joined section would hold v's lock while a called function takes other locks,
    or while a dequeue waits for a producer that may need v's lock."""
    v, w = SafeVariable(0.0), SafeVariable(0.0)
    queue = tf.queue.FIFOQueue(4, tf.float32, shapes=[[]])

    @tf.function(autograph=False)
    def write_w():
        w.assign_add(1.0, read_value=False)
        return tf.constant(2.0)

    @tf.function(autograph=False)
    def call_between():
        v.assign_add(1.0, read_value=False)
        two = write_w()
        v.assign_add(two, read_value=False)

    @tf.function(autograph=False)
    def dequeue_between():
        v.assign_add(1.0, read_value=False)
        v.assign_add(queue.dequeue(), read_value=False)

    assert mutex_locks(call_between) == 2  # v twice; w's lock is in the called graph
    assert mutex_locks(dequeue_between) == 2
    call_between()
    queue.enqueue(5.0)
    dequeue_between()
    assert (float(v.numpy()), v.version, w.version) == (9.0, 4, 1)


def test_a_body_with_an_assertion_gets_its_own_mutex():
    """An Assert is ordered after earlier stateful ops by TensorFlow: joined, it would
    wait for the release that waits for it."""
    v = SafeVariable(1.0)

    @tf.function(autograph=False)
    def checked(delta):
        v.assign_add(1.0, read_value=False)

        def positive(x):
            with tf.control_dependencies([tf.debugging.assert_positive(x)]):
                return x + delta

        v.update(positive)
        v.assign_add(1.0, read_value=False)  # may join the update's own section
        return v.read_value()

    spec = tf.TensorSpec([], tf.float32)
    assert mutex_locks(checked, spec) == 2
    assert float(checked(tf.constant(3.0))) == 6.0 and v.version == 3
    v.assign(-10.0)
    try:
        checked(tf.constant(3.0))
    except tf.errors.InvalidArgumentError:
        pass
    else:  # pragma: no cover - the assertion must fail
        raise AssertionError("assert_positive did not fail")
    # The first write was made (a graph does not roll back); the update and the write
    # after it were not.
    assert float(v.numpy()) == -9.0


def test_joined_writes_are_atomic_for_readers_and_other_writers():
    """Threads run the coarsened function while an eager writer adds and readers take
    snapshots: every update lands, and no reader sees half of a call."""
    v = SafeVariable(0.0)
    calls, eager_adds, reads = 40, 200, 300

    @tf.function(autograph=False)
    def two_halves():
        v.assign_add(1000.0, read_value=False)
        v.assign_add(1000.0, read_value=False)

    assert mutex_locks(two_halves) == 1
    halves_seen: list[float] = []

    def work(index: int) -> None:
        if index == 0:
            for _ in range(calls):
                two_halves()
        elif index == 1:
            for _ in range(eager_adds):
                v.assign_add(1.0)
        else:
            for _ in range(reads):
                value = float(v.snapshot().value)
                # Whole calls add multiples of 2000, the eager writer less than 1000.
                if int(value) // 1000 % 2:
                    halves_seen.append(value)

    run_threads(4, work)
    assert halves_seen == []
    assert float(v.numpy()) == 2000.0 * calls + eager_adds
    assert v.version == 2 * calls + eager_adds


def test_a_run_time_failure_inside_a_joined_section_releases_the_lock():
    """A fault in the second of two joined writes (a reshape that fails when it runs, of
    a value read in the section, so it runs there: a computation on the function's
    inputs alone may run before the lock is taken): the first write stays made, the
    second is not, and the mutex is free afterwards for an eager writer and for another
    traced section (each in a bounded wait)."""
    v = SafeVariable(0.0)

    @tf.function(autograph=False)
    def second_fails(parts):
        v.assign_add(1.0, read_value=False)
        # fails unless parts has 1 element
        v.update(lambda x: x + tf.reshape(parts + 0.0 * x, []))

    @tf.function(autograph=False)
    def add_two():
        v.assign_add(2.0, read_value=False)

    spec = tf.TensorSpec([None], tf.float32)
    assert mutex_locks(second_fails, spec) == 1
    try:
        second_fails(tf.constant([1.0, 2.0]))
    except tf.errors.InvalidArgumentError:
        pass
    else:  # pragma: no cover - the reshape must fail
        raise AssertionError("the reshape did not fail")
    assert float(v.numpy()) == 1.0 and v.version == 1
    call_bounded(lambda: v.assign_add(1.0))
    call_bounded(add_two)
    second_fails(tf.constant([5.0]))
    assert float(v.numpy()) == 10.0 and v.version == 5
