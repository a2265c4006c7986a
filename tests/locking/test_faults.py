"""Real faults against the locking core: asynchronous exceptions, SIGINT, threads that end
while holding a lock, contexts closed from another thread or never closed.

Every test ends by checking the lock is free (``statistics().locked``, ``held_locks()``)
and that value and version still pair up (each write adds 1 to both).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import tensorflow as tf

import safevars
from safevars import SafeVariable
from tests.support.deadlines import scaled
from tests.support.graphs import kept_with
from tests.support.threading_harness import in_frame, run_threads, wait_for


class Injected(BaseException):
    """The asynchronous exception the injector raises inside workers.

    A ``BaseException``, like the one real asynchronous exception, ``KeyboardInterrupt``:
    TensorFlow turns any ``Exception`` raised while it binds a ``tf.function``'s
    arguments into a ``TypeError`` (and Keras swallows one raised in its input-structure
    check), so an ``Exception`` landing there would never reach the worker's handler.
    """


def _inject(thread: threading.Thread) -> bool:
    """Raises ``Injected`` in ``thread``; False if the thread has ended."""
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(Injected)
    )
    return done == 1


def _run_with_injections(
    op, workers: int, injections: int, seed: int, lost: list[object] | None = None
) -> list[int]:
    """Runs ``op()`` in ``workers`` threads while injecting ``Injected`` into them.

    One injection is pending at a time: the injector waits until the worker caught the
    previous one and is back inside its ``try`` before the next. An injection that lands
    in a weak reference's callback or a ``__del__`` is swallowed by Python ("Exception
    ignored in ...", reported to ``sys.unraisablehook``, as a real ``KeyboardInterrupt``
    landing there would be): it is added to ``lost`` (the object whose callback or
    ``__del__`` swallowed it) and made again. Returns how many injections each worker
    caught.
    """
    rng = random.Random(seed)
    stop = threading.Event()
    start = threading.Barrier(workers + 1)
    ready = [False] * workers
    caught = [0] * workers
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        start.wait(timeout=scaled(30))
        while True:
            try:
                ready[k] = True
                while not stop.is_set():
                    op()
                break
            except Injected:
                ready[k] = False
                caught[k] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                ready[k] = False
                errors.append(e)
                break

    lost = [] if lost is None else lost
    previous_hook = sys.unraisablehook

    def swallowed(unraisable) -> None:
        if isinstance(unraisable.exc_value, Injected):
            lost.append(unraisable.object)
        else:
            previous_hook(unraisable)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(workers)]
    for t in threads:
        t.start()
    start.wait(timeout=scaled(30))
    sys.unraisablehook = swallowed
    try:
        while sum(caught) < injections:
            k = rng.randrange(workers)
            wait_for(lambda k=k: ready[k], f"worker {k} to be ready", 30, errors)
            before, lost_before = caught[k], len(lost)
            time.sleep(rng.random() * 0.003)
            if not _inject(threads[k]):
                wait_for(lambda: False, f"worker {k}, which ended, to catch", 1, errors)
            wait_for(
                lambda k=k, b=before, n=lost_before: (caught[k] > b and ready[k]) or len(lost) > n,
                f"worker {k} to catch",
                30,
                errors,
            )
    finally:
        sys.unraisablehook = previous_hook
        stop.set()  # (on a failure too: no worker goes on running the op)
    deadline = time.monotonic() + scaled(60)
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a worker hung after the injections"
    assert not errors, errors
    return caught


def test_the_injector_reports_a_workers_own_exception_instead_of_waiting():
    """A worker that dies of an exception other than the injected one never catches the
    next injection: the injector raises that exception at once, not a timeout 30 s on."""

    def op():
        raise ValueError("the worker's own error")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="a worker failed") as failure:
        _run_with_injections(op, workers=2, injections=5, seed=0)
    assert isinstance(failure.value.__cause__, ValueError)
    assert time.monotonic() - started < scaled(10)


def _spin(seconds: float) -> None:
    """Runs Python code for ``seconds`` (injections land in it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _SlowToDie:
    """An object whose ``__del__`` runs long enough for injections to land in it."""

    def __del__(self) -> None:
        _spin(0.0005)


def test_the_injector_makes_again_an_injection_python_swallowed_in_a_del():
    """An asynchronous exception raised inside ``__del__`` never reaches the worker:
    Python reports it as "ignored". The injector counts it as lost and injects again,
    instead of waiting for a catch that never comes (a 30 s timeout under load)."""

    def op():
        _SlowToDie()  # freed on this line: half of the op's time is in its __del__
        _spin(0.0005)

    lost: list[object] = []
    caught = _run_with_injections(op, workers=2, injections=40, seed=3, lost=lost)
    assert sum(caught) == 40
    assert lost, "no injection landed in __del__: the test tried nothing"
    assert {getattr(o, "__qualname__", o) for o in lost} == {"_SlowToDie.__del__"}, lost


def _assert_free_and_paired(v: SafeVariable) -> None:
    stats = v.statistics()
    assert not stats.locked and stats.owner is None and stats.depth == 0, stats
    assert safevars.held_locks() == []
    assert float(v.numpy()) == float(v.version), (float(v.numpy()), v.version)
    # And the lock still works: a bounded write from a fresh thread.
    run_threads(1, lambda _: v.assign_add(1.0, read_value=False))
    assert float(v.numpy()) == float(v.version)


def _make(runtime: bool) -> SafeVariable:
    v = SafeVariable(0.0)
    if runtime:
        kept_with(v, tf.function(lambda: v.assign_add(0.0), autograph=False))()  # run-time
        v.assign(0.0)
        v.guard.set_version(0)
        assert v.statistics().runtime_mode
    return v


def _locked_add(v):
    with safevars.locked(v):
        v.assign_add(1.0, read_value=False)


def _transaction_add(v):
    safevars.transaction([v], lambda: v.assign_add(1.0, read_value=False))


OPS = {
    "update": lambda v: v.update(lambda x: x + 1.0),
    "assign_add": lambda v: v.assign_add(1.0, read_value=False),
    "locked": _locked_add,
    "transaction": _transaction_add,
}

# Every operation, eagerly and in run-time mode.
EVERY_OP = pytest.mark.parametrize(
    "name,runtime",
    [(name, runtime) for name in sorted(OPS) for runtime in (False, True)],
    ids=[f"{name}-{mode}" for name in sorted(OPS) for mode in ("eager", "runtime")],
)


@EVERY_OP
def test_asynchronous_exceptions_never_orphan_a_lock_or_split_value_and_version(name, runtime):
    v, op = _make(runtime), OPS[name]
    caught = _run_with_injections(lambda: op(v), workers=4, injections=150, seed=len(name))
    assert sum(caught) == 150
    assert v.version > 0
    _assert_free_and_paired(v)


def _two_variable_move():
    """Two variables and a ``locked(a, b)`` section adding 1 to each."""
    a, b = SafeVariable(0.0), SafeVariable(0.0)

    def move():
        with safevars.locked(a, b):
            a.assign_add(1.0, read_value=False)
            b.assign_add(1.0, read_value=False)

    return a, b, move


def test_asynchronous_exceptions_into_multi_variable_sections():
    a, b, move = _two_variable_move()
    _run_with_injections(move, workers=4, injections=150, seed=7)
    for v in (a, b):
        _assert_free_and_paired(v)


_SIGINT_CHILD = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, json, threading
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's stack dump
    import safevars

    v = safevars.SafeVariable(0.0)
    stop = threading.Event()

    def background():
        while not stop.is_set():
            v.update(lambda x: x + 1.0)

    workers = [threading.Thread(target=background) for _ in range(2)]
    for t in workers:
        t.start()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    interrupts = 0
    while True:
        try:
            print("ready", flush=True)
            while not stop.is_set():
                with safevars.locked(v):
                    v.assign_add(1.0, read_value=False)
            break
        except KeyboardInterrupt:
            interrupts += 1
    for t in workers:
        t.join(60)
    stats = v.statistics()
    print(json.dumps({
        "interrupts": interrupts, "locked": stats.locked, "value": float(v.numpy()),
        "version": v.version, "held": len(safevars.held_locks()),
    }), flush=True)
    """
)


def test_sigint_in_a_process_never_orphans_a_lock():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryFile(mode="w+") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-c", _SIGINT_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        rng = random.Random(3)

        def next_line(limit: float) -> str | None:
            ready, _, _ = select.select([child.stdout], [], [], limit)
            return child.stdout.readline().strip() if ready else None

        def child_state() -> str:
            """The child's threads' stacks (faulthandler) and whatever it printed."""
            if child.poll() is None:
                child.send_signal(signal.SIGUSR1)
                time.sleep(2)
            stderr.seek(0)
            return stderr.read()[-6000:]

        try:
            assert next_line(scaled(120)) == "ready", child_state()
            for sent in range(40):
                time.sleep(rng.random() * 0.02)
                # CPython can run the SIGINT handler inside some object's finalizer, which
                # swallows the KeyboardInterrupt ("Exception ignored in ..."): send again.
                for _attempt in range(5):
                    child.send_signal(signal.SIGINT)
                    line = next_line(scaled(10))
                    if line is not None:
                        break
                assert line == "ready", (
                    f"the child stopped answering after {sent} interrupts ({line!r}); "
                    f"its stacks and output:\n{child_state()}"
                )
            child.stdin.write("stop\n")
            child.stdin.flush()
            result = json.loads(next_line(scaled(180)) or "{}")
            assert child.wait(timeout=scaled(120)) == 0, child_state()
        finally:
            if child.poll() is None:
                child.kill()
        assert result["interrupts"] == 40
        assert not result["locked"] and result["held"] == 0
        assert result["value"] == result["version"] > 0


def _in_thread(fn, name: str = "holder") -> threading.Thread:
    t = threading.Thread(target=fn, name=name, daemon=True)
    t.start()
    t.join(scaled(30))
    assert not t.is_alive()
    return t


def test_a_lock_whose_thread_ended_is_taken_back_by_the_next_waiter():
    v = SafeVariable(0.0)
    kept = []

    def enter_and_leave_thread():
        cm = safevars.locked(v)
        cm.__enter__()
        v.assign_add(1.0)
        kept.append(cm)  # Kept alive: only the thread's end can tell it was abandoned.

    _in_thread(enter_and_leave_thread)
    assert v.statistics().locked
    # The next writer waits at most one poll interval, then takes the lock back.
    run_threads(1, lambda _: v.assign_add(1.0))
    stats = v.statistics()
    assert stats.takeovers == 1 and not stats.locked
    assert float(v.numpy()) == 2.0 and v.version == 2


def test_a_new_thread_is_never_mistaken_for_a_dead_holder():
    v = SafeVariable(0.0)
    kept = []
    _in_thread(lambda: kept.append(safevars.locked(v)) or kept[0].__enter__())
    depths = []

    def later_thread(_):
        # Thread identifiers are reused; holders are Thread objects, so this thread
        # takes the lock for itself (depth 1, a takeover), never re-enters it.
        with safevars.locked(v):
            depths.append(v.statistics().depth)
            held = safevars.held_locks()
            assert [h.thread_name for h in held] == [threading.current_thread().name]

    for _ in range(3):
        run_threads(1, later_thread)
    assert depths == [1, 1, 1]
    assert v.statistics().takeovers == 1


def test_a_section_opened_by_a_takeover_is_never_read_half_written():
    """Optimistic snapshots racing the section of a thread that took a lock back.

    A thread enters ``safevars.locked(a, b)`` by hand and ends inside it. The writer then
    takes both locks back (a takeover) and, in that section and the ones after it, moves
    1 from ``a`` to ``b`` in two writes with a pause between them, while two readers take
    eager (optimistic) snapshots. The taken-back section must mark the locks' sequence
    numbers odd like any other section, so that no reader trusts a read made inside it:
    every snapshot has ``a + b == 100`` and equal versions.
    """
    a, b = SafeVariable(100.0), SafeVariable(0.0)
    kept = []
    _in_thread(lambda: kept.append(safevars.locked(a, b)) or kept[0].__enter__())
    assert [h.thread_alive for h in safevars.held_locks()] == [False, False]
    inside = threading.Event()  # The writer is in the section it took back.
    done = threading.Event()
    torn: list[tuple[float, float, int, int]] = []
    snapshots = [0, 0]

    def move() -> None:
        a.assign_sub(1.0, read_value=False)
        time.sleep(0.0005)  # Half written: what no snapshot may see.
        b.assign_add(1.0, read_value=False)

    def role(i: int) -> None:
        if i == 0:
            try:
                with safevars.locked(a, b):  # Waits one poll interval, then takes over.
                    inside.set()
                    for _ in range(40):
                        move()
                for _ in range(60):
                    with safevars.locked(a, b):
                        move()
            finally:
                inside.set()
                done.set()
            return
        assert inside.wait(scaled(30))
        while True:
            finished = done.is_set()
            x, y = safevars.snapshot([a, b])
            snapshots[i - 1] += 1
            if float(x.value) + float(y.value) != 100.0 or x.version != y.version:
                torn.append((float(x.value), float(y.value), x.version, y.version))
            if finished:
                break

    run_threads(3, role)
    assert torn == [], f"{len(torn)} of {sum(snapshots)} snapshots torn, e.g. {torn[:3]}"
    assert a.statistics().takeovers == 1 and b.statistics().takeovers == 1
    assert (float(a.numpy()), float(b.numpy()), a.version, b.version) == (0.0, 100.0, 100, 100)


def test_closing_a_kept_context_from_another_thread_releases_all_its_locks():
    x, y = SafeVariable(1.0), SafeVariable(2.0)
    kept = []
    entered = threading.Event()
    release = threading.Event()

    def holder():
        cm = safevars.locked(x, y)
        cm.__enter__()
        kept.append(cm)
        entered.set()
        release.wait(scaled(30))

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    assert entered.wait(scaled(30))
    assert x.statistics().locked and y.statistics().locked
    kept[0].__exit__(None, None, None)  # From the main thread.
    assert not x.statistics().locked and not y.statistics().locked
    assert safevars.held_locks() == []
    run_threads(2, lambda i: (x, y)[i].assign_add(1.0))
    release.set()
    t.join(scaled(30))
    assert (x.version, y.version) == (1, 1)


def test_a_context_dropped_without_exit_releases_its_locks():
    v = SafeVariable(0.0)
    cm = safevars.locked(v)
    cm.__enter__()
    assert v.statistics().locked
    del cm
    gc.collect()
    assert not v.statistics().locked and safevars.held_locks() == []
    run_threads(1, lambda _: v.assign_add(1.0))
    assert v.version == 1


def _ours(frame) -> bool:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.startswith("safevars") or name == __name__


class _FaultAt:
    """Raises ``Injected`` at the ``k``-th check point of safevars' code in this thread.

    CPython delivers asynchronous exceptions only at check points: when a function
    starts and right after a call to a C function returns. ``sys.setprofile`` reports
    exactly those moments (``call`` and ``c_return`` events), and an exception raised by
    the profile function is raised there. Trying every ``k`` therefore puts an
    interrupt at every point where a real one could land in safevars' frames (and in
    the test's), deterministically. A ``return`` event of a TensorFlow function called
    from safevars stands for an interrupt that lands inside TensorFlow's Python code
    after its effect: the call raises although its work is done. Points deeper inside
    TensorFlow are left out (an exception raised inside TensorFlow's C++ callbacks can
    crash the process, with or without safevars).
    """

    def __init__(self, k: int) -> None:
        self.k = k
        self.seen = 0
        self.fired = False

    def __call__(self, frame, event, arg):
        if event == "c_return":
            hit = _ours(frame)
        elif event == "call":
            hit = _ours(frame) or _ours(frame.f_back)
        elif event == "return":
            hit = not _ours(frame) and _ours(frame.f_back)
        else:
            hit = False
        if hit:
            if self.seen == self.k:
                sys.setprofile(None)
                self.fired = True
                raise Injected(f"check point {self.k}")
            self.seen += 1


def _every_check_point(op, variables, check=None) -> int:
    """Runs ``op`` once per check point with an exception there; returns how many.

    After each run every lock of ``variables`` must be free and each value must equal
    its version (every write adds 1 to both), and ``check(k)`` (if given) must pass, or
    the test fails naming the point.
    """
    k = 0
    while True:
        fault = _FaultAt(k)
        sys.setprofile(fault)
        try:
            op()
        except Injected:
            pass
        finally:
            sys.setprofile(None)
        if check is not None:
            check(k)
        for v in variables:
            stats = v.statistics()
            assert not stats.locked, f"an exception at check point {k} orphaned the lock"
            assert float(v.numpy()) == float(v.version), (
                f"an exception at check point {k} split value {float(v.numpy())} and "
                f"version {v.version}"
            )
        if not fault.fired:
            return k
        k += 1


# An exception injected at the first instruction of a hold's __del__ (after __exit__
# already released everything) is reported as "ignored" by Python: expected here.
_IGNORED_IN_DEL = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_IGNORED_IN_DEL
@EVERY_OP
def test_an_exception_at_every_check_point_leaves_locks_free_and_versions_paired(name, runtime):
    v, op = _make(runtime), OPS[name]
    assert _every_check_point(lambda: op(v), [v]) > 5
    gc.collect()
    _assert_free_and_paired(v)


@_IGNORED_IN_DEL
def test_an_exception_at_every_check_point_of_a_two_variable_section():
    a, b, move = _two_variable_move()
    assert _every_check_point(move, [a, b]) > 10
    gc.collect()
    for v in (a, b):
        _assert_free_and_paired(v)


@_IGNORED_IN_DEL
def test_an_exception_at_every_check_point_of_a_traced_write_leaves_no_call_counted():
    """An eager call of a function whose graph takes a lock is counted on the lock while
    it runs (``lock.graph_calls``; eager sections take the mutex meanwhile): an
    exception anywhere in the call leaves the lock free and no call counted (a token
    left behind would make every later eager section take the mutex for nothing)."""
    v = SafeVariable(0.0)
    write = kept_with(v, tf.function(lambda: v.assign_add(1.0), autograph=False))
    write()
    lock = v.guard.lock
    counted: list[int] = []

    def check(k: int) -> None:
        assert lock.graph_calls == [], f"an exception at check point {k} left a call counted"
        counted.append(k)

    assert _every_check_point(write, [v], check) > 5
    assert len(counted) > 5 and v.version > 1


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_asynchronous_exceptions_into_optimizer_steps_keep_joint_versions_together(traced):
    """Steps of a SafeOptimizer whose model variables share a joint version counter
    (one add counts them all), eagerly in run-time mode and traced with the whole step
    locked (``lock_span="step"``). An interrupt anywhere leaves the shared lock free and
    every model variable at the same version: a step counts all of them or none."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    opt = safevars.SafeOptimizer(keras.optimizers.SGD(0.0))
    opt.build(model.trainable_variables)
    variables = [safevars.wrap(v) for v in model.trainable_variables]
    assert variables[0].guard.joint is not None
    x = tf.ones([5, 4])

    def full_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    traced_step = tf.function(full_step, autograph=False)
    traced_step()  # the shared lock in run-time mode: eager steps take its mutex too
    # Eagerly, the gradients are computed once: an injection into Keras' forward pass
    # is swallowed there (its input-structure check catches every exception and warns).
    grads = [tf.ones_like(v) for v in model.trainable_variables]

    def eager_step():
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step = traced_step if traced else eager_step
    caught = _run_with_injections(step, workers=3, injections=200, seed=11 + traced)
    assert sum(caught) == 200
    versions = [v.version for v in variables]
    assert versions[0] > 1 and versions == [versions[0]] * len(versions), versions
    assert safevars.held_locks() == []
    for v in variables:
        stats = v.statistics()
        assert not stats.locked and stats.owner is None and stats.depth == 0, stats
    run_threads(1, lambda _: step())  # the lock still works, from a fresh thread
    assert [v.version for v in variables] == [versions[0] + 1] * len(variables)


@_IGNORED_IN_DEL
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "xla"])
def test_an_exception_at_every_check_point_of_an_accumulator_add_keeps_blocks_whole(
    monkeypatch, compiled
):
    """A deterministic accumulator whose blocks have two pieces (a gradient stored
    straight from its tensor and a packed one): the first 4 pending blocks are kept by
    reference, one variable per piece, the later ones buffered. An add interrupted at
    each check point in turn (adds that get through keep the block count growing past
    the references), eager or through an XLA-compiled function called eagerly (its
    lock taken around the call, the buffer grown before it). Every add gives both
    variables one value, new each time, so a block counted with one piece from one add
    and the other from another would take two different means. After each interrupted
    add the lock is free and the counters agree; the final take is whole."""
    from safevars.accumulator import state

    monkeypatch.setattr(state, "_CHUNK", 4)
    monkeypatch.setattr(state, "_DIRECT", 8)
    acc = safevars.GradientAccumulator([tf.Variable(tf.zeros([16])), tf.Variable(tf.zeros([3]))])
    assert acc._references == 4
    value = [0.0]
    add = lambda g, h: acc.add([g, h])  # noqa: E731
    if compiled:
        add = tf.function(add, jit_compile=True)
        add(tf.zeros([16]), tf.zeros([3]))  # traced and compiled before the faults
        acc.reset()

    def op():
        value[0] += 1.0
        add(tf.fill([16], value[0]), tf.fill([3], value[0]))

    def check(k):
        assert safevars.held_locks() == [], f"an exception at check point {k} kept the lock"
        stats = acc.statistics()
        assert stats.pending == stats.added - stats.discarded, (k, stats)

    k = _every_check_point(op, [], check)
    assert k > 10 and acc.count > 4, (k, acc.count)  # past the references
    gc.collect()
    taken: list = []
    run_threads(1, lambda _: taken.extend(acc.take()))  # the lock, from a fresh thread
    kernel, bias = taken
    assert len(set(kernel.numpy().tolist() + bias.numpy().tolist())) == 1


