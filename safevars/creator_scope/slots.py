"""Optimizer slots of safe weights are safe, under the weight's lock.

Keras makes an optimizer's per-weight variables (Adam's moments, SGD's momentum, the
accumulators of ``gradient_accumulation_steps``, EMA copies) with
``add_variable_from_reference``, usually while tracing the first ``fit`` step, outside
any :func:`safevars.scope` block. For a safe weight, the patched method makes the slot
a SafeVariable that shares the weight's lock and records it as the weight's
(:func:`slots_of`), whether the optimizer was made inside the scope or not.

An optimizer built before its model was protected (``safevars.protect`` of a fitted
model) made its slots plain: :func:`record_built_slots` finds them afterwards in the
lists Keras keeps one entry per trainable variable in (Adam's ``_momentums`` and
``_velocities``, the accumulators, EMA copies), so the step counts them with their
weights as it does in the scope (one version add per step, not one per slot).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from safevars.creator_scope.backing import safe_backing
from safevars.creator_scope.creators import joining
from safevars.distribute import check_strategy
from safevars.locking import Guard

__all__ = ["add_variable_from_reference", "record_built_slots", "slots_of"]

# Guard of a weight -> guards of the optimizer variables made for it.
_SLOTS: weakref.WeakKeyDictionary[Guard, weakref.WeakSet[Guard]] = weakref.WeakKeyDictionary()
_SLOTS_LOCK = threading.Lock()


def slots_of(guard: Guard) -> list[Guard]:
    """The guards of the optimizer variables made for ``guard``'s variable (slots)."""
    with _SLOTS_LOCK:
        return list(_SLOTS.get(guard, ()))


def _record(weight: Guard, slot: Guard) -> None:
    with _SLOTS_LOCK:
        _SLOTS.setdefault(weight, weakref.WeakSet()).add(slot)


def record_built_slots(optimizer: Any) -> None:
    """Records the slots ``optimizer`` made before its weights were safe.

    A slot is an entry of a list attribute of the optimizer aligned with its trainable
    variables (one entry per variable, ``None`` where it has none): an optimizer
    variable of the weight's shape and dtype, safe under the weight's lock. Lists of
    any other length, and entries that are not such variables, are left alone.
    """
    weights = list(getattr(optimizer, "_trainable_variables", None) or ())
    if not weights:
        return
    own = {id(v) for v in optimizer.variables}
    for name, value in vars(optimizer).items():
        if name == "_variables" or not isinstance(value, Sequence) or isinstance(value, str):
            continue
        if len(value) != len(weights):
            continue
        for weight, slot in zip(weights, value):
            if slot is None or id(slot) not in own or slot is weight:
                continue
            if tuple(slot.shape) != tuple(weight.shape) or slot.dtype != weight.dtype:
                continue
            safe_weight, safe_slot = safe_backing(weight), safe_backing(slot)
            if safe_weight is None or safe_slot is None:
                continue
            if safe_slot.guard.lock is safe_weight.guard.lock:
                _record(safe_weight.guard, safe_slot.guard)


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
            _record(reference.guard, safe.guard)
        return slot

    add_variable_from_reference.__wrapped__ = original  # type: ignore[attr-defined]
    add_variable_from_reference._safevars = True  # type: ignore[attr-defined]
    return add_variable_from_reference
