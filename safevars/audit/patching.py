"""What an audit patches, installed by the first active audit and removed by the last.

Nothing is patched while no audit is active. ``_activate`` starts an audit (a new
session and the patches if it is the first), ``_deactivate`` ends it (the original
functions back if it was the last), also when installing fails half way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from safevars import locking
from safevars._tf_internal import concrete_function, critical_section_ops, resource_variable_ops
from safevars.audit import active
from safevars.audit.active import _DETECT_LOCK
from safevars.audit.happens_before import _Detector, _Session
from safevars.audit.recording import (
    _READ_METHODS,
    _WRITE_METHODS,
    _execute_wrapper,
    _join_wrapper,
    _read_wrapper,
    _section_wrapper,
    _start_wrapper,
    _writer,
)
from safevars.audit.tf_function import _call_wrapper, _to_tensors_wrapper
from safevars.sections import section
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


def _patch_targets() -> list[tuple[Any, str, Callable[[Any], Any]]]:
    """(owner, attribute, wrapper factory) for everything an audit patches."""
    targets: list[tuple[Any, str, Callable[[Any], Any]]] = []
    for cls in _variable_classes():
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
    ):
        if name in owner.__dict__:  # A TensorFlow release without it: less to see.
            targets.append((owner, name, factory))
    return targets


_ORIGINALS: list[tuple[Any, str, Any]] = []
# (owner, name) -> (original, wrapper): wrappers are built once and reused by later
# audits, as long as the attribute still holds the same original.
_WRAPPERS: dict[tuple[Any, str], tuple[Any, Any]] = {}


def _install() -> None:
    variable_writes._direct_kernel_writes = False  # SafeVariable writes via the methods.
    for owner, name, factory in _patch_targets():
        original = owner.__dict__[name]
        cached = _WRAPPERS.get((owner, name))
        if cached is None or cached[0] is not original:
            cached = _WRAPPERS[(owner, name)] = (original, factory(original))
        _ORIGINALS.append((owner, name, original))
        setattr(owner, name, cached[1])


def _uninstall() -> None:
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        setattr(owner, name, original)
    variable_writes._direct_kernel_writes = True


_INSTALL_LOCK = threading.Lock()


def _activate(detector: _Detector) -> None:
    with _INSTALL_LOCK:
        if not active._ACTIVE:
            active._SESSION = _Session()
            try:
                _install()
            except BaseException:
                _uninstall()
                active._SESSION = None
                raise
        with _DETECT_LOCK:
            active._ACTIVE = (*active._ACTIVE, detector)


def _deactivate(detector: _Detector) -> None:
    with _INSTALL_LOCK:
        with _DETECT_LOCK:
            detector.closed = True
            active._ACTIVE = tuple(d for d in active._ACTIVE if d is not detector)
        if not active._ACTIVE:
            _uninstall()
            active._SESSION = None
