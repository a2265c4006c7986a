"""Vector clocks: of every thread, of every synchronization object, and runs.

Per thread (:class:`_ThreadState`), a vector clock advanced by program order and by
every synchronization the audit sees: ``Thread.start``/``join``, and the clocks that the
standard library's primitives carry from a release to an acquire (``sync.py`` calls
:meth:`_Session.publish` and :meth:`_Session.merge`; queues carry one per item). A
thread's *run* (:class:`_Run`) is what it does between two synchronization operations,
or during one ``tf.function`` call: its accesses share one clock. The clocks of one
audit session are shared by every audit active at the same time.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

Clock = dict[int, int]


# ---------------------------------------------------------------------- threads, clocks


def _join(mine: Clock | None, other: Clock) -> Clock:
    """The pointwise maximum of two vector clocks; ``mine`` itself when ``other`` adds
    nothing. Clocks are never changed in place (accesses keep the clock they were made
    at), so the result may share ``other``."""
    if not mine:
        return other
    merged = None
    for tid, clock in other.items():
        if mine.get(tid, 0) < clock:
            if merged is None:
                merged = dict(mine)
            merged[tid] = clock
    return mine if merged is None else merged


class _Run:
    """The accesses one thread makes between two synchronization operations, or during
    one ``tf.function`` call: they all share the thread's vector clock.

    A run's writes of several variables are one *update* that other threads can see
    half-done; its reads of several variables are one *view* that can be torn (see the
    detector). Each active audit keeps its own record of the run in ``views``.
    """

    __slots__ = ("tid", "tname", "clock", "vc", "views")

    def __init__(self, state: _ThreadState) -> None:
        self.tid = state.tid
        self.tname = state.name
        self.vc = state.vc
        self.clock = state.vc[state.tid]
        self.views: dict[Any, Any] = {}  # detector -> what it saw of the run


class _ThreadState:
    """Per-thread audit state: a vector clock, the current run and the critical sections
    being executed."""

    __slots__ = ("tid", "name", "vc", "sections", "write_depth", "run", "unit", "__weakref__")

    def __init__(self, tid: int, name: str, inherited: Clock) -> None:
        self.tid = tid
        self.name = name
        # Vector clocks are never mutated in place: a new dict replaces the old one, so
        # an access can keep a reference to the clock it was made at.
        self.vc: Clock = {**inherited, tid: 1}
        # (lock key, section instance, graph or None) for every CriticalSection.execute
        # this thread is inside, eager (graph None) or being traced.
        self.sections: list[tuple[int, int, Any]] = []
        self.write_depth = 0
        self.run: _Run | None = None  # None: the next access starts a new run
        self.unit: int | None = None  # the snapshot call being taken, if any

    def current_run(self) -> _Run:
        run = self.run
        if run is None:
            run = self.run = _Run(self)
        return run

    def advance(self) -> None:
        """A release: later accesses of this thread are not ordered before what the
        released clock reaches."""
        self.vc = {**self.vc, self.tid: self.vc[self.tid] + 1}
        self.run = None

    def absorb(self, clock: Clock | None) -> None:
        """An acquire: everything ``clock`` covers happens before this thread's next
        access. Ends the run either way (a synchronization point)."""
        self.run = None
        if clock:
            self.vc = _join(self.vc, clock)


class _Session:
    """Happens-before state shared by every audit active at the same time.

    Synchronization objects carry clocks keyed by ``(id(object), part)``; the objects
    are kept alive for the session so that an id is never reused for another one.
    """

    def __init__(self) -> None:
        self.local = threading.local()
        self.ids = itertools.count(1)
        self.forks: weakref.WeakKeyDictionary[threading.Thread, Clock] = (
            weakref.WeakKeyDictionary()
        )
        self.states: weakref.WeakKeyDictionary[threading.Thread, _ThreadState] = (
            weakref.WeakKeyDictionary()
        )
        # id(handle) -> [handle, name shown, Keras path lookups left]. Variables are
        # keyed by the id of their resource handle (shared by ``_UnreadVariable`` results
        # and by the arguments a traced function receives); holding the handle keeps
        # the id unique for the whole session.
        self.handles: dict[int, list[Any]] = {}
        self.names: set[str] = set()
        self.names_lock = threading.Lock()
        # The clocks of synchronization objects, and of queued items per (queue, item).
        self.clocks: dict[tuple[int, Any], Clock] = {}
        self.items: dict[tuple[int, int], list[Clock]] = {}
        self.kept: dict[int, Any] = {}
        self.sync_lock = threading.Lock()
        # Undo functions of the references the audit swapped (``adopting.py``), run in
        # reverse order when the last audit ends.
        self.restores: list[Any] = []

    # -- variables

    def register(self, handle: Any, name: str | None, path: str | None = None) -> None:
        known = self.handles.get(id(handle))
        if known is None:
            self.handles[id(handle)] = [handle, path or name, 0 if path else _PATH_LOOKUPS]
        elif path and known[2]:
            known[1], known[2] = path, 0
        elif name and not known[1]:
            known[1] = name

    def name_of(self, key: int) -> str | None:
        known = self.handles.get(key)
        return known[1] if known else None

    def wants_path(self, key: int) -> bool:
        """Whether a lookup of the variable's Keras path is still worth a try."""
        known = self.handles.get(key)
        if known is None:
            return True
        if known[2] > 0:
            known[2] -= 1
            return True
        return False

    # -- threads

    def state(self) -> _ThreadState:
        try:
            return self.local.state
        except AttributeError:
            pass
        thread = threading.current_thread()
        inherited = self.forks.pop(thread, None) or {}
        tid = next(self.ids)
        name = thread.name
        with self.names_lock:
            if name in self.names:  # Two threads with one name: keep them apart.
                name = f"{name} #{tid}"
            self.names.add(name)
        state = _ThreadState(tid, name, inherited)
        self.local.state = state
        self.states[thread] = state
        return state

    def fork(self, child: threading.Thread) -> None:
        parent = self.state()
        self.forks[child] = parent.vc
        parent.advance()

    def joined(self, child: threading.Thread) -> None:
        finished = self.states.get(child)
        me = self.state()
        me.absorb(finished.vc if finished is not None else None)

    # -- synchronization objects

    def publish(self, obj: Any, part: Any = None) -> None:
        """A release of ``obj``: whoever later merges it is ordered after this point."""
        state = self.state()
        key = (id(obj), part)
        with self.sync_lock:
            self.kept.setdefault(id(obj), obj)
            self.clocks[key] = _join(self.clocks.get(key), state.vc)
        state.advance()

    def released(self, lock: Any) -> None:
        """:meth:`publish` for a lock, taken by the calling thread: the lock itself
        serializes its releases, so its clock needs no other lock."""
        state = self.state()
        key = (id(lock), None)
        clocks = self.clocks
        mine = clocks.get(key)
        if mine is None:
            self.kept[id(lock)] = lock
        clocks[key] = _join(mine, state.vc)
        state.advance()

    def merge(self, obj: Any, part: Any = None) -> None:
        """An acquire of ``obj``: ordered after every earlier :meth:`publish` of it."""
        self.state().absorb(self.clocks.get((id(obj), part)))

    def move(self, obj: Any, source: Any, target: Any) -> None:
        """Moves the clock of ``(obj, source)`` to ``(obj, target)`` (a barrier's
        arrivals become what its departures see)."""
        with self.sync_lock:
            clock = self.clocks.pop((id(obj), source), None)
            self.clocks[(id(obj), target)] = clock or {}

    def hand_off(self) -> Clock:
        """This thread's clock for one later :meth:`receive` (a submitted task)."""
        state = self.state()
        clock = state.vc
        state.advance()
        return clock

    def receive(self, clock: Clock | None) -> None:
        self.state().absorb(clock)

    def put_item(self, queue: Any, item: Any) -> None:
        """``item`` goes into ``queue``: its ``get`` is ordered after this point."""
        clock = self.hand_off()
        with self.sync_lock:
            self.kept.setdefault(id(queue), queue)
            self.items.setdefault((id(queue), id(item)), []).append(clock)

    def unput_item(self, queue: Any, item: Any) -> None:
        """A ``put`` that failed (``Full``): its clock is taken back."""
        with self.sync_lock:
            clocks = self.items.get((id(queue), id(item)))
            if clocks:
                clocks.pop()
                if not clocks:
                    del self.items[(id(queue), id(item))]

    def take_item(self, queue: Any, item: Any) -> None:
        """``item`` came out of ``queue``. An object queued several times is not told
        apart: the getter is ordered after every put of it still pending."""
        with self.sync_lock:
            clocks = self.items.get((id(queue), id(item)))
            if not clocks:
                merged = None
            else:
                merged = clocks[0]
                for clock in clocks[1:]:
                    merged = _join(merged, clock)
                clocks.pop(0)
                if not clocks:
                    del self.items[(id(queue), id(item))]
        self.state().absorb(merged)


# How many accesses of a variable may look for the Keras variable behind it.
_PATH_LOOKUPS = 8
