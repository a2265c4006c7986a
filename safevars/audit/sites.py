"""Which line of user code made an access: stack frames classified by file.

A frame is TensorFlow/wrapt/absl/threading machinery (``_INTERNAL``), Keras'
(``_KERAS``), safevars' own (``_SAFEVARS``: any file of the safevars package, this audit
package included) or the user's (``_USER``); a site is the first user frame, with
AutoGraph's generated code mapped back to the source it came from. What an access made
by safevars itself means (ignored, or a write validated under the lock) is decided by
the safevars function that made it (``_CALLER_ROLES``); a write made by Keras' metric
resets or ``set_weights`` is not based on a read (``_KERAS_BLIND``). The Keras call an
access came from is the outermost Keras frame below the user's (``train_on_batch``), and
the Keras variable behind a ``tf.Variable`` is found in the frames of its methods
(:func:`_keras_path`).

Which code is the *project's* (:func:`_is_project_file`: neither the standard library,
nor an installed package, nor safevars) decides which locks the audit tracks
(``sync.py``, ``adopting.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sysconfig
import threading
from typing import Any

import keras

from safevars import variable as variable_module
from safevars._tf_internal import autograph_source_map

_INTERNAL = 1
_SAFEVARS = 2
_USER = 0
_KERAS = 3


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


_INTERNAL_DIRS = _package_dirs(("tensorflow", "wrapt", "absl")) + (
    os.path.join(os.path.dirname(os.path.abspath(threading.__file__)), "concurrent", ""),
)
_KERAS_DIRS = _package_dirs(("keras", "tf_keras"))
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
        elif path.startswith(_KERAS_DIRS):
            kind = _KERAS
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


# Keras functions whose writes do not depend on an earlier read of the variable.
_KERAS_BLIND = frozenset({"reset_state", "reset_metrics", "set_weights", "load_weights"})
# SafeOptimizer's methods named as the call an access came from.
_SAFEVARS_CALLS = frozenset({"apply_gradients", "apply", "minimize"})
# Keras decorators and dispatchers: never named as the call an access came from.
_KERAS_WRAPPERS = frozenset({"error_handler", "wrapper", "_wrapper", "inner", "wrapped"})


def _user_site(frame: Any) -> tuple[str, int, str | None]:
    """``("file:line", role, Keras call)`` for the first user frame at or above ``frame``."""
    role = None
    api = None
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind == _KERAS:
            name = code.co_name
            if name not in _KERAS_WRAPPERS:
                api = name  # the outermost one below the user's frame wins
            if name in _KERAS_BLIND and role in (None, _PLAIN):
                role = _VALIDATE
        elif kind != _INTERNAL:
            if kind == _SAFEVARS and code.co_name in _SAFEVARS_CALLS:
                api = code.co_name  # SafeOptimizer's, around Keras' own
            if role is None:
                role = _CALLER_ROLES.get(code, _PLAIN)
                if role == _IGNORE:
                    return "", role, None
        if kind == _USER:
            filename, lineno = code.co_filename, frame.f_lineno
            if "__autograph_generated_file" in filename:
                filename, lineno = _autograph_origin(filename, lineno)
            return f"{filename}:{lineno}", role or _PLAIN, api
        frame = frame.f_back
    return "<unknown>", role or _PLAIN, api


def _keras_path(frame: Any, handle: Any) -> str | None:
    """The ``path`` of the Keras variable whose method is running in a frame at or above
    ``frame`` and whose value is the variable of ``handle`` (None if there is none)."""
    while frame is not None:
        code = frame.f_code
        kind = _file_kind(code.co_filename)
        if kind == _USER:
            return None
        if kind == _KERAS and code.co_varnames[:1] == ("self",):
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.Variable) and _backed_by(owner, handle):
                path = getattr(owner, "path", None)
                if isinstance(path, str):
                    return path
        frame = frame.f_back
    return None


def _backed_by(owner: Any, handle: Any) -> bool:
    value = getattr(owner, "_value", None)  # the tf.Variable (or SafeVariable) behind it
    for candidate in (value, getattr(value, "__wrapped__", None)):
        if candidate is not None and getattr(candidate, "_handle", None) is handle:
            return True
    return False


# ---------------------------------------------------------------------- project code

_STDLIB_DIRS = tuple(
    os.path.join(os.path.abspath(p), "")
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)
_PROJECT_FILE: dict[str, bool] = {}


def _is_project_file(filename: str) -> bool:
    """Whether ``filename`` is the project's code: the user's kind, and neither in the
    standard library nor in an installed package (``site-packages``, ``dist-packages``).
    The audit tracks the locks the project's code creates or holds."""
    known = _PROJECT_FILE.get(filename)
    if known is None:
        known = _file_kind(filename) == _USER
        if known and not filename.startswith("<"):
            path = os.path.abspath(filename)
            parts = path.split(os.sep)
            known = not (
                "site-packages" in parts
                or "dist-packages" in parts
                or path.startswith(_STDLIB_DIRS)
            )
        _PROJECT_FILE[filename] = known
    return known


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
