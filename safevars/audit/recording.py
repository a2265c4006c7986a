"""The hooks that record accesses while an audit is active.

Wrappers for the read and write methods of TensorFlow's resource variables (eager
accesses go to the active detectors at once; accesses made while a function is traced
go to its summary, see ``tf_function.py``), for ``tf.CriticalSection.execute`` and
safevars' graph sections (the sections an access is made in), and for safevars'
snapshots (the reads of one snapshot are one consistent unit). ``patching.py`` installs
them; ``sites.py`` finds the user line of each access, the Keras call it came from and
the Keras variable behind it.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from safevars import locking
from safevars._tf_internal import eager_context_module as context
from safevars._tf_internal import ops
from safevars.audit import active
from safevars.audit.active import _DETECT_LOCK, _deliver
from safevars.audit.clocks import _Session
from safevars.audit.happens_before import (
    _READ,
    _SECTION_IDS,
    _SEQ,
    _UNIT_IDS,
    _VALIDATED_WRITE,
    _WRITE,
    _Access,
    _eager_protection,
)
from safevars.audit.sites import _IGNORE, _VALIDATE, _keras_path, _user_site
from safevars.audit.tf_function import (
    _SUMMARIES,
    _input_position,
    _Summary,
    _top_func_graph,
    _Traced,
)
from safevars.sections.tracing import _enclosing_sections

_READ_METHODS = ("_read_variable_op", "sparse_read", "gather_nd")
_WRITE_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "scatter_add",
    "scatter_sub",
    "scatter_max",
    "scatter_min",
    "scatter_mul",
    "scatter_div",
    "scatter_update",
    "batch_scatter_update",
    "scatter_nd_add",
    "scatter_nd_sub",
    "scatter_nd_update",
    "scatter_nd_max",
    "scatter_nd_min",
    "_strided_slice_assign",
)
# Writes of one family commute: applied in any order they give the same value, so one
# cannot make another's effect disappear.
_COMMUTATIVE = {
    "assign_add": "add",
    "assign_sub": "add",
    "scatter_add": "add",
    "scatter_sub": "add",
    "scatter_nd_add": "add",
    "scatter_nd_sub": "add",
    "scatter_mul": "mul",
    "scatter_div": "mul",
    "scatter_max": "max",
    "scatter_nd_max": "max",
    "scatter_min": "min",
    "scatter_nd_min": "min",
}


def _variable_key_and_name(variable: Any, session: _Session, frame: Any) -> tuple[int, str | None]:
    """The variable's key and the name reports show: its Keras path if a Keras variable
    is behind it (looked up in the frames of its first accesses), else its TensorFlow
    name."""
    handle = variable._handle
    key = id(handle)
    known = session.handles.get(key)
    if known is not None and not known[2]:  # the usual case: nothing left to look up
        return key, known[1]
    if session.wants_path(key):
        name = getattr(variable, "_handle_name", None) or None
        session.register(handle, name, _keras_path(frame, handle))
    return key, session.name_of(key)


def _record_access(
    variable: Any, kind: int, method: str | None, begin: int, frame: Any = None
) -> None:
    end = next(_SEQ)
    session = active._SESSION
    if session is None or not active._ACTIVE:
        return
    if frame is None:
        frame = sys._getframe(2)
    site, role, api = _user_site(frame)
    if role == _IGNORE:
        return
    if role == _VALIDATE and kind == _WRITE:
        kind = _VALIDATED_WRITE
    key, name = _variable_key_and_name(variable, session, frame)
    family = _COMMUTATIVE.get(method) if method else None
    state = session.state()
    if context.executing_eagerly():
        locks, sections = _eager_protection(state)
        access = _Access.record(
            kind,
            key,
            name,
            site,
            state.run or state.current_run(),
            begin,
            end,
            locks,
            sections,
            family,
            "eager",
            state.unit,
            api,
        )
        _deliver([access])
        return
    top = _top_func_graph()
    if top is None:
        return  # A TF1-style graph: not audited.
    traced_sections = frozenset((k, i) for k, i, g in state.sections if g is not None)
    # Arguments are mapped to their graph inputs only while tracing: resolve it now.
    traced = _Traced(
        kind,
        key,
        name,
        site,
        frozenset(k for k, _ in traced_sections),
        traced_sections,
        family,
        _input_position(top, key),
        state.unit,
    )
    with _DETECT_LOCK:
        summary = _SUMMARIES.get(top)
        if summary is None:
            summary = _SUMMARIES[top] = _Summary(top.name)
        summary.accesses.append(traced)
        summary.keras = summary.keras or api is not None
        for detector in active._ACTIVE:
            if not detector.closed:
                detector.traced += 1


def _is_internal_variable(variable: Any) -> bool:
    # safevars' own version counters are bookkeeping under safevars' locks.
    return isinstance(variable, locking._VersionVariable)


def _read_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_internal_variable(self):
            return original(self, *args, **kwargs)
        begin = next(_SEQ)
        result = original(self, *args, **kwargs)
        _record_access(self, _READ, None, begin)
        return result

    return audited_read


def _write_wrapper(original: Callable[..., Any], method: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        session = active._SESSION
        if session is None or _is_internal_variable(self):
            return original(self, *args, **kwargs)
        state = session.state()
        if state.write_depth:  # A write implemented with another write: count once.
            return original(self, *args, **kwargs)
        state.write_depth += 1
        begin = next(_SEQ)
        try:
            result = original(self, *args, **kwargs)
        finally:
            state.write_depth -= 1
        _record_access(self, _WRITE, method, begin)
        return result

    return audited_write


def _writer(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda original: _write_wrapper(original, method)


def _execute_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_execute(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        session = active._SESSION
        if session is None:
            return original(self, fn, *args, **kwargs)
        state = session.state()
        graph = None if context.executing_eagerly() else ops.get_default_graph()
        entry = (id(self), next(_SECTION_IDS), graph)
        state.sections.append(entry)
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            state.sections.remove(entry)

    return audited_execute


def _section_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``sections.section._traced_section``: the graph sections of safevars locks."""

    @functools.wraps(original)
    def audited_section(ordered: list[Any], fn: Any, after: Any, *rest: Any) -> Any:
        session = active._SESSION
        if session is None:
            return original(ordered, fn, after, *rest)
        state = session.state()
        graph = ops.get_default_graph()
        # Locks an enclosing section already holds keep that section's instance: a
        # read there and a write here are one continuous hold.
        enclosing = set().union(*(locks for locks, _ in _enclosing_sections()))
        entries = [
            (id(lock), next(_SECTION_IDS), graph) for lock in ordered if lock not in enclosing
        ]
        state.sections.extend(entries)
        try:
            return original(ordered, fn, after, *rest)
        finally:
            for entry in entries:
                state.sections.remove(entry)

    return audited_section


def _join_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_join(self: threading.Thread, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        session = active._SESSION
        if session is not None and not self.is_alive():
            session.joined(self)
        return result

    return audited_join


def _snapshot_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps ``take_snapshots``: a snapshot reads its variables (the fast path reads
    their handles with a raw op, which no hook sees), and the reads of one snapshot call
    are one consistent unit (a torn read is never reported between them)."""

    @functools.wraps(original)
    def audited_take_snapshots(variables: Any, *args: Any, **kwargs: Any) -> Any:
        session = active._SESSION
        if session is None:
            return original(variables, *args, **kwargs)
        state = session.state()
        outer = state.unit
        if outer is None:
            state.unit = next(_UNIT_IDS)
        try:
            begin = next(_SEQ)
            snapshots = original(variables, *args, **kwargs)
            frame = sys._getframe(1)
            for variable in variables:
                inner = getattr(variable, "__wrapped__", None)
                if getattr(inner, "_handle", None) is not None:
                    _record_access(inner, _READ, None, begin, frame)
            return snapshots
        finally:
            state.unit = outer

    return audited_take_snapshots
