"""Locks and queues made before the audit began: found from the project's code and
swapped for the audit's proxies, for as long as the audit runs.

A ``threading.Lock`` made before the audit is a plain ``_thread.lock``: nothing that
holds it can be patched, only the reference to it replaced. When the first audit begins,
:func:`adopt_existing` looks for such locks (``Lock``, ``RLock``), for ``SimpleQueue`` s
and for ``Condition`` s on a plain lock, and swaps in a proxy of ``sync.py`` that shares
the same lock (or queue), wherever the project's code keeps a reference it can replace:

* the globals of the project's modules (neither the standard library, nor an installed
  package, nor safevars: ``sites._is_project_file``), and the names they imported from
  ``threading``, ``queue`` and ``concurrent.futures`` (``from threading import Lock``);
* from there, and from the local variables of the project's functions running on the
  other threads (read, never written), up to ``_MAX_DEPTH`` steps through dicts, lists, the
  attributes of the project's objects and classes, closure cells and default arguments
  of the project's functions, bound methods, ``functools.partial`` s and threads not
  started yet;
* extra roots a caller passes (the pytest plugin: the test's arguments).

When a thread starts (``Thread.start``) or a task is submitted to a thread pool
(``_WorkItem``), its target, arguments and their closures are searched the same way, so
a lock created before the audit and handed to workers is seen by them.

Each swap is undone when the last audit ends (where the reference still holds the
proxy). What is not reached stays unseen: a lock held only in a local variable of a
running function (not captured by a closure, not passed to a thread), a lock inside a
tuple, an installed library's objects, containers of more than ``_MAX_ITEMS`` entries.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from safevars.audit import active
from safevars.audit.clocks import _Session
from safevars.audit.sites import _is_project_file
from safevars.audit.sync import (
    _LOCK_TYPE,
    _RLOCK_TYPE,
    _SIMPLE_QUEUE_TYPE,
    _tracked,
    _TrackedSimpleQueue,
)

_MAX_DEPTH = 4  # module global -> object -> attribute -> container -> item
_MAX_ITEMS = 1000  # larger dicts and lists are not searched
_BUDGET = 20_000  # objects searched per adoption at most
_CONDITION_ATTRIBUTES = (
    "_lock",
    "acquire",
    "release",
    "_release_save",
    "_acquire_restore",
    "_is_owned",
)
# What threading.Thread keeps for itself (its own locks and events are never swapped).
_THREAD_INTERNALS = frozenset(vars(threading.Thread()))


_PROXIED = frozenset({_LOCK_TYPE, _RLOCK_TYPE, _SIMPLE_QUEUE_TYPE})
# ids of the functions and classes the audit patches in a module (``threading.Lock``):
# a project module that imported one by name gets the audit's version.
_ORIGINAL_IDS: set[int] = set()


def _proxy(value: Any) -> Any:
    """The audit's proxy for a plain lock or ``SimpleQueue``, else None."""
    if type(value) is _SIMPLE_QUEUE_TYPE:
        return _TrackedSimpleQueue(value)
    tracked = _tracked(value)
    return None if tracked is value else tracked


_SCALARS = frozenset({int, float, complex, str, bytes, bool, type(None)})
# Module globals that hold no reference worth searching; a class's methods besides.
_BARREN = _SCALARS | {types.ModuleType}
_METHODS = _BARREN | {types.FunctionType, staticmethod, classmethod, property}


def _is_project_module(name: Any) -> bool:
    """Whether the module called ``name`` is the project's (classes defined there)."""
    filename = getattr(sys.modules.get(name) if isinstance(name, str) else None, "__file__", None)
    return isinstance(filename, str) and _is_project_file(filename)


# module name -> (module, its globals if it is the project's, else None). A process has
# thousands of modules (TensorFlow's); telling which are the project's once per module
# keeps an audit's start cheap.
_MODULES: dict[str, tuple[Any, dict[str, Any] | None]] = {}


def _project_namespaces() -> list[dict[str, Any]]:
    """The globals of the project's modules in ``sys.modules``.

    A module's ``__file__`` is read from its ``__dict__``, never with ``getattr``: a lazy
    module (TensorFlow's ``LazyLoader``) would import itself to answer. While no module
    was added or removed (and ``__main__`` is the same), the last answer stands.
    """
    modules = sys.modules
    fingerprint = (len(modules), next(reversed(modules), None), id(modules.get("__main__")))
    if _LAST[0] == fingerprint:
        return _LAST[1]
    found = []
    for name, module in list(modules.items()):
        known = _MODULES.get(name)
        if known is None or known[0] is not module:
            try:
                namespace = vars(module)
            except TypeError:
                namespace = None
            filename = namespace.get("__file__") if isinstance(namespace, dict) else None
            project = isinstance(filename, str) and _is_project_file(filename)
            known = _MODULES[name] = (module, namespace if project else None)
        if known[1] is not None:
            found.append(known[1])
    _LAST[:] = [fingerprint, found]
    return found


