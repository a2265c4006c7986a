"""Locks, versions and the global lock order: how a critical section is entered eagerly.

Every :class:`~safevars.SafeVariable` owns one :class:`Guard` (its version) and points at
one :class:`SectionLock` (its lock). A variable made alone has a lock of its own; the
variables of one :func:`safevars.scope` block share one, and :func:`share_lock` lets
variables that are always updated together (a model's weights and its optimizer's
state) share one, each keeping its own version, so a step over them takes one lock
instead of one per variable. Graph sections (``tf.function``) are in
:mod:`safevars.sections`; this module is the eager half and the bookkeeping both share.

Two lock levels, one order:

* **Eager level.** A ``threading.Lock`` per :class:`SectionLock`, re-entrant for the
  thread that holds it (a holder and a depth), plus a *sequence number* that is odd
  while a section is open. Optimistic snapshot readers (see :mod:`safevars.snapshot`)
  read the sequence numbers before and after reading values and retry on a change.
  Versions live in a Python ``int``: a write costs one uncontended ``Lock.acquire``.
* **Run-time level.** A ``tf.CriticalSection``'s mutex, placed on the variables' device,
  created the first time one of the lock's variables is written, versioned or
  snapshotted inside a ``tf.function``; from then on the lock is in *run-time mode*:
  versions live in int64 resource variables next to the values, and graph sections take
  the mutex with a ``MutexLock`` op. Once a graph does (a ``tf.function`` that is not
  XLA-compiled), eager sections take it too, so eager threads and running graphs exclude
  each other; while only XLA-compiled functions use the lock, their eager callers hold
  the Python lock around each call and none takes the mutex
  (:mod:`~safevars.locking.runtime_mode`).

Locks are ordered by creation (:attr:`SectionLock.order`). Sections that name several
locks take them in that order, which rules out deadlock. A thread that holds some locks
may take more only in increasing order; anything else raises
:class:`~safevars.LockOrderError` *before* taking any lock.

Faults. The bookkeeping is written so that an exception raised at any bytecode (an
asynchronous exception from ``PyThreadState_SetAsyncExc``, a ``KeyboardInterrupt`` from
SIGINT) leaves every lock either not taken or fully released:

* CPython raises asynchronous exceptions only at *check points* (after a call returns,
  at a function's first instruction, on a backward jump). Acquisition is recorded by the
  same C call that takes the mutex (:func:`_take`), so a handler always knows whether it
  holds the lock; every release is a run of attribute stores with no check point before
  the final ``Lock.release()`` call.
* An eager write and its version count are made by one C call chain
  (:meth:`Guard.write_counted`), so an interrupt cannot land between them: value and
  version stay paired.
* A :class:`hold` (``safevars.locked``) whose ``__exit__`` never ran (an interrupt at its
  first instruction, or a context entered by hand and dropped) releases its locks when it
  is garbage-collected.
* A lock whose holding thread has ended is taken back by the next thread that waits for
  it (:attr:`LockStatistics.takeovers` counts it); a later thread reusing the dead
  thread's identifier is never mistaken for the holder (holders are ``Thread`` objects).

What is not covered: a second asynchronous exception delivered while the handler of
the first is releasing (the same limit as ``contextlib`` and any ``finally`` block), and
distributed variables, whose writes go through Python code between the write and the
count (the lock is still never orphaned).

NOTES:
  Calling a ``tf.function`` that writes ``v`` from inside ``safevars.locked(v)`` once
  ``v`` is in run-time mode would wait on a mutex the caller holds, exactly as nesting
  ``tf.CriticalSection.execute`` would. safevars raises :class:`~safevars.LockReentryError`
  instead: when the function is traced inside the section (``runtime_mode.ensure_runtime``) and,
  wherever it was traced, when it is called there (:mod:`safevars.sections.reentry`,
  which records the locks each traced graph takes).

Where things live (one idea per file; each imports only modules listed above it):

* ``statistics.py``: :class:`LockStatistics`, :func:`held_locks`/:class:`HeldLock`, the
  registry of live locks, and the hook for the duplicate counters of
  :mod:`safevars.exactly_once`.
* ``section_lock.py``: :class:`SectionLock`, the lock's state, its place in the order
  (``_ORDER``) and the guards under it.
* ``ownership.py``: who holds what (the holder record, each thread's held list, where
  a lock was taken).
* ``lock_order.py``: the global lock order (``sorted_locks``) and its check.
* ``acquisition.py``: taking a lock (``enter``: holder recorded atomically, takeover
  from an ended thread, the run-time mutex taken eagerly, timeouts, ``check_timeout``).
* ``holding.py``: :class:`hold`, several locks at once (``safevars.locked``).
* ``runtime_mode.py``: a lock's switch to run-time mode (its ``tf.CriticalSection``).
* ``joint_counter.py``: :class:`JointCounter`, the counter of joint versions.
* ``guard.py``: :class:`Guard`, a variable's version and lock (``call_locked``,
  ``write_counted``), and ``protect``/``guard_of``/``guards_of``.
* ``joint_versions.py``: :func:`join_versions`, one counter for the versions of
  variables always written together (one add per step instead of one per variable).
* ``sharing.py``: :func:`share_lock`.
* ``saved_model.py``: what ``tf.saved_model.save`` needs to export functions that take
  locks (the mutexes and counters they capture, as resources the loader creates).
* ``checkpoints.py``: ``tf.train.Checkpoint`` and Keras' savers take the locks of what
  they save or restore (installed when this package is imported).
* Graph sections (``tf.function``) are :mod:`safevars.sections`, a layer above.

Besides ``__all__``, this package re-exports (``name as name``) the internal names that
other safevars modules reach as ``safevars.locking.<name>``.
"""

