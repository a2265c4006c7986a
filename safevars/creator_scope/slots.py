"""Optimizer slots of safe weights are safe, under the weight's lock.

Keras makes an optimizer's per-weight variables (Adam's moments, SGD's momentum, the
accumulators of ``gradient_accumulation_steps``, EMA copies) with
``add_variable_from_reference``, usually while tracing the first ``fit`` step, outside
any :func:`safevars.scope` block. For a safe weight, the patched method makes the slot
a SafeVariable that shares the weight's lock and records it as the weight's
(:func:`slots_of`), whether the optimizer was made inside the scope or not.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from safevars.creator_scope.backing import safe_backing
from safevars.creator_scope.creators import joining
from safevars.distribute import check_strategy
from safevars.locking import Guard

__all__ = ["add_variable_from_reference", "slots_of"]

# Guard of a weight -> guards of the optimizer variables made for it.
_SLOTS: weakref.WeakKeyDictionary[Guard, weakref.WeakSet[Guard]] = weakref.WeakKeyDictionary()
_SLOTS_LOCK = threading.Lock()


def slots_of(guard: Guard) -> list[Guard]:
    """The guards of the optimizer variables made for ``guard``'s variable (slots)."""
    with _SLOTS_LOCK:
        return list(_SLOTS.get(guard, ()))


def add_variable_from_reference(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps Keras' ``Optimizer.add_variable_from_reference``."""

    def add_variable_from_reference(
        self: Any, reference_variable: Any, *args: Any, **kwargs: Any
    ) -> Any:
        reference = safe_backing(reference_variable)
        if reference is None:
            return original(self, reference_variable, *args, **kwargs)
        check_strategy()
        with joining(reference.guard.lock):
            slot = original(self, reference_variable, *args, **kwargs)
        safe = safe_backing(slot)
        if safe is not None:
            with _SLOTS_LOCK:
                _SLOTS.setdefault(reference.guard, weakref.WeakSet()).add(safe.guard)
        return slot

    add_variable_from_reference.__wrapped__ = original  # type: ignore[attr-defined]
    add_variable_from_reference._safevars = True  # type: ignore[attr-defined]
    return add_variable_from_reference
