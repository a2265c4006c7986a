"""The standard library's synchronization as happens-before edges.

What each primitive orders (``_Session.publish`` at the release side, ``merge`` at the
acquire side; see the package docstring for the whole list):

* ``threading.Lock``/``RLock``: a release before every later acquire. Their types are C
  types, whose methods cannot be patched and whose ``with`` statement no profiler sees,
  so a lock is tracked through a :class:`_TrackedLock` proxy that shares the underlying
  lock (mutual exclusion is untouched). While an audit is active ``threading.Lock`` and
  ``threading.RLock`` make proxies for the project's code (a lock created by the standard
  library, TensorFlow, Keras or safevars stays a plain lock: their internal locks order
  nothing the user wrote, and counting them would hide races); ``adopting.py`` swaps
  proxies into the references to locks created before the audit.
* ``Condition``: through its lock (a notify is always followed by the notifier's
  release, a woken wait by its re-acquire). A condition the project creates gets a
  tracked lock.
* ``Semaphore``/``BoundedSemaphore``: a release before every later successful acquire
  (not the executor's own idle-worker semaphore, an internal detail).
* ``Event``: a ``set`` before a ``wait`` or ``is_set`` that returned true.
* ``Barrier``: every arrival of a generation before every departure from it.
* ``queue.Queue`` and its subclasses, ``queue.SimpleQueue``: a ``put`` before the ``get``
  that returns that item; every ``task_done`` before a ``join`` that returned.
  ``SimpleQueue`` is a C type: while an audit is active ``queue.SimpleQueue`` is a
  subclass that records its puts and gets (:class:`_AuditedSimpleQueue`); older ones are
  proxied (:class:`_TrackedSimpleQueue`).
* ``concurrent.futures``: ``submit`` before the task (``adopting.py`` records it, with
  the locks passed to the task); the task before ``result()``,
  ``exception()``, ``done()`` that returned true, a done callback, ``wait`` and
  ``as_completed`` (for the futures they return), and ``shutdown(wait=True)`` (it joins
  the workers).

Every wrapper does its bookkeeping only while an audit is active, and calls the original
either way; ``patching.py`` installs them with the other patches.
"""

from __future__ import annotations

import _thread
import functools
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import _base as futures_base
from concurrent.futures import thread as futures_thread
from typing import Any

from safevars.audit import active
from safevars.audit.sites import _is_project_file

# The types and factories as the standard library made them (captured at import, before
# any audit patched them).
_LOCK_TYPE: type = type(_thread.allocate_lock())
_RLOCK_TYPE: type = type(_thread.RLock())
_SIMPLE_QUEUE_TYPE: type = queue.SimpleQueue
_new_lock: Callable[[], Any] = _thread.allocate_lock
_new_rlock: Callable[[], Any] = _thread.RLock
_future_done = futures_base.Future.done


# Callers whose use of a primitive is the standard library's internal business: the
# thread pool's idle-worker semaphore (released after every task, acquired by the next
# ``submit``) would otherwise order every task after the previous one; a thread's own
# ``_started`` event is set before the thread is registered (``current_thread()`` would
# make a dummy thread, whose ``__init__`` sets an event again, and so on).
def _internal_callers() -> frozenset[Any]:
    codes = [
        getattr(futures_thread.ThreadPoolExecutor._adjust_thread_count, "__code__", None),
        getattr(futures_thread._worker, "__code__", None),
    ]
    classes = [threading.Thread, getattr(threading, "_DummyThread", None)]
    classes.append(getattr(threading, "_MainThread", None))
    for cls in (c for c in classes if c is not None):
        for name, member in vars(cls).items():
            if name != "run":  # Thread.run calls the user's target
                member = getattr(member, "fget", member)  # properties: their getter
                codes.append(getattr(member, "__code__", None))
    return frozenset(c for c in codes if c is not None)


_INTERNAL_CALLERS = _internal_callers()