from safevars import _autograph  # noqa: F401  (registers safevars with AutoGraph)
from safevars.locking.acquisition import check_timeout
from safevars.locking.guard import Guard, guard_of, guards_of, protect
from safevars.locking.guard import _VersionVariable as _VersionVariable
from safevars.locking.holding import hold
from safevars.locking.holding import hold_locks as hold_locks
from safevars.locking.joint_counter import JointCounter
from safevars.locking.joint_versions import bump_eager_together as bump_eager_together
from safevars.locking.joint_versions import bump_graph_together as bump_graph_together
from safevars.locking.joint_versions import join_versions
from safevars.locking.lock_order import sorted_locks as sorted_locks
from safevars.locking.ownership import _current_thread as _current_thread
from safevars.locking.ownership import _held as _held
from safevars.locking.ownership import _holding as _holding
from safevars.locking.runtime_mode import ensure_runtime as ensure_runtime
from safevars.locking.runtime_mode import forget_uses as forget_uses
from safevars.locking.runtime_mode import pin as pin
from safevars.locking.runtime_mode import undo_runtime as undo_runtime
from safevars.locking.runtime_mode import unuse_in_graph as unuse_in_graph
from safevars.locking.runtime_mode import use_in_graph as use_in_graph
from safevars.locking.section_lock import SectionLock
from safevars.locking.section_lock import _guards_of_lock as _guards_of_lock
from safevars.locking.sharing import share_lock
from safevars.locking.statistics import DUPLICATE_COUNTERS as DUPLICATE_COUNTERS
from safevars.locking.statistics import HeldLock, LockStatistics, held_locks

__all__ = [
    "Guard",
    "HeldLock",
    "JointCounter",
    "LockStatistics",
    "SectionLock",
    "check_timeout",
    "guard_of",
    "guards_of",
    "held_locks",
    "hold",
    "join_versions",
    "protect",
    "share_lock",
]

# Savers (tf.train.Checkpoint, Keras model.save) take the locks of what they save.
from safevars.locking import checkpoints as _checkpoints  # noqa: E402, F401
