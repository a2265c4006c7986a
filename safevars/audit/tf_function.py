"""Inside ``tf.function``: accesses traced into a graph, replayed at each eager call.

Graph execution is invisible to Python patching, so an access made while a function is
traced is kept, in program order, in the :class:`_Summary` of its ``FuncGraph``
(``_SUMMARIES``; recorded by ``recording._record_access``). Each eager call of the
concrete function (``ConcreteFunction._call_flat``, patched) replays the summary as
accesses of the calling thread, one run of their own (a call's writes are one update,
its reads one view), named after the Keras call that made it; a function called while
tracing another adds its summary to the caller's. A variable that reached the graph as an argument is attributed
to the variable passed in each call.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from safevars._tf_internal import (
    captured_placeholder,
    func_graph_module,
    ops,
    resource_variable_ops,
)
from safevars._tf_internal import eager_context_module as context
from safevars.audit import active
from safevars.audit.active import _DETECT_LOCK
from safevars.audit.clocks import _Run
from safevars.audit.happens_before import (
    _SECTION_IDS,
    _SEQ,
    _Access,
    _eager_protection,
)
from safevars.audit.sites import _user_site


class _Traced(NamedTuple):
    """One access recorded while tracing a function, replayed at each call. Immutable."""

    kind: int
    var: Any
    name: str | None
    site: str
    locks: frozenset[Any]
    sections: frozenset[Any]
    family: str | None
    # Index of the graph input that carries ``var`` (None: resolved at the first call).
    position: int | None = None
    unit: int | None = None  # the snapshot it was read in, if any


class _Summary:
    """The accesses of one traced function, in program order."""

    __slots__ = ("name", "accesses", "positions", "keras")

    def __init__(self, name: str) -> None:
        self.name = name
        self.accesses: list[_Traced] = []
        # Whether Keras code made some of them: each call then names the Keras call that
        # made it (train_on_batch, fit).
        self.keras = False
        # id(handle seen at trace time) -> index of the graph input that carries it at
        # run time (a capture, or an argument: then each call may pass another variable).
        self.positions: dict[int, int | None] = {}

    def position(self, graph: Any, handle_id: int) -> int | None:
        if handle_id not in self.positions:
            self.positions[handle_id] = _input_position(graph, handle_id)
        return self.positions[handle_id]


def _input_position(graph: Any, handle_id: int) -> int | None:
    """Index of the input of ``graph`` that carries the handle ``id`` (or None)."""
    # While a function is being traced, its inputs list holds the arguments' external
    # handles; afterwards the internal placeholders.
    internal = captured_placeholder(graph, handle_id)
    for index, placeholder in enumerate(graph.inputs):
        if id(placeholder) == handle_id or (internal is not None and placeholder is internal):
            return index
    return None


# FuncGraph -> accesses traced into it while an audit was active. Weak keys: a summary
# lives exactly as long as its graph, so keeping it between audits costs nothing.
_SUMMARIES: weakref.WeakKeyDictionary[Any, _Summary] = weakref.WeakKeyDictionary()


def _top_func_graph() -> Any:
    graph = ops.get_default_graph()
    top = None
    while isinstance(graph, func_graph_module.FuncGraph):
        top = graph
        graph = graph.outer_graph
    return top


def _call_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def audited_call_flat(self: Any, tensor_inputs: Any, captured_inputs: Any) -> Any:
        if active._SESSION is None:
            return original(self, tensor_inputs, captured_inputs)
        if not context.executing_eagerly():
            _merge_nested(self)
            return original(self, tensor_inputs, captured_inputs)
        begin = next(_SEQ)
        result = original(self, tensor_inputs, captured_inputs)
        _replay(self, [*tensor_inputs, *captured_inputs], begin)
        return result

    return audited_call_flat


def _merge_nested(function: Any) -> None:
    """A function called while tracing another: its accesses become the caller's."""
    graph = getattr(function, "_func_graph", None)
    inner = _SUMMARIES.get(graph) if graph is not None else None
    top = _top_func_graph()
    if inner is None or top is None or top is graph:
        return
    session = active._SESSION
    if session is None:
        return
    state = session.state()
    extra = frozenset((k, i) for k, i, g in state.sections if g is not None)
    extra_locks = frozenset(k for k, _ in extra)
    with _DETECT_LOCK:
        outer = _SUMMARIES.get(top)
        if outer is None:
            outer = _SUMMARIES[top] = _Summary(top.name)
        outer.keras = outer.keras or inner.keras
        for t in list(inner.accesses):
            # The caller's graph has other inputs: its position is resolved at its calls.
            outer.accesses.append(
                t._replace(locks=t.locks | extra_locks, sections=t.sections | extra, position=None)
            )


def _replay(function: Any, inputs: list[Any], begin: int) -> None:
    """Feeds a finished eager call's traced accesses to the active audits.

    ``inputs`` are the call's flat graph inputs (arguments, then captures): a traced
    access of a variable that reached the graph as an argument is attributed to the
    variable passed in this call.
    """
    end = next(_SEQ)
    session = active._SESSION
    if session is None:
        return
    graph = getattr(function, "_func_graph", None)
    summary = _SUMMARIES.get(graph) if graph is not None else None
    name = getattr(graph, "name", "?")
    if summary is None:
        if graph is not None and graph.variables and not name.startswith("__backward"):
            with _DETECT_LOCK:
                for detector in active._ACTIVE:
                    detector.unanalysed[name] += 1
        return
    state = session.state()
    locks, sections = _eager_protection(state)
    call = next(_SECTION_IDS)
    label = f"tf.function {summary.name!r}"
    run = _Run(state)  # the call's accesses: one update, one view
    api = _user_site(sys._getframe(2))[2] if summary.keras else None  # train_on_batch
    accesses = []
    for t in list(summary.accesses):
        key, name = t.var, t.name
        position = t.position
        if position is None:
            position = summary.position(graph, t.var)
        if position is not None and position < len(inputs):
            handle = inputs[position]
            key = id(handle)
            if key != t.var:
                name = session.name_of(key) or f"argument of {summary.name!r}"
            session.register(handle, name)
        accesses.append(
            _Access.record(
                t.kind,
                key,
                name,
                t.site,
                run,
                begin,
                end,
                t.locks | locks,
                frozenset((k, i, call) for k, i in t.sections) | sections,
                t.family,
                label,
                None if t.unit is None else (call, t.unit),
                api,
            )
        )
    with _DETECT_LOCK:
        for detector in active._ACTIVE:
            if not detector.closed:
                detector.calls[summary.name] += 1
                for access in accesses:
                    detector.observe(access)


def _to_tensors_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    # A variable passed to a tf.function as an argument is flattened to its handle
    # here; remember its name so the replayed accesses can show it.
    @functools.wraps(original)
    def audited_to_tensors(self: Any, value: Any) -> Any:
        tensors = original(self, value)
        session = active._SESSION
        if session is not None and isinstance(value, resource_variable_ops.BaseResourceVariable):
            session.register(value._handle, getattr(value, "_handle_name", None) or None)
        return tensors

    return audited_to_tensors
