"""Small programs with known answers for ``safevars.audit()``: each racy or safe.

Every synchronization the audit understands appears used correctly (``SAFE``) and
misused (``RACY``), next to Keras training from threads with and without a fix,
``tf.function`` steps, thread pools and torn reads with and without a snapshot. A racy
program is racy in every schedule the threads can take: where a misuse would only race
under some schedules, the program pins one (a barrier both threads pass before the
conflict) so that the answer does not depend on the scheduler. ``test_corpus.py`` runs
them all inside an audit and scores recall and false alarms.

A program is ``run(**prepared)``: ``prepare()``, if any, runs before the audit begins
(what it creates existed before the audit: locks the audit must find on its own).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import queue
import select
import threading
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import safevars
from tests.support.threading_harness import JOIN_TIMEOUT, join_all, run_threads

RACY = "racy"
SAFE = "safe"
ROUNDS = 3  # iterations per thread: enough to repeat, few enough to stay fast


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    label: str  # RACY or SAFE
    primitive: str  # what it is about (for the table)
    run: Callable[..., Any]
    prepare: Callable[[], dict[str, Any]] | None = None


PROGRAMS: list[Program] = []


def program(label: str, primitive: str, prepare: Callable[[], dict[str, Any]] | None = None):
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        PROGRAMS.append(Program(fn.__name__, label, primitive, fn, prepare))
        return fn

    return register


def rmw(v: tf.Variable) -> None:
    v.assign(v.read_value() + 1.0)


def counter(name: str = "counter") -> tf.Variable:
    return tf.Variable(0.0, name=name)


# ---------------------------------------------------------------------- locks


def increments(guard: Callable[[int], Any]) -> None:
    """Two threads add 1 to one variable ``ROUNDS`` times each, thread ``i`` inside
    ``with guard(i):``."""
    v = counter()

    def work(i):
        for _ in range(ROUNDS):
            with guard(i):
                rmw(v)

    run_threads(2, work)


# Made when this module is imported, long before any audit: found in the module globals.
MODULE_LOCK = threading.Lock()


@program(SAFE, "Lock")
def lock_around_read_modify_write():
    lock = threading.Lock()
    increments(lambda i: lock)


@program(RACY, "Lock")
def lock_taken_by_one_thread_only():
    lock = threading.Lock()
    increments(lambda i: lock if i == 0 else contextlib.nullcontext())


@program(RACY, "Lock")
def lock_one_per_thread():
    locks = [threading.Lock(), threading.Lock()]
    increments(lambda i: locks[i])


@program(RACY, "Lock")
def lock_around_the_write_only():
    v, lock = counter(), threading.Lock()

    def work(i):
        for _ in range(ROUNDS):
            value = v.read_value()
            with lock:
                v.assign(value + 1.0)

    run_threads(2, work)


@program(RACY, "Lock")
def lock_released_between_read_and_write():
    # Thread 0 reads under the lock, lets thread 1 run a whole increment (ordered through
    # a pipe, which the audit cannot see), then writes back under the lock: a lost update
    # that really happens, each access locked.
    v, lock = counter(), threading.Lock()
    to_1, to_0 = os.pipe(), os.pipe()  # (read end, write end) each

    def wait_for(pipe):
        ready, _, _ = select.select([pipe[0]], [], [], JOIN_TIMEOUT)
        assert ready and os.read(pipe[0], 1) == b"x"

    def work(i):
        if i == 0:
            with lock:
                value = v.read_value()
            os.write(to_1[1], b"x")
            wait_for(to_0)
            with lock:
                v.assign(value + 1.0)
        else:
            wait_for(to_1)
            with lock:
                rmw(v)
            os.write(to_0[1], b"x")

    try:
        run_threads(2, work)
    finally:
        for fd in (*to_1, *to_0):
            os.close(fd)


@program(SAFE, "Lock (module global, made before the audit)")
def lock_made_before_the_audit_in_a_global():
    increments(lambda i: MODULE_LOCK)


class Account:
    """A project object holding a lock and a variable, made before the audit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.balance = tf.Variable(0.0, name="balance")

    def deposit(self) -> None:
        with self.lock:
            rmw(self.balance)


@program(SAFE, "Lock (object attribute, made before the audit)", lambda: {"account": Account()})
def lock_made_before_the_audit_in_an_object(account):
    run_threads(2, lambda i: [account.deposit() for _ in range(ROUNDS)])


