"""The audit's view of the standard library's synchronization: proxies, adoption, undo.

A lock made before the audit is swapped for a proxy of the same lock where the project
keeps a reference the audit can reach, and swapped back when the audit ends (also when
its block raises); a lock the audit makes for the project is a proxy; locks made by the
standard library, TensorFlow, Keras or safevars stay plain. What it cannot reach stays
unseen, and is reported as a race ``predicted`` (a test states that limit).
"""

from __future__ import annotations

import _queue
import _thread
import dataclasses
import queue
import threading
from threading import Lock  # a name imported from threading: swapped during an audit

import pytest
import tensorflow as tf

from safevars.audit import audit

# The plain types, kept in a tuple: a module global bound to the class threading.Lock
# is (on Python 3.13, where it is the lock's type) swapped during an audit.
RAW = (type(_thread.allocate_lock()), _thread.RLock)
GLOBAL_LOCK = threading.Lock()
GLOBAL_LOCKS = {"first": threading.Lock(), "others": [threading.RLock()]}


class Holder:
    class_lock = threading.Lock()

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue = queue.SimpleQueue()
        self.condition = threading.Condition(threading.Lock())


class Slotted:
    __slots__ = ("lock",)

    def __init__(self) -> None:
        self.lock = threading.RLock()


HOLDER = Holder()
SLOTTED = Slotted()


def _with_default(lock=GLOBAL_LOCK):
    return lock


def _references():
    return {
        "global": lambda: GLOBAL_LOCK,
        "dict value": lambda: GLOBAL_LOCKS["first"],
        "list item": lambda: GLOBAL_LOCKS["others"][0],
        "attribute": lambda: HOLDER.lock,
        "class attribute": lambda: Holder.class_lock,
        "slot": lambda: SLOTTED.lock,
        "default argument": lambda: _with_default.__defaults__[0],
        "condition's lock": lambda: HOLDER.condition._lock,
    }


def test_locks_made_before_the_audit_are_proxied_then_restored():
    before = {name: get() for name, get in _references().items()}
    simple_queue = HOLDER.queue
    assert all(type(lock) in RAW for lock in before.values())
    with audit():
        during = {name: get() for name, get in _references().items()}
        for name, lock in during.items():
            assert type(lock) not in RAW, name
            assert lock.__wrapped__ is before[name], name  # the same lock underneath
            assert isinstance(lock, type(before[name])), name  # __class__ forwarded
        assert HOLDER.condition.acquire == during["condition's lock"].acquire
        assert HOLDER.queue.__wrapped__ is simple_queue
        assert isinstance(HOLDER.queue, queue.SimpleQueue)
        assert Lock is threading.Lock and Lock is not _thread.allocate_lock  # the audit's
    after = {name: get() for name, get in _references().items()}
    assert all(after[name] is before[name] for name in before), after
    assert HOLDER.queue is simple_queue and Lock is _thread.allocate_lock


def test_references_are_restored_when_the_block_raises():
    with pytest.raises(KeyError):
        with audit():
            assert type(GLOBAL_LOCK) is not RAW[0]
            raise KeyError("from the block")
    assert type(GLOBAL_LOCK) is RAW[0]
    assert type(HOLDER.lock) is RAW[0] and type(HOLDER.queue) is queue.SimpleQueue


def test_a_proxy_shares_the_lock_it_wraps():
    raw = GLOBAL_LOCK
    with audit():
        proxy = GLOBAL_LOCK
        with proxy:
            assert raw.locked() and proxy.locked()
            assert not raw.acquire(blocking=False)  # excluded by the proxy's hold
        assert raw.acquire(blocking=False)
        assert proxy.locked() and not proxy.acquire(blocking=False)
        raw.release()


def test_the_project_gets_tracked_locks_the_standard_library_and_tensorflow_plain_ones():
    with audit():
        mine = [threading.Lock(), threading.RLock(), threading.Condition()._lock]
        assert all(type(lock) not in RAW for lock in mine)
        theirs = [
            queue.Queue().mutex,
            threading.Event()._cond._lock,
            threading.Semaphore()._cond._lock,
            threading.Barrier(1)._cond._lock,
            tf.function(lambda: 1)._lock,  # TensorFlow's own
        ]
        assert all(type(lock) in RAW for lock in theirs), theirs
        # threading.Lock answers isinstance for every lock, as on Python 3.13.
        assert isinstance(mine[0], threading.Lock) and isinstance(theirs[0], threading.Lock)
        simple = queue.SimpleQueue()
        assert type(simple) is not _queue.SimpleQueue  # the audit's subclass: it is seen
    assert isinstance(simple, _queue.SimpleQueue)  # a real one, also after the audit
    assert queue.SimpleQueue is _queue.SimpleQueue
    assert threading.Lock in (_thread.allocate_lock, RAW[0])  # Python 3.13: the type


def test_a_lock_passed_to_threads_is_adopted_for_them():
    lock = threading.Lock()  # before the audit, in this frame only: handed to the threads
    v = tf.Variable(0.0, name="adopted_through_arguments")

    def work(lock):
        for _ in range(3):
            with lock:
                v.assign(v.read_value() + 1.0)

    with audit() as report:
        threads = [threading.Thread(target=work, args=(lock,)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert report.races == [], str(report)


def test_a_lock_only_in_a_running_frames_local_is_not_seen():
    # The documented limit: the main thread takes a lock made before the audit through
    # a local variable (not captured, not passed), so its hold is invisible, and its
    # write is reported against the worker's though the lock orders them.
    lock = threading.Lock()
    v = tf.Variable(0.0, name="hidden_lock")
    other = {"lock": lock}
    with audit() as report:

        def work(i):
            with other["lock"]:
                v.assign(2.0)

        thread = threading.Thread(target=work, args=(0,))
        thread.start()
        with lock:  # this thread's hold goes to the raw lock: unseen
            v.assign(3.0)
        thread.join(120)
    assert [r.kind for r in report.races] == ["concurrent_write"], str(report)
    assert report.races[0].evidence == "predicted"


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    lock: object = dataclasses.field(default_factory=threading.Lock)


FROZEN = Frozen()


def test_a_lock_the_audit_cannot_swap_is_left_alone():
    # A frozen dataclass with slots refuses the swap: the audit starts anyway, the lock stays as it
    # is (unseen, as documented).
    with audit():
        assert type(FROZEN.lock) is RAW[0]
    assert type(FROZEN.lock) is RAW[0]