_LAST: list[Any] = [None, []]


# How an object of a type is searched, decided once per type.
_SKIP, _MAPPING, _LIST, _COLLECTION, _FUNCTION, _METHOD, _PARTIAL = range(7)
_THREAD, _CONDITION, _CLASS, _INSTANCE = range(7, 11)
_HANDLING: dict[type, int] = {}


def _handling(kind: type) -> int:
    if kind in _SCALARS or kind is types.ModuleType:
        return _SKIP
    if issubclass(kind, dict):
        return _MAPPING
    if kind is list:
        return _LIST
    if kind in (tuple, set, frozenset):
        return _COLLECTION
    if kind is types.FunctionType:
        return _FUNCTION
    if kind is types.MethodType:
        return _METHOD
    if kind is functools.partial:
        return _PARTIAL
    if issubclass(kind, threading.Thread):
        return _THREAD
    if issubclass(kind, threading.Condition):
        return _CONDITION
    if issubclass(kind, type):
        return _CLASS
    # An instance: searched if its class is the project's (a class defined later in a
    # module loaded later is decided when first met).
    return _INSTANCE if _is_project_module(kind.__module__) else _SKIP


# id(module globals) -> (their number, the names worth searching). Most globals of a
# module are imports (functions, classes, modules) and constants: decided once, and
# again when the module gains or loses a global.
_CANDIDATES: dict[int, tuple[dict[str, Any], int, list[str]]] = {}


def _candidates(namespace: dict[str, Any]) -> list[str]:
    """The globals of a project module that may hold a lock: not its imports (a class or
    function defined elsewhere is searched with its own module), not constants and
    modules, not functions without closures or defaults. ``None`` stays (a global lock
    made lazily, ``LOCK = None`` at import)."""
    known = _CANDIDATES.get(id(namespace))
    if known is not None and known[0] is namespace and known[1] == len(namespace):
        return known[2]
    here = namespace.get("__name__")
    names = []
    for key, item in list(namespace.items()):
        if key.startswith("__"):
            continue
        kind = type(item)
        if item is None or id(item) in _ORIGINAL_IDS:
            names.append(key)
        elif kind is types.FunctionType:
            if item.__module__ == here and _may_hold(item):
                names.append(key)
        elif isinstance(item, type):
            if item.__module__ == here and any(
                value is None or type(value) not in _METHODS
                for name, value in vars(item).items()
                if not name.startswith("__")
            ):
                names.append(key)  # a class with attributes besides its methods
        elif _handling(kind) != _SKIP or kind in _PROXIED:
            names.append(key)
    _CANDIDATES[id(namespace)] = (namespace, len(namespace), names)
    return names