def _deposit(lock, v):
    for _ in range(ROUNDS):
        with lock:
            rmw(v)


@program(
    SAFE,
    "RLock (thread argument, made before the audit)",
    lambda: {"lock": threading.RLock(), "v": counter()},
)
def rlock_made_before_the_audit_passed_to_threads(lock, v):
    threads = [threading.Thread(target=_deposit, args=(lock, v)) for _ in range(2)]
    for t in threads:
        t.start()
    assert not join_all(threads)


@program(SAFE, "RLock")
def rlock_taken_twice():
    v, lock = counter(), threading.RLock()

    def work(i):
        for _ in range(ROUNDS):
            with lock:
                with lock:
                    rmw(v)

    run_threads(2, work)


@program(RACY, "RLock")
def rlock_taken_by_one_thread_only():
    lock = threading.RLock()
    increments(lambda i: lock if i == 0 else contextlib.nullcontext())


# ---------------------------------------------------------------------- conditions


@program(SAFE, "Condition")
def condition_hand_off():
    v, cond, state = counter(), threading.Condition(), {"ready": False}

    def work(i):
        if i == 0:
            rmw(v)
            with cond:
                state["ready"] = True
                cond.notify()
        else:
            with cond:
                assert cond.wait_for(lambda: state["ready"], JOIN_TIMEOUT)
            rmw(v)

    run_threads(2, work)


@program(RACY, "Condition")
def condition_notified_before_the_write():
    v, cond, state = counter(), threading.Condition(), {"ready": False}

    def work(i):
        if i == 0:
            with cond:
                state["ready"] = True
                cond.notify()
            rmw(v)  # after the notify: the waiter may already be writing
        else:
            with cond:
                assert cond.wait_for(lambda: state["ready"], JOIN_TIMEOUT)
            rmw(v)

    run_threads(2, work)


# ---------------------------------------------------------------------- semaphores


@program(SAFE, "Semaphore")
def semaphore_as_a_mutex():
    sem = threading.Semaphore(1)
    increments(lambda i: sem)


@program(RACY, "Semaphore")
def semaphore_admitting_two():
    v, sem, inside = counter(), threading.Semaphore(2), threading.Barrier(2)

    def work(i):
        with sem:
            inside.wait(JOIN_TIMEOUT)  # both hold it at once: it excludes nothing
            rmw(v)

    run_threads(2, work)


@program(SAFE, "BoundedSemaphore")
def bounded_semaphore_explicit_acquire_release():
    v, sem = counter(), threading.BoundedSemaphore(1)

    def work(i):
        for _ in range(ROUNDS):
            assert sem.acquire(timeout=JOIN_TIMEOUT)
            try:
                rmw(v)
            finally:
                sem.release()

    run_threads(2, work)


# ---------------------------------------------------------------------- events, barriers


@program(SAFE, "Event")
def event_set_after_the_write():
    v, done = counter(), threading.Event()

    def work(i):
        if i == 0:
            rmw(v)
            done.set()
        else:
            assert done.wait(JOIN_TIMEOUT)
            rmw(v)

    run_threads(2, work)


@program(RACY, "Event")
def event_set_before_the_write():
    v, started = counter(), threading.Event()

    def work(i):
        if i == 0:
            started.set()
            rmw(v)
        else:
            assert started.wait(JOIN_TIMEOUT)
            rmw(v)

    run_threads(2, work)


@program(SAFE, "Barrier")
def barrier_between_phases():
    v, phase = counter(), threading.Barrier(2)

    def work(i):
        for step in range(ROUNDS):
            if step % 2 == i:
                rmw(v)
            phase.wait(JOIN_TIMEOUT)

    run_threads(2, work)


@program(RACY, "Barrier")
def barrier_with_both_writing_in_one_phase():
    v, phase = counter(), threading.Barrier(2)

    def work(i):
        for _ in range(ROUNDS):
            rmw(v)
            phase.wait(JOIN_TIMEOUT)

    run_threads(2, work)


# ---------------------------------------------------------------------- queues