@_IGNORED_IN_DEL
@pytest.mark.parametrize("api", ["add_and_take", "take"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "tf_function"])
def test_an_exception_at_every_check_point_of_a_take_keeps_counts_and_blocks_whole(
    monkeypatch, traced, api
):
    """``add_and_take`` (or ``take``) on an accumulator with ``max_pending=4`` whose
    contributions are kept by reference (two pieces each), with one contribution pending
    (added first, without faults), interrupted at each check point in turn. After each,
    the lock is free, every contribution is pending, taken or discarded exactly once by
    the counters, and every result that came back holds whole contributions (both pieces
    of one add carry the same value, so a mixed block would make the kernel and the bias
    differ). Contributions left pending by interrupted takes are discarded before the
    next round. Finally a take from another thread gets through: it waits on nothing an
    interrupt left held (an eager take used to wait on a condition whose lock an
    interrupt right after ``with condition:`` took it kept for good, and a take from
    another thread then waited forever)."""
    from safevars.accumulator import state

    monkeypatch.setattr(state, "_CHUNK", 4)
    monkeypatch.setattr(state, "_DIRECT", 8)
    acc = safevars.GradientAccumulator(
        [tf.Variable(tf.zeros([16])), tf.Variable(tf.zeros([3]))], max_pending=4, reduction="sum"
    )
    assert acc._references == 4
    add_and_take = lambda g, h: acc.add_and_take([g, h])  # noqa: E731
    take = acc.take
    if traced:
        add_and_take = tf.function(add_and_take)
        take = tf.function(lambda: acc.take())
    # Traced and compiled before the faults (an interrupted trace is traced again at the
    # next call: a fault at every point of it would cost quadratic time).
    add_and_take(tf.zeros([16]), tf.zeros([3]))
    acc.add([tf.zeros([16]), tf.zeros([3])])
    take()
    value = [0.0]

    def contribution() -> tuple[tf.Tensor, tf.Tensor]:
        value[0] += 1.0
        return tf.fill([16], value[0]), tf.fill([3], value[0])

    k, results = 0, 0
    while True:
        if acc.count > 2:  # interrupted takes left contributions: room for this round
            acc.reset()
        acc.add(list(contribution()))
        g, h = contribution()
        fault = _FaultAt(k)
        sys.setprofile(fault)
        try:
            result = add_and_take(g, h) if api == "add_and_take" else take()
        except Injected:
            result = None
        finally:
            sys.setprofile(None)
        assert safevars.held_locks() == [], f"an exception at check point {k} kept the lock"
        stats = acc.statistics()
        assert stats.pending == stats.added - stats.taken - stats.discarded, (k, stats)
        if result is not None:
            kernel, bias = result
            assert len(set(kernel.numpy().tolist() + bias.numpy().tolist())) == 1, k
            results += 1
        if not fault.fired:
            break
        k += 1
    assert k > 5 and results >= 1, (k, results)
    gc.collect()
    acc.add(list(contribution()))
    taken: list = []
    run_threads(1, lambda _: taken.extend(acc.take()))  # the lock, from a fresh thread
    kernel, bias = taken
    assert len(set(kernel.numpy().tolist() + bias.numpy().tolist())) == 1


