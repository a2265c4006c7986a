"""What an audit patches, installed by the first active audit and removed by the last.

Nothing is patched while no audit is active. ``_activate`` starts an audit (a new
session, the patches and the adoption of the locks made before it if it is the first),
``_deactivate`` ends it (the references swapped back and the original functions back if
it was the last), also when installing fails half way.
"""

from __future__ import annotations

import importlib
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from safevars import locking
from safevars._tf_internal import concrete_function, critical_section_ops, resource_variable_ops
from safevars.audit import active, sync
from safevars.audit.active import _DETECT_LOCK
from safevars.audit.adopting import _start_wrapper, _work_item_init, adopt_existing, restore
from safevars.audit.clocks import _Session
from safevars.audit.happens_before import _Detector
from safevars.audit.recording import (
    _READ_METHODS,
    _WRITE_METHODS,
    _execute_wrapper,
    _join_wrapper,
    _read_wrapper,
    _section_wrapper,
    _snapshot_wrapper,
    _writer,
)
from safevars.audit.tf_function import _call_wrapper, _to_tensors_wrapper
from safevars.sections import section
from safevars.variable import snapshots as variable_snapshots
from safevars.variable import writes as variable_writes


def _variable_classes() -> list[type]:
    """``BaseResourceVariable`` and all its subclasses loaded so far (TensorFlow's own
    ``ResourceVariable`` re-wraps ``assign``/``assign_add``/``assign_sub``, so patching
    the base class alone would miss them)."""
    found: list[type] = []
    pending = [resource_variable_ops.BaseResourceVariable]
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found


_TARGETS: list[Any] = [None, []]  # the variable classes, and the targets made for them


def _patch_targets() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, wrapper factory) for everything an audit patches (the same
    list again while no variable class was added)."""
    classes = _variable_classes()
    if _TARGETS[0] != classes:
        _TARGETS[:] = [classes, _make_targets(classes)]
    return list(_TARGETS[1])


def _make_targets(classes: list[type]) -> list[tuple[Any, str, Callable[[Any], Any]]]:
    targets: list[tuple[Any, str, Callable[[Any], Any]]] = []
    for cls in classes:
        if cls is locking._VersionVariable:
            continue
        for method in _READ_METHODS:
            if method in cls.__dict__:
                targets.append((cls, method, _read_wrapper))
        for method in _WRITE_METHODS:
            if method in cls.__dict__:
                targets.append((cls, method, _writer(method)))
    for owner, name, factory in (
        (critical_section_ops.CriticalSection, "execute", _execute_wrapper),
        (section, "_traced_section", _section_wrapper),
        (concrete_function.ConcreteFunction, "_call_flat", _call_wrapper),
        (resource_variable_ops.VariableSpec, "to_tensors", _to_tensors_wrapper),
        (threading.Thread, "start", _start_wrapper),
        (threading.Thread, "join", _join_wrapper),
        (sync.futures_thread._WorkItem, "__init__", _work_item_init),
        # A snapshot's reads are one unit; its function is imported by name in three
        # modules (the one that defines it, SafeVariable's, safevars.snapshot's).
        (variable_snapshots, "take_snapshots", _snapshot_wrapper),
        (
            importlib.import_module("safevars.variable.safe_variable"),
            "take_snapshots",
            _snapshot_wrapper,
        ),
        (importlib.import_module("safevars.snapshot"), "take_snapshots", _snapshot_wrapper),
    ):
        if name in owner.__dict__:  # A TensorFlow release without it: less to see.
            targets.append((owner, name, factory))
    targets.extend(sync._patch_targets())
    return targets


_ORIGINALS: list[tuple[Any, str, Any]] = []
# (owner, name) -> (original, wrapper): wrappers are built once and reused by later
# audits, as long as the attribute still holds the same original.
_WRAPPERS: dict[tuple[Any, str], tuple[Any, Any]] = {}


def _install() -> dict[int, Any]:
    """Installs every patch; returns ``id(original)`` -> replacement for those made in
    a module (``threading.Lock``), which project modules may have imported by name."""
    variable_writes._direct_kernel_writes = False  # SafeVariable writes via the methods.
    replacements: dict[int, Any] = {}
    for owner, name, factory in _patch_targets():
        original = owner.__dict__[name]
        cached = _WRAPPERS.get((owner, name))
        if cached is None or cached[0] is not original:
            cached = _WRAPPERS[(owner, name)] = (original, factory(original))
        _ORIGINALS.append((owner, name, original))
        setattr(owner, name, cached[1])
        if isinstance(owner, types.ModuleType) and owner.__name__.split(".")[0] != "safevars":
            replacements[id(original)] = cached[1]
    return replacements


def _uninstall() -> None:
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        setattr(owner, name, original)
    variable_writes._direct_kernel_writes = True


_INSTALL_LOCK = threading.Lock()
_REPLACEMENTS: dict[int, Any] = {}


def _activate(detector: _Detector, roots: Iterable[Any] = ()) -> None:
    with _INSTALL_LOCK:
        first = not active._ACTIVE
        if first:
            session = active._SESSION = _Session()
            try:
                _REPLACEMENTS.clear()
                _REPLACEMENTS.update(_install())
                adopt_existing(session, _REPLACEMENTS, roots)
            except BaseException:
                restore(session)
                _uninstall()
                active._SESSION = None
                raise
        elif roots and active._SESSION is not None:
            adopt_existing(active._SESSION, _REPLACEMENTS, roots, everything=False)
        with _DETECT_LOCK:
            active._ACTIVE = (*active._ACTIVE, detector)


def _deactivate(detector: _Detector) -> None:
    with _INSTALL_LOCK:
        with _DETECT_LOCK:
            detector.closed = True
            active._ACTIVE = tuple(d for d in active._ACTIVE if d is not detector)
        if not active._ACTIVE:
            session = active._SESSION
            try:
                if session is not None:
                    restore(session)
            finally:
                _uninstall()
                active._SESSION = None