def _hand_off(make_queue: Callable[[], Any], put_first: bool) -> None:
    """Ping-pong: thread 0 increments and hands the turn over, thread 1 increments and
    hands it back (a queue each way). ``put_first``: thread 0 hands over too early."""
    v, turn, back = counter(), make_queue(), make_queue()

    def work(i):
        for n in range(ROUNDS):
            if i == 0:
                if put_first:
                    turn.put((n, "turn"))
                rmw(v)
                if not put_first:
                    turn.put((n, "turn"))
                back.get(timeout=JOIN_TIMEOUT)
            else:
                turn.get(timeout=JOIN_TIMEOUT)
                rmw(v)
                back.put((n, "back"))

    run_threads(2, work)


def _new_queue(kind: str) -> Callable[[], Any]:
    return lambda: getattr(queue, kind)()  # looked up when called: inside the audit


for _kind, _name, _racy_too in (
    ("Queue", "queue", True),
    ("LifoQueue", "lifo_queue", False),
    ("PriorityQueue", "priority_queue", False),
    ("SimpleQueue", "simple_queue", True),
):
    PROGRAMS.append(
        Program(
            f"{_name}_put_after_the_write",
            SAFE,
            _kind,
            functools.partial(_hand_off, _new_queue(_kind), put_first=False),
        )
    )
    if _racy_too:
        PROGRAMS.append(
            Program(
                f"{_name}_put_before_the_write",
                RACY,
                _kind,
                functools.partial(_hand_off, _new_queue(_kind), put_first=True),
            )
        )


@program(
    SAFE,
    "SimpleQueue (made before the audit)",
    lambda: {"queues": [queue.SimpleQueue(), queue.SimpleQueue()]},
)
def simple_queue_made_before_the_audit(queues):
    _hand_off(queues.pop, put_first=False)


@program(SAFE, "Queue.task_done/join")
def queue_join_waits_for_the_worker():
    v, q = counter(), queue.Queue()

    def worker():
        for _ in range(ROUNDS):
            q.get(timeout=JOIN_TIMEOUT)
            rmw(v)
            q.task_done()

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    for n in range(ROUNDS):
        q.put(n)
    q.join()
    rmw(v)  # the worker's increments are done: q.join() returned
    assert not join_all([thread])


@program(RACY, "Queue.task_done/join")
def queue_task_done_before_the_work():
    v, q = counter(), queue.Queue()

    def worker():
        for _ in range(ROUNDS):
            q.get(timeout=JOIN_TIMEOUT)
            q.task_done()
            rmw(v)  # after task_done: join() may already have returned

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    for n in range(ROUNDS):
        q.put(n)
    q.join()
    rmw(v)
    assert not join_all([thread])


# ---------------------------------------------------------------------- futures, timers


@program(SAFE, "ThreadPoolExecutor (submit, result)")
def future_result_before_the_next_write():
    v = counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        rmw(v)
        for _ in range(ROUNDS):
            pool.submit(rmw, v).result(timeout=JOIN_TIMEOUT)
            rmw(v)


def _warm_pool() -> dict[str, Any]:
    pool = concurrent.futures.ThreadPoolExecutor(2)
    pool.submit(int).result(timeout=JOIN_TIMEOUT)  # its worker and queue exist already
    return {"pool": pool}


@program(SAFE, "ThreadPoolExecutor (made before the audit)", _warm_pool)
def pool_made_before_the_audit(pool):
    v = counter()
    try:
        rmw(v)
        for _ in range(ROUNDS):
            pool.submit(rmw, v).result(timeout=JOIN_TIMEOUT)
            rmw(v)
    finally:
        pool.shutdown(wait=True)


@program(RACY, "ThreadPoolExecutor (submit, result)")
def future_not_waited_for():
    v = counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        future = pool.submit(rmw, v)
        rmw(v)  # the task may still be running
        future.result(timeout=JOIN_TIMEOUT)


@program(SAFE, "concurrent.futures.wait, as_completed, shutdown")
def futures_waited_for_in_every_way():
    v, w, x = counter("v"), counter("w"), counter("x")
    pool = concurrent.futures.ThreadPoolExecutor(2)
    done, _ = concurrent.futures.wait([pool.submit(rmw, v)], timeout=JOIN_TIMEOUT)
    assert len(done) == 1
    rmw(v)
    for future in concurrent.futures.as_completed([pool.submit(rmw, w)], timeout=JOIN_TIMEOUT):
        future.result()
    rmw(w)
    pool.submit(rmw, x)
    pool.shutdown(wait=True)
    rmw(x)