def _may_hold(fn: types.FunctionType) -> bool:
    """Whether a function could reference a lock: a closure, or a default argument that
    is not a constant (``None`` defaults are constants: they are never rebound)."""
    if fn.__closure__:
        return True
    defaults = [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    return any(type(value) not in _SCALARS for value in defaults)


# Where a reference lives: ``container[key]``, ``getattr(container, key)`` or a cell.
_ITEM = 0
_ATTRIBUTE = 1
_CELL = 2


def _get(container: Any, key: Any, where: int) -> Any:
    if where == _ITEM:
        return container[key]
    if where == _ATTRIBUTE:
        return getattr(container, key)
    return container.cell_contents


def _put(container: Any, key: Any, where: int, value: Any) -> None:
    if where == _ITEM:
        container[key] = value
    elif where == _ATTRIBUTE:
        setattr(container, key, value)
    else:
        container.cell_contents = value


class _Adopter:
    """One search: swaps what it finds and registers each undo with the session."""

    def __init__(self, session: _Session, replacements: dict[int, Any]) -> None:
        self.session = session
        # id(original function or class) -> what the audit patched in for it.
        self.replacements = replacements
        self.seen: set[int] = set()
        self.budget = _BUDGET
        self.swapped = 0

    # -- one reference

    def _swap(self, container: Any, key: Any, where: int, old: Any, new: Any) -> None:
        try:
            _put(container, key, where, new)
        except (AttributeError, TypeError):  # read-only (a frozen dataclass): unseen
            return
        self.swapped += 1

        def undo() -> None:
            try:
                if _get(container, key, where) is new:
                    _put(container, key, where, old)
            except (AttributeError, IndexError, KeyError, TypeError, ValueError):
                pass  # the reference is gone (a finished thread's arguments)

        self.session.restores.append(undo)

    def _slot(self, container: Any, key: Any, where: int, value: Any, depth: int) -> None:
        kind = type(value)
        if kind in _SCALARS:
            return
        if kind is _LOCK_TYPE or kind is _RLOCK_TYPE or kind is _SIMPLE_QUEUE_TYPE:
            self._swap(container, key, where, value, _proxy(value))
        else:
            self.visit(value, depth + 1)

    # -- containers and objects

    def visit(self, value: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or self.budget <= 0:
            return
        kind = type(value)
        handling = _HANDLING.get(kind)
        if handling is None:
            if len(_HANDLING) > 10_000:  # classes made on the fly: do not keep them all
                _HANDLING.clear()
            handling = _HANDLING[kind] = _handling(kind)
        if handling == _SKIP or id(value) in self.seen:
            return
        self.seen.add(id(value))
        self.budget -= 1
        if handling == _MAPPING:
            self.mapping(value, depth)
        elif handling == _LIST:
            if len(value) <= _MAX_ITEMS:
                for index, item in enumerate(list(value)):
                    if type(item) not in _SCALARS:
                        self._slot(value, index, _ITEM, item, depth)
        elif handling == _COLLECTION:
            if len(value) <= _MAX_ITEMS:
                for item in value:
                    self.visit(item, depth + 1)
        elif handling == _FUNCTION:
            self.function(value, depth)
        elif handling == _METHOD:
            self.visit(value.__self__, depth + 1)
            self.visit(value.__func__, depth + 1)
        elif handling == _PARTIAL:
            self.visit(value.func, depth + 1)
            self.visit(value.args, depth + 1)
            self.mapping(value.keywords, depth)
        elif handling == _THREAD:
            self.thread(value, depth)
        elif handling == _CONDITION:
            self.condition(value)
        elif handling == _CLASS:
            if _is_project_module(value.__module__):
                self.namespace(value, depth)
        else:
            self.instance(value, depth)

    def mapping(self, mapping: dict[Any, Any], depth: int) -> None:
        if len(mapping) <= _MAX_ITEMS:
            for key, item in list(mapping.items()):
                if type(item) not in _SCALARS:
                    self._slot(mapping, key, _ITEM, item, depth)

    def namespace(self, owner: type, depth: int) -> None:
        """A class's own attributes (``vars`` is read-only: set through ``setattr``); its
        methods are not searched (a lock in a method's closure is rare, the methods many)."""
        for name, item in list(vars(owner).items()):
            if not name.startswith("__") and type(item) not in _METHODS:
                self._slot(owner, name, _ATTRIBUTE, item, depth)

    def instance(self, value: Any, depth: int) -> None:
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            self.mapping(attributes, depth)
        for cls in type(value).__mro__:
            slots = vars(cls).get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                    try:
                        item = getattr(value, name)
                    except AttributeError:
                        continue
                    self._slot(value, name, _ATTRIBUTE, item, depth)

    def function(self, fn: types.FunctionType, depth: int) -> None:
        if not _is_project_file(fn.__code__.co_filename):
            return
        for cell in fn.__closure__ or ():
            try:
                item = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            self._slot(cell, None, _CELL, item, depth)
        if fn.__defaults__ and _may_hold(fn):
            self.arguments(fn, "__defaults__", depth)
        if fn.__kwdefaults__:
            self.mapping(fn.__kwdefaults__, depth)

    def arguments(self, owner: Any, name: str, depth: int) -> None:
        """A tuple attribute (default arguments, a thread's arguments): replaced whole."""
        items = getattr(owner, name, None)
        if not isinstance(items, tuple):
            return
        new = tuple(_proxy(item) or item for item in items)
        if any(a is not b for a, b in zip(new, items)):
            self._swap(owner, name, _ATTRIBUTE, items, new)
        for item in new:
            self.visit(item, depth + 1)

    def thread(self, thread: threading.Thread, depth: int) -> None:
        """A thread not started yet: its target and arguments (never its own locks)."""
        if thread.ident is not None:
            return
        attributes = vars(thread)
        target = attributes.get("_target")
        if target is not None:
            self.visit(target, depth + 1)
        self.arguments(thread, "_args", depth)
        kwargs = attributes.get("_kwargs")
        if isinstance(kwargs, dict):
            self.mapping(kwargs, depth)
        if _is_project_module(type(thread).__module__):  # a project's Thread subclass
            for name, item in list(attributes.items()):
                if name not in _THREAD_INTERNALS:
                    self._slot(attributes, name, _ITEM, item, depth)

    def condition(self, condition: threading.Condition) -> None:
        """A ``Condition`` on a plain lock: its lock and the lock's methods it keeps."""
        attributes = vars(condition)
        lock = attributes.get("_lock")
        if type(lock) not in (_LOCK_TYPE, _RLOCK_TYPE):
            return
        proxy = _proxy(lock)
        saved = {n: attributes[n] for n in _CONDITION_ATTRIBUTES if n in attributes}
        attributes["_lock"] = proxy
        for name in saved:
            if name != "_lock":
                attributes[name] = getattr(proxy, name)
        self.swapped += 1

        def undo() -> None:
            if attributes.get("_lock") is proxy:
                attributes.update(saved)

        self.session.restores.append(undo)

    # -- roots

    def modules(self) -> None:
        """The project's modules: their globals (and names imported from the patched
        modules, ``from threading import Lock``, get the audit's version)."""
        for namespace in _project_namespaces():
            if id(namespace) in self.seen:
                continue
            self.seen.add(id(namespace))
            for key in _candidates(namespace):
                try:
                    item = namespace[key]
                except KeyError:
                    continue
                imported = self.replacements.get(id(item))
                if imported is not None:
                    self._swap(namespace, key, _ITEM, item, imported)
                else:
                    self._slot(namespace, key, _ITEM, item, 0)

    def frames(self) -> None:
        """The local variables of the project's functions running on the other threads
        (searched, never written: a frame's locals cannot be replaced). The audit's own
        thread is not searched: what it hands to a thread or a pool later is searched
        then (``Thread.start``, ``submit``), and its locals would be searched at every
        audit for nothing new."""
        me = threading.get_ident()
        for ident, top in list(sys._current_frames().items()):
            if ident == me:
                continue
            frame: types.FrameType | None = top
            while frame is not None:
                code = frame.f_code
                # A module's own frame: its locals are its globals, searched above.
                if code.co_name != "<module>" and _is_project_file(code.co_filename):
                    for item in list(frame.f_locals.values()):
                        self.visit(item, 1)
                frame = frame.f_back


def adopt_existing(
    session: _Session,
    replacements: dict[int, Any],
    roots: Iterable[Any] = (),
    everything: bool = True,
) -> int:
    """Swaps the audit's proxies into the references the project keeps to plain locks,
    ``SimpleQueue`` s and ``Condition`` s (see the module docstring).

    Args:
      session: The session whose ``restores`` get the undo of each swap.
      replacements: ``id(original)`` -> replacement, for the functions and classes the
        audit patched in a module (``threading.Lock``): a project module's global
        holding an original gets the replacement too.
      roots: Further objects to search (dicts are searched and swapped in place).
      everything: Also search the project's modules and running frames (the first
        audit); False: ``roots`` only (a nested audit).

    Returns:
      How many references were swapped.
    """
    _ORIGINAL_IDS.update(replacements)
    adopter = _Adopter(session, replacements)
    for root in roots:
        adopter.visit(root, 1)
    if everything:
        adopter.modules()
        adopter.frames()
    return adopter.swapped


def restore(session: _Session) -> None:
    """Undoes every swap of the session, latest first."""
    while session.restores:
        session.restores.pop()()


# ---------------------------------------------------------------------- hooks


def _start_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Thread.start``: the thread's target and arguments adopted, then the fork (what
    the parent did so far happens before everything the thread does)."""

    @functools.wraps(original)
    def audited_start(self: threading.Thread) -> Any:
        session = active._SESSION
        if session is not None:
            _Adopter(session, {}).thread(self, 0)
            session.fork(self)
        return original(self)

    return audited_start


def _work_item_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``submit`` (``_WorkItem.__init__``, in the submitting thread): the task and its
    arguments adopted; what the submitter did so far happens before the task."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, *args, **kwargs)
        session = active._SESSION
        if session is not None:
            adopter = _Adopter(session, {})
            adopter.visit(getattr(self, "fn", None), 0)
            adopter.arguments(self, "args", 0)
            if isinstance(getattr(self, "kwargs", None), dict):
                adopter.mapping(self.kwargs, 0)
            self._safevars_submitted = (session, session.hand_off())

    return __init__