def _made_by_project(depth: int) -> bool:
    """Whether the caller ``depth`` frames up (from the caller of this function) is the
    project's code."""
    return _is_project_file(sys._getframe(depth + 1).f_code.co_filename)


# ---------------------------------------------------------------------- locks


class _Proxy:
    """What the audit's proxies share: the wrapped object is ``__wrapped__``, its class
    is forwarded (``isinstance`` holds, as with wrapt's proxies; ``type(proxy)`` is the
    proxy's), and attributes the proxy does not define are the wrapped object's."""

    __slots__ = ("__wrapped__", "__weakref__")

    def __init__(self, wrapped: Any) -> None:
        self.__wrapped__ = wrapped

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)


class _TrackedLock(_Proxy):
    """A ``threading.Lock`` or ``RLock`` seen by the audit: the same underlying lock,
    with each acquire ordered after the release before it."""

    __slots__ = ()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self.__wrapped__.acquire(blocking, timeout)
        if got:
            session = active._SESSION
            if session is not None:
                session.merge(self.__wrapped__)
        return got

    def release(self) -> None:
        session = active._SESSION
        if session is not None:
            session.released(self.__wrapped__)
        self.__wrapped__.release()

    def __enter__(self) -> bool:
        got = self.__wrapped__.acquire()
        session = active._SESSION
        if session is not None:
            session.merge(self.__wrapped__)
        return bool(got)

    def __exit__(self, *exc_info: Any) -> None:
        session = active._SESSION
        if session is not None:
            session.released(self.__wrapped__)
        self.__wrapped__.release()

    acquire_lock = acquire
    release_lock = release


class _TrackedPlainLock(_TrackedLock):
    """A tracked ``threading.Lock`` (``_thread.lock``)."""

    __slots__ = ()

    def locked(self) -> bool:
        return bool(self.__wrapped__.locked())

    locked_lock = locked


class _TrackedRLock(_TrackedLock):
    """A tracked ``threading.RLock``: also the methods ``Condition`` uses to release it
    whole while waiting and to take it back."""

    __slots__ = ()

    def _release_save(self) -> Any:
        session = active._SESSION
        if session is not None:
            session.released(self.__wrapped__)
        return self.__wrapped__._release_save()

    def _acquire_restore(self, state: Any) -> None:
        self.__wrapped__._acquire_restore(state)
        session = active._SESSION
        if session is not None:
            session.merge(self.__wrapped__)

    def _is_owned(self) -> bool:
        return bool(self.__wrapped__._is_owned())


def _tracked(lock: Any) -> Any:
    """A proxy for a plain lock; anything else as it is."""
    kind = type(lock)
    if kind is _LOCK_TYPE:
        return _TrackedPlainLock(lock)
    if kind is _RLOCK_TYPE:
        return _TrackedRLock(lock)
    return lock


class _LockClass(type):
    """The metaclass of :class:`_Lock`: calling it makes a lock (a proxy for the
    project's code), ``isinstance`` and ``issubclass`` answer for the lock type (on
    Python 3.13 ``threading.Lock`` is that type: code checking against it keeps working
    during an audit)."""

    def __call__(cls) -> Any:
        lock = _new_lock()
        return _TrackedPlainLock(lock) if _made_by_project(1) else lock

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _LOCK_TYPE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _LOCK_TYPE)


class _Lock(metaclass=_LockClass):
    """``threading.Lock`` while an audit is active."""


def _lock_factory(original: Any) -> Any:
    return _Lock