@program(RACY, "ThreadPoolExecutor (map)")
def pool_tasks_racing():
    v, both_running = counter(), threading.Barrier(2)

    def task(n):
        both_running.wait(JOIN_TIMEOUT)  # two workers at once, whatever the scheduler does
        rmw(v)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(task, range(2), timeout=JOIN_TIMEOUT))


@program(SAFE, "ThreadPoolExecutor (map, with a Lock)")
def pool_tasks_locked():
    v, lock = counter(), threading.Lock()

    def task(n):
        with lock:
            rmw(v)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(task, range(4), timeout=JOIN_TIMEOUT))
    rmw(v)


@program(SAFE, "Timer")
def timer_joined():
    v = counter()
    rmw(v)
    timer = threading.Timer(0.0, rmw, args=(v,))
    timer.start()
    assert not join_all([timer])
    rmw(v)


@program(RACY, "Timer")
def timer_not_joined():
    v = counter()
    timer = threading.Timer(0.0, rmw, args=(v,))
    timer.start()
    rmw(v)
    assert not join_all([timer])


@program(SAFE, "Thread.start/join")
def threads_joined_before_reading():
    v = counter()
    rmw(v)
    run_threads(1, lambda i: rmw(v))
    rmw(v)


# ---------------------------------------------------------------------- tf.function


@program(RACY, "tf.function")
def tf_function_steps_from_two_threads():
    v = counter()
    step = tf.function(lambda: rmw(v))
    run_threads(2, lambda i: [step() for _ in range(ROUNDS)])


@program(SAFE, "tf.function (under a Lock)")
def tf_function_steps_under_a_lock():
    v, lock = counter(), threading.Lock()
    step = tf.function(lambda: rmw(v))

    def work(i):
        for _ in range(ROUNDS):
            with lock:
                step()

    run_threads(2, work)


@program(SAFE, "tf.function (SafeVariable.update)")
def tf_function_steps_with_update():
    v = safevars.SafeVariable(0.0)
    step = tf.function(lambda: v.update(lambda x: x + 1.0))
    run_threads(2, lambda i: [step() for _ in range(ROUNDS)])


# ---------------------------------------------------------------------- torn reads


def _pair(kind: Callable[..., Any] = tf.Variable) -> tuple[Any, Any]:
    return kind(0.0, name="a"), kind(0.0, name="b")


def _writer_and_reader(
    a: Any, b: Any, guard: Any, write: Callable[[float], Any], read: Callable[[], Any]
) -> None:
    """Thread 0 calls ``write(n)`` and thread 1 ``read()``, ``ROUNDS`` times each; the
    writer inside ``with guard(0):``, the reader inside ``with guard(1):``."""

    def work(i):
        for n in range(ROUNDS):
            with guard(i):
                if i == 0:
                    write(float(n))
                else:
                    read()

    run_threads(2, work)


def _assign_both(a: Any, b: Any) -> Callable[[float], None]:
    def write(n: float) -> None:
        a.assign(n)
        b.assign(n)

    return write


def _in_one_section(a: Any, b: Any) -> Callable[[float], None]:
    def write(n: float) -> None:
        with safevars.locked(a, b):  # one section: seen whole or not at all
            a.assign(n)
            b.assign(n)

    return write


def _plain_reads(a: Any, b: Any) -> Callable[[], None]:
    return lambda: np.isfinite(a.numpy() - b.numpy())  # a and b read apart


def _unguarded(i: int) -> Any:
    return contextlib.nullcontext()


@program(RACY, "torn read (plain writes)")
def torn_read_of_two_plain_writes():
    a, b = _pair()
    _writer_and_reader(a, b, _unguarded, _assign_both(a, b), _plain_reads(a, b))


@program(SAFE, "torn read (snapshot of one section)")
def snapshot_of_a_section():
    a, b = _pair(safevars.SafeVariable)

    def read():
        snap_a, snap_b = safevars.snapshot([a, b])
        assert snap_a.numpy() == snap_b.numpy()

    _writer_and_reader(a, b, _unguarded, _in_one_section(a, b), read)


@program(RACY, "torn read (two snapshots taken apart)")
def two_snapshots_taken_apart():
    a, b = _pair(safevars.SafeVariable)

    def read():
        (snap_a,) = safevars.snapshot([a])
        (snap_b,) = safevars.snapshot([b])  # another instant
        assert np.isfinite(snap_a.numpy() - snap_b.numpy())

    _writer_and_reader(a, b, _unguarded, _in_one_section(a, b), read)


