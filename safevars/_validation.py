"""Argument checks shared by every public constructor and method.

One place for the wording of "bad argument" errors, so that every message names the
argument, shows the value received (shortened) and, where one helps, says how to fix it.
Each check raises :class:`~safevars.errors.InvalidArgumentError` (also a ``ValueError``
and a ``tf.errors.InvalidArgumentError``) before anything is changed, and returns the
value normalised (a Python ``int`` for a NumPy integer, for example).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from safevars.errors import InvalidArgumentError

__all__ = ["check_bool", "check_choice", "check_int", "is_int", "short"]


def short(value: Any) -> str:
    """``repr(value)``, cut to 80 characters for error messages."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python or NumPy) and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _fix(fix: str) -> str:
    return f" {fix}" if fix else ""


def check_int(
    value: Any, argument: str, minimum: int, *, optional: bool = False, fix: str = ""
) -> Any:
    """``int(value)`` if it is an integer ``>= minimum`` (or ``None`` when ``optional``)."""
    if value is None and optional:
        return None
    if not is_int(value) or value < minimum:
        allowed = f"None or an int >= {minimum}" if optional else f"an int >= {minimum}"
        raise InvalidArgumentError(
            f"{argument} must be {allowed}, got {short(value)}"
            f"{'' if is_int(value) else f' of type {type(value).__name__}'}.{_fix(fix)}"
        )
    return int(value)


def check_choice(value: Any, argument: str, choices: Sequence[str], fix: str = "") -> str:
    """``value`` if it is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(
            f"{argument} must be one of {', '.join(map(repr, choices))}, got "
            f"{short(value)}.{_fix(fix)}"
        )
    return value


def check_bool(value: Any, argument: str, fix: str = "") -> bool:
    """``bool(value)`` if it is a bool (Python or NumPy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(
            f"{argument} must be a bool (True or False), got {short(value)}.{_fix(fix)}"
        )
    return bool(value)
