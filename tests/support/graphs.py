"""Keeping a traced function alive as long as the variable it uses.

A lock stays in run-time mode only while a traced graph that uses it is alive: once the
last is garbage-collected, the next eager section switches the lock back to eager mode.
A test that puts a variable in run-time mode with a function it then drops would test
eager mode from its next write on; :func:`kept_with` keeps the function as long as the
variable (a ``_self_`` attribute of the proxy, so a cycle the garbage collector frees
with both).
"""

from __future__ import annotations

from typing import Any, TypeVar

F = TypeVar("F")


def kept_with(variable: Any, function: F) -> F:
    """``function``, kept alive as long as ``variable`` (a SafeVariable)."""
    kept = list(getattr(variable, "_self_kept_functions", ()))
    variable._self_kept_functions = [*kept, function]
    return function