def _rlock_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    """Replaces ``threading.RLock`` while an audit is active."""

    @functools.wraps(original)
    def RLock(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - stands in for threading.RLock
        lock = original(*args, **kwargs)
        return _tracked(lock) if _made_by_project(1) else lock

    return RLock


def _condition_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Condition(lock=None)`` made by the project: its lock is tracked."""

    @functools.wraps(original)
    def __init__(self: Any, lock: Any = None) -> None:  # noqa: N807
        if active._SESSION is not None and _made_by_project(1):
            lock = _TrackedRLock(_new_rlock()) if lock is None else _tracked(lock)
        original(self, lock)

    return __init__


# ---------------------------------------------------------------------- semaphores, events


def _releasing(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Semaphore.release``, ``Event.set``: ordered before later acquires."""

    @functools.wraps(original)
    def audited_release(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = active._SESSION
        if session is not None and sys._getframe(1).f_code not in _INTERNAL_CALLERS:
            session.publish(self)
        return original(self, *args, **kwargs)

    return audited_release


def _merging_if_true(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Semaphore.acquire`` (and ``__enter__``), ``Event.wait``/``is_set``: true means
    the release (the ``set``) happened before."""

    @functools.wraps(original)
    def audited_check(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        session = active._SESSION
        if result and session is not None and sys._getframe(1).f_code not in _INTERNAL_CALLERS:
            session.merge(self)
        return result

    return audited_check


# ---------------------------------------------------------------------- barriers, queues


def _then(edge: str, part: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory: the original, then ``session.<edge>(self, part)``
    (``"merge"``: what returned is ordered after the releases; ``"publish"``)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def audited(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            session = active._SESSION
            if session is not None:
                getattr(session, edge)(self, part)
            return result

        return audited

    return factory


def _first(part: Any = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrapper factory: ``session.publish(self, part)``, then the original (what
    follows the original's effect is ordered after this point)."""

    def factory(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def audited(self: Any, *args: Any, **kwargs: Any) -> Any:
            session = active._SESSION
            if session is not None:
                session.publish(self, part)
            return original(self, *args, **kwargs)

        return audited

    return factory


def _barrier_release(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Barrier._release`` (the last arrival): this generation's arrivals are what its
    departures see."""

    @functools.wraps(original)
    def audited_release(self: Any) -> Any:
        session = active._SESSION
        if session is not None:
            session.move(self, "arrivals", "departures")
        return original(self)

    return audited_release


def _queue_put(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_put(self: Any, item: Any, *args: Any, **kwargs: Any) -> Any:
        session = active._SESSION
        if session is None:
            return original(self, item, *args, **kwargs)
        session.put_item(self, item)
        try:
            return original(self, item, *args, **kwargs)
        except BaseException:
            session.unput_item(self, item)
            raise

    return audited_put


def _queue_get(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_get(self: Any, *args: Any, **kwargs: Any) -> Any:
        item = original(self, *args, **kwargs)
        session = active._SESSION
        if session is not None:
            session.take_item(self, item)
        return item

    return audited_get


class _SimpleQueueClass(type):
    """While ``queue.SimpleQueue`` is :class:`_AuditedSimpleQueue`, ``isinstance`` and
    ``issubclass`` against it answer for the original class (so the queues made before
    the audit are still ``SimpleQueue`` s)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _SIMPLE_QUEUE_TYPE)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _SIMPLE_QUEUE_TYPE)


class _AuditedSimpleQueue(_SIMPLE_QUEUE_TYPE, metaclass=_SimpleQueueClass):
    """``queue.SimpleQueue`` while an audit is active: a real ``SimpleQueue`` (the C
    type) whose puts and gets are ordered like ``queue.Queue``'s."""

    __slots__ = ()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        session = active._SESSION
        if session is not None:
            session.put_item(self, item)
        super().put(item, block, timeout)

    def put_nowait(self, item: Any) -> None:
        self.put(item, False)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        session = active._SESSION
        if session is not None:
            session.take_item(self, item)
        return item

    def get_nowait(self) -> Any:
        return self.get(False)


class _TrackedSimpleQueue(_Proxy):
    """A proxy for a ``queue.SimpleQueue`` made before the audit: the same queue, with
    its puts and gets recorded."""

    __slots__ = ()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        session = active._SESSION
        if session is not None:
            session.put_item(self.__wrapped__, item)
        self.__wrapped__.put(item, block, timeout)

    def put_nowait(self, item: Any) -> None:
        self.put(item, False)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = self.__wrapped__.get(block, timeout)
        session = active._SESSION
        if session is not None:
            session.take_item(self.__wrapped__, item)
        return item

    def get_nowait(self) -> Any:
        return self.get(False)


def _simple_queue_class(original: Any) -> Any:
    return _AuditedSimpleQueue


# ---------------------------------------------------------------------- futures


def _work_item_run(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_run(self: Any) -> Any:
        submitted = getattr(self, "_safevars_submitted", None)
        session = active._SESSION
        if submitted is not None and session is not None and submitted[0] is session:
            session.receive(submitted[1])
        return original(self)

    return audited_run


def _merge_done(future: Any) -> None:
    session = active._SESSION
    if session is not None and _future_done(future):
        session.merge(future)


def _future_outcome(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Future.result``/``exception``: once they return (or raise the task's
    exception), the task happened before."""

    @functools.wraps(original)
    def audited_outcome(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            _merge_done(self)

    return audited_outcome


def _future_done_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_done(self: Any) -> Any:
        done = original(self)
        if done:
            _merge_done(self)
        return done

    return audited_done


def _add_done_callback(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_add_done_callback(self: Any, fn: Callable[[Any], Any]) -> Any:
        if active._SESSION is None:
            return original(self, fn)

        @functools.wraps(fn)
        def callback(future: Any) -> Any:
            _merge_done(future)
            return fn(future)

        return original(self, callback)

    return audited_add_done_callback


def _futures_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        for future in result.done:
            _merge_done(future)
        return result

    return wait


def _futures_as_completed(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def as_completed(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for future in original(*args, **kwargs):
            _merge_done(future)
            yield future

    return as_completed


def _patch_targets() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, wrapper factory) of every synchronization hook."""
    import concurrent.futures as futures_package

    targets: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (threading, "Lock", _lock_factory),
        (threading, "RLock", _rlock_factory),
        (threading.Condition, "__init__", _condition_init),
        (threading.Semaphore, "acquire", _merging_if_true),
        (threading.Semaphore, "__enter__", _merging_if_true),
        (threading.Semaphore, "release", _releasing),
        (threading.BoundedSemaphore, "release", _releasing),
        (threading.Event, "set", _releasing),
        (threading.Event, "wait", _merging_if_true),
        (threading.Event, "is_set", _merging_if_true),
        # Barrier._enter runs under the barrier's lock once the previous generation has
        # drained: the arrivals of this generation; its last arrival calls _release.
        (threading.Barrier, "_enter", _then("publish", "arrivals")),
        (threading.Barrier, "_release", _barrier_release),
        (threading.Barrier, "wait", _then("merge", "departures")),
        (queue.Queue, "put", _queue_put),
        (queue.Queue, "get", _queue_get),
        (queue.Queue, "task_done", _first("tasks")),
        (queue.Queue, "join", _then("merge", "tasks")),
        (queue, "SimpleQueue", _simple_queue_class),
        (futures_thread._WorkItem, "run", _work_item_run),
        # The task happens before whoever sees the future done.
        (futures_base.Future, "set_result", _first()),
        (futures_base.Future, "set_exception", _first()),
        (futures_base.Future, "result", _future_outcome),
        (futures_base.Future, "exception", _future_outcome),
        (futures_base.Future, "done", _future_done_wrapper),
        (futures_base.Future, "add_done_callback", _add_done_callback),
        (futures_base, "wait", _futures_wait),
        (futures_base, "as_completed", _futures_as_completed),
        (futures_package, "wait", _futures_wait),
        (futures_package, "as_completed", _futures_as_completed),
    ]
    # A Python without one of them (another version's threading): less to see.
    return [t for t in targets if t[1] in vars(t[0])]