@program(RACY, "torn read (plain reads of one section)")
def plain_reads_of_a_section():
    a, b = _pair(safevars.SafeVariable)
    _writer_and_reader(a, b, _unguarded, _in_one_section(a, b), _plain_reads(a, b))


@program(SAFE, "torn read (one Lock on both sides)")
def reads_and_writes_under_one_lock():
    a, b = _pair()
    lock = threading.Lock()
    _writer_and_reader(a, b, lambda i: lock, _assign_both(a, b), _plain_reads(a, b))


@program(RACY, "torn read (Lock on the writer only)")
def lock_on_the_writer_only():
    a, b = _pair()
    lock = threading.Lock()
    guard = lambda i: lock if i == 0 else contextlib.nullcontext()  # noqa: E731
    _writer_and_reader(a, b, guard, _assign_both(a, b), _plain_reads(a, b))


@program(RACY, "torn read (tf.function update)")
def tf_function_update_read_eagerly():
    a, b = _pair()
    update = tf.function(_assign_both(a, b))
    _writer_and_reader(a, b, _unguarded, lambda n: update(tf.constant(n)), _plain_reads(a, b))


@program(RACY, "SafeVariable (assign of a snapshot's value)")
def snapshot_then_plain_assign():
    v = safevars.SafeVariable(0.0, name="counter")

    def work(i):
        for _ in range(ROUNDS):
            v.assign(v.snapshot().value + 1.0)  # the version is not checked: a lost update

    run_threads(2, work)


@program(SAFE, "SafeVariable (compare_and_assign of a snapshot)")
def snapshot_then_compare_and_assign():
    v = safevars.SafeVariable(0.0, name="counter")

    def work(i):
        done = 0
        while done < ROUNDS:
            snap = v.snapshot()
            done += bool(v.compare_and_assign(snap.value + 1.0, snap.version))

    run_threads(2, work)


# ---------------------------------------------------------------------- Keras


def _data() -> tuple[np.ndarray, np.ndarray]:
    return np.ones((4, 3), "float32"), np.ones((4, 2), "float32")


def small_model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    return model


def _scoped_model() -> keras.Model:
    with safevars.scope():
        return small_model()


@program(RACY, "Keras train_on_batch from two threads", lambda: {"model": small_model()})
def keras_train_on_batch_from_two_threads(model):
    x, y = _data()
    run_threads(2, lambda i: [model.train_on_batch(x, y) for _ in range(2)])


@program(SAFE, "Keras train_on_batch under a Lock", lambda: {"model": small_model()})
def keras_train_on_batch_under_a_lock(model):
    x, y = _data()
    lock = threading.Lock()

    def work(i):
        for _ in range(2):
            with lock:
                model.train_on_batch(x, y)

    run_threads(2, work)


@program(SAFE, "Keras train_on_batch in safevars.scope()", lambda: {"model": _scoped_model()})
def keras_train_on_batch_in_scope(model):
    x, y = _data()
    run_threads(2, lambda i: [model.train_on_batch(x, y) for _ in range(2)])


def _gradient_step(model, optimizer, x, y):
    with tf.GradientTape() as tape:
        loss = keras.ops.mean((model(x) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


@program(
    RACY,
    "Keras apply_gradients from two threads (shared weights read unlocked)",
    lambda: {
        "model": small_model(),
        "optimizer": safevars.SafeOptimizer(keras.optimizers.SGD(0.01)),
    },
)
def keras_safe_optimizer_with_unlocked_forward_pass(model, optimizer):
    # SafeOptimizer makes each update one section, but the forward pass reads weights
    # another thread is updating: a gradient from half-updated weights (a torn read).
    x, y = _data()
    optimizer.build(model.trainable_variables)
    run_threads(2, lambda i: [_gradient_step(model, optimizer, x, y) for _ in range(2)])


@program(
    SAFE,
    "Keras custom training step under a Lock",
    lambda: {"model": small_model(), "optimizer": keras.optimizers.SGD(0.01, momentum=0.9)},
)
def keras_custom_step_under_a_lock(model, optimizer):
    x, y = _data()
    optimizer.build(model.trainable_variables)
    lock = threading.Lock()

    def work(i):
        for _ in range(2):
            with lock:
                _gradient_step(model, optimizer, x, y)

    run_threads(2, work)
