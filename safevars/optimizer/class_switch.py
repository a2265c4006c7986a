"""``SafeOptimizer(opt, ...)``: checks everything, then gives ``opt`` a safe class.

``SafeOptimizer`` is called through its metaclass, :class:`_SafeOptimizerType`, which
does not construct a ``SafeOptimizer``: :func:`_make_safe` resolves and checks the
optimizer and the settings (nothing changes if one is refused), attaches the
:class:`~safevars.optimizer.runtime._Runtime`, and sets ``opt.__class__`` to
``SafeOptimizer[type(opt)]`` (a subclass of both, made once per optimizer class by
:func:`_safe_class` and registered for saving). The same object is returned.
"""

from __future__ import annotations

import inspect
import threading
from typing import TYPE_CHECKING, Any

import keras

from safevars._validation import short
from safevars.errors import InvalidArgumentError
from safevars.optimizer.runtime import _Runtime
from safevars.optimizer.serialization import MODULE, register
from safevars.optimizer.validation import check_settings

if TYPE_CHECKING:
    from safevars.optimizer.safe_optimizer import SafeOptimizer


class _SafeOptimizerType(type):
    """Metaclass: ``SafeOptimizer(opt, ...)`` makes ``opt`` safe and returns it.

    Calling a class made for one optimizer class (``type(opt)(...)``) constructs that
    optimizer from the arguments and makes it safe with the default settings.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        base = cls.__dict__.get("_safevars_base")
        if base is None:
            return _make_safe(*args, **kwargs)
        from safevars.optimizer.safe_optimizer import SafeOptimizer

        made = base(*args, **kwargs)
        return made if isinstance(made, SafeOptimizer) else _make_safe(made)


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _safe_class(base: type) -> type:
    """``SafeOptimizer[base]``: made once per optimizer class, registered for saving."""
    from safevars.optimizer.safe_optimizer import SafeOptimizer

    with _CLASSES_LOCK:
        made = _CLASSES.get(base)
        if made is None:
            namespace = {
                "__module__": MODULE,
                "__qualname__": f"SafeOptimizer[{base.__qualname__}]",
                "__doc__": f"{base.__name__}, made safe by safevars.SafeOptimizer.",
                "_safevars_base": base,
            }
            try:
                namespace["__signature__"] = inspect.signature(base)
            except (TypeError, ValueError):
                pass
            meta: type = _SafeOptimizerType
            if not issubclass(meta, type(base)):  # the optimizer class has a metaclass
                meta = type(
                    f"SafeOptimizerType[{type(base).__name__}]",
                    (_SafeOptimizerType, type(base)),
                    {},
                )
            made = meta(base.__name__, (SafeOptimizer, base), namespace)
            # Serialized under SafeOptimizer's registered name, which stays SafeOptimizer's.
            register(made)
            register(SafeOptimizer)
            _CLASSES[base] = made
        return made


def _resolve(optimizer: Any) -> keras.optimizers.Optimizer:
    from safevars.optimizer.safe_optimizer import SafeOptimizer

    if isinstance(optimizer, (str, dict)):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as e:
            raise InvalidArgumentError(
                f"optimizer={short(optimizer)} is not a Keras optimizer identifier ({e})."
            ) from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"optimizer must be a keras.optimizers.Optimizer (for example "
            f"keras.optimizers.Adam()), got {short(optimizer)}."
        )
    if isinstance(optimizer, SafeOptimizer):
        raise InvalidArgumentError(
            f"optimizer {optimizer.name!r} is already safe (SafeOptimizer returns the "
            "optimizer it makes safe); use it as it is."
        )
    return optimizer


def _make_safe(
    optimizer: keras.optimizers.Optimizer | str,
    *,
    accumulate_steps: int = 1,
    max_staleness: int | None = None,
    on_stale: str = "drop",
    nonfinite: str | None = None,
    deterministic: bool = True,
    lock_span: str = "step",
    name: str | None = None,
    **kwargs: Any,
) -> SafeOptimizer:
    """Implements ``SafeOptimizer(...)``: checks everything, then changes the class."""
    optimizer = _resolve(optimizer)
    settings = check_settings(
        accumulate_steps, max_staleness, on_stale, nonfinite, deterministic, kwargs, lock_span
    )
    if settings["accumulate_steps"] > 1 and optimizer.gradient_accumulation_steps:
        raise InvalidArgumentError(
            f"accumulate_steps={accumulate_steps} and the optimizer's "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} would "
            "accumulate twice: use accumulate_steps (exact, order-independent, kept in "
            "safevars_state) or gradient_accumulation_steps (Keras' running sum, kept in "
            "the optimizer's variables), not both."
        )
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"name must be a str or None, got {short(name)}.")
    cls = _safe_class(type(optimizer))
    runtime = _Runtime(settings, name or optimizer.name)
    object.__setattr__(optimizer, "_safevars", runtime)
    try:
        optimizer.__class__ = cls
    except TypeError as e:
        object.__delattr__(optimizer, "_safevars")
        raise InvalidArgumentError(
            f"{type(optimizer).__name__} cannot be made safe: its instances have a memory "
            f"layout of their own ({e}). Define it without __slots__."
        ) from None
    if name is not None:
        optimizer.name = name
    return optimizer
