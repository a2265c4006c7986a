"""Ctrl-C never hangs: real SIGINTs into a main thread looping over writes, beside CPU load.

A process whose main thread loops ``v.update(lambda x: x + 1.0)`` (or writes inside
``safevars.locked``) gets a real ``SIGINT`` from another thread a few milliseconds into
each trial, hundreds of trials in a row, eagerly and in run-time mode, while a busy-loop
process keeps the CPUs loaded. After every trial the ``KeyboardInterrupt`` must have
ended the loop (no hang, nothing swallowed), the lock must be free, no lock held, and the
value must equal the version (each write adds 1 to both). A trial that does not end is
reported with every thread's stack; a crash with the child's output.

TensorFlow's eager fast path drops a ``KeyboardInterrupt`` raised in Python code it calls
(the ``isinstance`` of a value type it meets for the first time): the second test checks
that the first write of each common value type runs no Python code there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

from tests.distributed.cluster_harness import last_json_line
from tests.support import forked
from tests.support.deadlines import scaled

TRIALS = 150  # per case; four cases in one process

_CHILD = textwrap.dedent(
    """
    import faulthandler, json, os, random, signal, sys, threading, time
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import tensorflow as tf
    import safevars

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's stack dump
    trials, trial_deadline, resend_after = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    rng = random.Random(45)
    pid = os.getpid()
    # "started" and "finished" count the trials of all cases and are never reset: the
    # sender waits for finished == started, and a reset at a new case (when it had not
    # looked yet) would leave it waiting for a trial number that never comes, sending
    # nothing (seen under load as interrupts "swallowed" at each new case's 4th trial).
    state = {"case": "", "started": 0, "finished": 0, "resent": 0}

    def sender():  # one SIGINT per trial, once the main thread is inside its loop
        sent = 0
        while True:
            while state["started"] == sent:
                time.sleep(0.0002)
            sent = state["started"]
            time.sleep(rng.uniform(0.0005, 0.01))
            os.kill(pid, signal.SIGINT)
            since = time.monotonic()
            while state["finished"] != sent:
                time.sleep(0.0002)
                if time.monotonic() - since > resend_after:  # swallowed: counted, sent again
                    state["resent"] += 1
                    if state["resent"] > 3:
                        print(json.dumps({"swallowed": state}), flush=True)
                        faulthandler.dump_traceback(all_threads=True)
                        os._exit(8)
                    os.kill(pid, signal.SIGINT)
                    since = time.monotonic()

    def watchdog():
        last, since = (None, 0), time.monotonic()
        while True:
            time.sleep(0.5)
            now = (state["case"], state["finished"])
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > trial_deadline:
                print(json.dumps({"hang": state}), flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(9)

    threading.Thread(target=sender, daemon=True).start()
    threading.Thread(target=watchdog, daemon=True).start()

    def make(runtime):
        v = safevars.SafeVariable(0.0)
        keep = None
        if runtime:  # a traced write puts the lock in run-time mode (eager writes take
            keep = tf.function(lambda: v.assign_add(1.0), autograph=False)  # the mutex)
            keep()
            assert v.statistics().eager_mutex
        return v, keep

    def update(v):
        v.update(lambda x: x + 1.0)

    def locked(v):
        with safevars.locked(v):
            v.assign_add(1.0, read_value=False)

    done, bad = {}, []
    for name, op, runtime in [
        ("update", update, False),
        ("update, run-time mode", update, True),
        ("locked", locked, False),
        ("locked, run-time mode", locked, True),
    ]:
        v, keep = make(runtime)
        for _ in range(5):
            op(v)
        state["case"] = name
        for t in range(1, trials + 1):
            state["started"] += 1
            try:
                while True:
                    op(v)
            except KeyboardInterrupt:
                pass
            stats = v.statistics()
            held = len(safevars.held_locks())
            if stats.locked or held or float(v.numpy()) != v.version:
                bad.append([name, t, stats.locked, held, float(v.numpy()), v.version])
            state["finished"] = state["started"]
            done[name] = t
    print(json.dumps({"done": done, "bad": bad, "resent": state["resent"]}), flush=True)
    """
)


def test_sigint_into_looping_writes_never_hangs_orphans_a_lock_or_splits_a_version():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with tempfile.TemporaryFile(mode="w+") as stderr:
            child = subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-c", _CHILD]
                + [str(TRIALS), str(scaled(60)), str(scaled(5))],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
            )
            try:
                out, _ = child.communicate(timeout=scaled(600))
            except subprocess.TimeoutExpired:  # stacks, then what it printed
                child.send_signal(signal.SIGUSR1)
                time.sleep(2)
                child.kill()
                out, _ = child.communicate()
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait()
            stderr.seek(0)
            errors = stderr.read()[-6000:]
    finally:
        load.kill()
        load.wait()
    assert child.returncode == 0, (
        f"the child ended with {child.returncode}; its output:\n{out[-3000:]}\n{errors}"
    )
    result = last_json_line(out)
    cases = ["update", "update, run-time mode", "locked", "locked, run-time mode"]
    assert result["done"] == dict.fromkeys(cases, TRIALS), result
    assert result["bad"] == [], f"lock held or value and version split after a trial: {result}"
    assert result["resent"] == 0, f"a KeyboardInterrupt was swallowed: {result}"


_FAST_PATH_CHILD = textwrap.dedent(
    """
    import inspect, json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import numpy as np
    import tensorflow as tf
    import safevars
    from safevars import _tf_internal as tfi
    from safevars.locking.guard import Guard

    # The line of write_counted that runs the write and the count as one chain of C
    # calls (TensorFlow's fast path among them): a Python frame entered from it is a
    # check point inside the fast path, where TensorFlow drops a KeyboardInterrupt. On
    # Python 3.10 call_each is a Python function that builds the chain before it runs.
    lines, first = inspect.getsourcelines(Guard.write_counted)
    chain = first + next(i for i, line in enumerate(lines) if "_consume(" in line)
    code = Guard.write_counted.__code__
    builder = getattr(tfi.call_each, "__code__", None)
    entered, chains = [], [0]

    def profile(frame, event, arg):
        caller = frame.f_back
        if event == "call" and frame.f_code is code:
            chains[0] += 1  # the write went through write_counted: the check is live
        if event == "call" and caller is not None and caller.f_code is code:
            if caller.f_lineno == chain and frame.f_code is not builder:
                entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    values = {
        "float": 1.0, "int": 1, "numpy float32": np.float32(1.0),
        "numpy float64": np.float64(1.0), "numpy int64": np.int64(1),
        "numpy array": np.array(1.0, np.float32),
    }
    found = {}
    for runtime in (False, True):
        for name, value in values.items():
            v = safevars.SafeVariable(0.0)
            keep = None
            if runtime:
                keep = tf.function(lambda: v.assign_add(1.0), autograph=False)
                keep()
            sys.setprofile(profile)
            try:
                v.assign_add(value, read_value=False)  # the first write of this type
                v.assign(value, read_value=False)
            finally:
                sys.setprofile(None)
            if entered:
                found[f"{name}{', run-time mode' if runtime else ''}"] = sorted(set(entered))
                del entered[:]
    print(json.dumps({"found": found, "chains": chains[0]}), flush=True)
    """
)


def test_tensorflow_fast_path_runs_no_python_code_in_a_write_of_a_common_value_type():
    """The first write of a Python or NumPy number runs no Python code inside TensorFlow's
    fast path (where a KeyboardInterrupt would be dropped), eagerly and in run-time mode,
    in a fresh process (TensorFlow caches its type checks per process)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1")
    child = forked.run(["-c", _FAST_PATH_CHILD], env=env, timeout=scaled(300))
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    result = last_json_line(child.stdout)
    assert result["chains"] == 24, f"not every write ran write_counted's chain: {result}"
    assert result["found"] == {}, f"Python code ran inside the fast path: {result['found']}"
