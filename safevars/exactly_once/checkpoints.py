"""Checkpoints that hold the tables: a save is fenced (no section over an exactly-once
lock runs while it reads), a restore rereads the watermark. Installed over
``TrackableSaver.save`` and ``restore`` when the package is imported."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from safevars import _tf_internal as tfi
from safevars.distribute import on_parameter_server
from safevars.exactly_once import state
from safevars.exactly_once.recording import _RECORDS
from safevars.exactly_once.state import _FENCING, _LOCK
from safevars.locking import SectionLock


def _fenced_locks() -> list[SectionLock]:
    """The locks of exactly-once sections that a save must fence itself, in order.

    Those whose eager holders take the mutex on a parameter server: the savers'
    own locking (:mod:`safevars.locking.checkpoints`) leaves them out. It holds the
    others itself (a fence over them would deadlock against it).
    """
    with _LOCK:
        locks = [
            lock
            for lock in list(_RECORDS.keys())
            if lock.mutexed and lock.cs is not None and on_parameter_server(lock.device)
        ]
    return sorted(locks, key=lambda lock: lock.order)


@contextlib.contextmanager
def _fence(locks: list[SectionLock]) -> Iterator[None]:
    """Holds the run-time mutex of every lock of ``locks`` (in order) while the body runs.

    A ``tf.function`` takes the mutexes (``MutexLock``, as a section does, so sections in
    progress finish first), then waits in a ``py_function`` until the body is over, then
    releases them. It runs in a thread of its own: a mutex is held by the op's output,
    so it must stay inside one running function.
    """
    if not locks:
        yield
        return
    held, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def wait() -> np.int64:
        held.set()
        done.wait()
        return np.int64(0)

    @tf.function(autograph=False)
    def hold() -> tf.Tensor:
        tokens: list[tf.Tensor] = []
        for lock in locks:
            with tf.control_dependencies(tokens[-1:]), tfi.colocate_with(lock.cs._handle):
                tokens.append(tfi.mutex_lock(lock.cs._handle))
        with tf.control_dependencies(tokens):
            waited = tf.py_function(wait, [], tf.int64)
        released = []
        with tf.control_dependencies([waited]):
            for lock, token in zip(locks, tokens):
                with tfi.colocate_with(lock.cs._handle):
                    released.append(tfi.consume_mutex_lock(token))
        with tf.control_dependencies(released):
            return tf.identity(waited)

    def run() -> None:
        try:
            hold()
        except BaseException as e:  # noqa: BLE001 - reported to the saving thread
            failed.append(e)
            held.set()

    thread = threading.Thread(target=run, name="safevars-exactly-once-fence", daemon=True)
    thread.start()
    try:
        held.wait()
        if failed:
            raise failed[0]
        yield
    finally:
        done.set()
        thread.join()


def _saving(save: Callable[..., Any]) -> Callable[..., Any]:
    """``TrackableSaver.save`` fenced when the saved object graph holds the tables."""

    @functools.wraps(save)
    def fenced_save(saver: Any, *args: Any, **kwargs: Any) -> Any:
        if state.TABLES is None or not tfi.executing_eagerly():
            return save(saver, *args, **kwargs)
        objects, _ = saver._graph_view.breadth_first_traversal()
        if not any(obj is state.TABLES for obj in objects):
            return save(saver, *args, **kwargs)
        with _FENCING, _fence(_fenced_locks()):
            return save(saver, *args, **kwargs)

    fenced_save._safevars_exactly_once = True  # type: ignore[attr-defined]
    return fenced_save


def _restoring(restore: Callable[..., Any]) -> Callable[..., Any]:
    """``TrackableSaver.restore``: the watermark the process knows is read again."""

    @functools.wraps(restore)
    def restore_tables(saver: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return restore(saver, *args, **kwargs)
        finally:
            if state.TABLES is not None:
                state.TABLES._restoring()

    restore_tables._safevars_exactly_once = True  # type: ignore[attr-defined]
    return restore_tables


def _install() -> None:
    """Wraps ``TrackableSaver.save`` and ``restore`` (over safevars.locking's wrappers)."""
    entry_points = tfi.checkpoint_entry_points(None, None)
    for owner, name, _ in entry_points[:2]:  # TrackableSaver.save, .restore
        current = getattr(owner, name)
        if not getattr(current, "_safevars_exactly_once", False):
            setattr(owner, name, (_saving if name == "save" else _restoring)(current))


_install()
