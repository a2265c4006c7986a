"""Which line of user code made an access: stack frames classified by file.

A frame is TensorFlow/Keras/wrapt/absl/threading machinery (``_INTERNAL``), safevars'
own (``_SAFEVARS``: any file of the safevars package, this audit package included) or
the user's (``_USER``); a site is the first user frame, with AutoGraph's generated code
mapped back to the source it came from. What an access made by safevars itself means
(ignored, or a write validated under the lock) is decided by the safevars function that
made it (``_CALLER_ROLES``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from typing import Any

from safevars import variable as variable_module
from safevars._tf_internal import autograph_source_map

_INTERNAL = 1
_SAFEVARS = 2
_USER = 0


def _package_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
    dirs: list[str] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(os.path.join(p, "") for p in spec.submodule_search_locations)
    return tuple(dirs)


_INTERNAL_DIRS = _package_dirs(("tensorflow", "keras", "tf_keras", "wrapt", "absl")) + (
    os.path.join(os.path.dirname(os.path.abspath(threading.__file__)), "concurrent", ""),
)
_INTERNAL_FILES = frozenset(
    os.path.abspath(m.__file__) for m in (threading, contextlib, functools) if m.__file__
)
# The whole safevars package (this file is safevars/audit/sites.py, two levels down):
# frames in any safevars file, the audit's own included, are never the user's site.
_SAFEVARS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_FILE_KIND: dict[str, int] = {}


def _file_kind(filename: str) -> int:
    kind = _FILE_KIND.get(filename)
    if kind is None:
        path = os.path.abspath(filename) if not filename.startswith("<") else filename
        if path.startswith(_SAFEVARS_DIR):
            kind = _SAFEVARS
        elif (
            path in _INTERNAL_FILES
            or path.startswith(_INTERNAL_DIRS)
            or filename.startswith("<frozen")
        ):
            kind = _INTERNAL
        else:
            kind = _USER
        _FILE_KIND[filename] = kind
    return kind


_PLAIN = 0
_IGNORE = 1
_VALIDATE = 2


def _nested_codes(code: Any) -> set[Any]:
    """``code`` and every function body defined inside it (closures, lambdas)."""
    found = {code}
    for const in code.co_consts:
        if hasattr(const, "co_consts"):
            found |= _nested_codes(const)
    return found


def _caller_roles() -> dict[Any, int]:
    """What an access means when safevars itself makes it (first non-TensorFlow frame).

    * SafeVariable's graph writes return a read of the new value, made for the caller:
      bookkeeping, not the start of a read-modify-write (ignored).
    * ``compare_and_assign`` writes only if the version did not move since the caller's
      snapshot, so its write is never based on a stale read (it discards the pending
      read and counts as a write validated under the lock).
    """
    roles = {variable_module.SafeVariable._graph_write_body.__code__: _IGNORE}
    for code in _nested_codes(variable_module.SafeVariable.compare_and_assign.__code__):
        roles[code] = _VALIDATE
    return roles


_CALLER_ROLES = _caller_roles()


def _user_site(frame: Any) -> tuple[str, int]:
    """``("file:line", role)`` for the first user frame at or above ``frame``."""
    role = None
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind != _INTERNAL and role is None:
            role = _CALLER_ROLES.get(code, _PLAIN)
            if role == _IGNORE:
                return "", role
        if kind == _USER:
            filename, lineno = code.co_filename, frame.f_lineno
            if "__autograph_generated_file" in filename:
                filename, lineno = _autograph_origin(filename, lineno)
            return f"{filename}:{lineno}", role or _PLAIN
        frame = frame.f_back
    return "<unknown>", role or _PLAIN


def _autograph_origin(filename: str, lineno: int) -> tuple[str, int]:
    """Maps a line of AutoGraph's generated code back to the user's source line."""
    try:  # Private TensorFlow API: if it moves, sites point at the generated file.
        mapper = autograph_source_map()[threading.get_ident()][-1]
        origin = mapper.get_effective_source_map().get((filename, lineno))
    except Exception:  # noqa: BLE001 - any failure only loses the mapping
        origin = None
    if origin:
        return origin[0], origin[1]
    return filename, lineno
