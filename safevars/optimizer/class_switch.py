"""``SafeOptimizer(opt, ...)``: checks everything, then gives ``opt`` a safe class.

``SafeOptimizer`` is called through its metaclass, :class:`_SafeOptimizerType`, which
does not construct a ``SafeOptimizer``: :func:`_make_safe` resolves and checks the
optimizer and the settings (nothing changes if one is refused), attaches the
:class:`~safevars.optimizer.runtime._Runtime`, and sets ``opt.__class__`` to
``SafeOptimizer[type(opt)]`` (a subclass of both, made once per optimizer class by
:func:`_safe_class` and registered for saving). The same object is returned.

``safe_optimizer.py`` is above this module: it registers ``SafeOptimizer`` here once the
class is defined (:func:`register_root`, the root-class hook), and a safe optimizer is
recognised by its metaclass.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from typing import Any

import keras

from safevars._validation import short
from safevars.creator_scope import traced_plainly
from safevars.errors import InvalidArgumentError
from safevars.optimizer.runtime import _Runtime
from safevars.optimizer.serialization import MODULE, register
from safevars.optimizer.validation import check_settings


class _SafeOptimizerType(type):
    """Metaclass: ``SafeOptimizer(opt, ...)`` makes ``opt`` safe and returns it.

    Calling a class made for one optimizer class (``type(opt)(...)``) constructs that
    optimizer from the arguments and makes it safe with the default settings.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        base = cls.__dict__.get("_safevars_base")
        if base is None:
            return _make_safe(*args, **kwargs)
        made = base(*args, **kwargs)
        return made if _is_safe(made) else _make_safe(made)


def _is_safe(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a SafeOptimizer: its class was made by the metaclass."""
    return isinstance(type(optimizer), _SafeOptimizerType)


# The root-class hook: SafeOptimizer, registered by safe_optimizer.py once it is defined
# (that module imports this one, so this one cannot import it).
_ROOT: list[type] = []


def register_root(cls: type) -> None:
    """Registers ``cls`` (``SafeOptimizer``) as the base of every class made here, and
    as ``cls._safevars_root``, where its subclasses' methods find it."""
    cls._safevars_root = cls  # type: ignore[attr-defined]
    _ROOT[:] = [cls]


_CLASSES: dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _safe_class(base: type) -> type:
    """``SafeOptimizer[base]``: made once per optimizer class, registered for saving."""
    (SafeOptimizer,) = _ROOT
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
    if _is_safe(optimizer):
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
) -> keras.optimizers.Optimizer:
    """Implements ``SafeOptimizer(...)``: checks everything, then changes the class.

    Returns the optimizer, now a ``SafeOptimizer`` (``SafeOptimizer.__signature__`` says
    so; this module cannot name the class).
    """
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
    if traced_plainly(optimizer):
        warnings.warn(
            f"Optimizer {optimizer.name!r} was made safe after a tf.function traced its "
            "plain update: that function keeps the plain update, unlocked and uncounted. "
            "model.fit traces its step again by itself; trace your own tf.functions "
            "again (make them anew) after SafeOptimizer(...), or make the optimizer safe "
            "before its first step.",
            UserWarning,
            stacklevel=3,
        )
    return optimizer