def test_an_interrupt_after_a_lock_is_taken_and_before_it_is_counted_frees_it(monkeypatch):
    """``hold`` counts a lock it took on the line after taking it: an interrupt that lands
    in between (a signal check point after the call returns, as Python 3.10 has) must not
    leave that lock held for ever."""
    from safevars.locking import holding

    a, b = SafeVariable(0.0), SafeVariable(0.0)
    real_enter = holding.enter
    calls = []

    def enter_then_interrupted(lock, me, timeout, reader=False, where=None):
        real_enter(lock, me, timeout, reader, where)
        calls.append(lock)
        if len(calls) == 2:  # the second lock: taken, not yet counted
            raise KeyboardInterrupt

    monkeypatch.setattr(holding, "enter", enter_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        with safevars.locked(a, b):
            pass
    monkeypatch.undo()
    assert len(calls) == 2
    assert not a.statistics().locked and not b.statistics().locked
    assert safevars.held_locks() == []
    run_threads(2, lambda i: b.assign_add(1.0))  # other threads take it (bounded join)
    assert float(b.numpy()) == 2.0 and b.version == 2


def test_an_interrupt_while_waiting_for_the_hand_over_or_for_the_lock_leaves_nothing():
    """Snapshots waiting for a lock are let in first (``acquisition._yield_to_readers``).
    An exception in a snapshot's thread while it waits (registered) takes its
    registration with it, and one in a writer's thread while it leaves the lock to a
    snapshot leaves the writer holding nothing: the lock, its version and the waiting
    lists are as they were, and the next writer enters at once."""
    from safevars.locking import acquisition, hold

    v = SafeVariable(0.0)
    lock = v.guard.lock
    errors: list[BaseException] = []

    def run(fn):
        def body():
            try:
                fn()
            except Injected:
                pass
            except BaseException as e:  # (reported below)
                errors.append(e)

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    # A snapshot waiting for a lock this thread holds, interrupted.
    with hold([v.guard]):
        reader = run(lambda: safevars.snapshot([v]))
        wait_for(lambda: lock.readers == [reader], "the snapshot to wait", 30)
        assert _inject(reader)
        reader.join(scaled(30))  # (it wakes from its wait within acquisition._POLL)
        assert not reader.is_alive() and not errors, errors
        assert lock.readers == [] and lock.holder() is threading.current_thread()

    # A writer leaving the free lock to a (registered) snapshot, interrupted.
    stand_in = threading.Thread(target=print)  # a snapshot that never takes the lock
    lock.readers.append(stand_in)
    original, acquisition._HANDOFF = acquisition._HANDOFF, scaled(60)
    try:
        writer = run(lambda: v.assign_add(1.0))
        wait_for(lambda: in_frame(writer, "_yield_to_readers"), "the writer's hand-over", 30)
        assert lock.holder() is None and v.version == 0
        assert _inject(writer)
        writer.join(scaled(30))
        assert not writer.is_alive() and not errors, errors
    finally:
        acquisition._HANDOFF = original
        lock.readers.remove(stand_in)
    assert lock.holder() is None and lock.seq % 2 == 0 and v.version == 0
    assert float(v.read_value()) == 0.0
    v.assign_add(1.0)  # the next writer enters at once
    assert v.version == 1 and lock.readers == [] and not v.statistics().locked
