"""How a SafeOptimizer is saved and loaded: names, config, pickling.

The names below are written into every Keras config, ``.keras`` file and pickle of a
safe optimizer; files written by earlier versions load only while they stay the same:

* registered name ``"safevars>SafeOptimizer"`` (:data:`register`), shared by
  :class:`~safevars.SafeOptimizer` and every class made for an optimizer class
  (``SafeOptimizer[Adam]``...), so ``keras.models.load_model`` finds it;
* module ``"safevars.optimizer"`` (:data:`MODULE`): the ``__module__`` of those classes;
* the config: the optimizer's own, plus a ``"safevars"`` entry (the class of the inner
  optimizer as Keras names it, and the settings).

``tf.train.Checkpoint`` s need no name here: a safe optimizer's checkpoint
dependencies are those of the plain one (see ``runtime.SafevarsState``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import keras

from safevars._tf_internal import keras_internal
from safevars.errors import InvalidArgumentError
from safevars.locking.saved_model import saved_guards
from safevars.optimizer.runtime import OptimizerPart

MODULE = "safevars.optimizer"
"""The ``__module__`` of SafeOptimizer and of the classes made from it (configs, pickles)."""

register = keras.saving.register_keras_serializable(package="safevars", name="SafeOptimizer")
"""Registers a class under ``"safevars>SafeOptimizer"``, the name configs are saved under."""


def class_identity(cls: type) -> dict[str, Any]:
    """How Keras names ``cls`` in a serialized config: module, class_name, registered_name.

    The same fields ``keras.saving.serialize_keras_object`` writes for an instance of
    ``cls`` (the public ``keras.optimizers.X`` name for Keras' own classes, the
    registered name for registered ones), so ``deserialize_keras_object`` finds it.
    """
    public = keras_internal("saving.serialization_lib").serialize_with_public_class(cls)
    if public is not None:
        return {key: public[key] for key in ("module", "class_name", "registered_name")}
    return {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "registered_name": keras.saving.get_registered_name(cls),
    }


class SerializationPart(OptimizerPart):
    """SafeOptimizer's part for Keras configs, pickling and SavedModels.

    ``_safevars_root`` is ``SafeOptimizer`` itself (set by the root-class hook,
    ``class_switch.register_root``): this module is below ``safe_optimizer.py``.
    """

    _safevars_root: ClassVar[type[Any]]

    def _trackable_children(self, save_type: str = "checkpoint", **kwargs: Any) -> dict:
        """For ``tf.saved_model.save`` also what its traced updates capture: the
        bookkeeping (:attr:`safevars_state`) and the versions and locks of every
        variable it updates (:func:`safevars.locking.saved_model.saved_guards`).
        Checkpoints keep the plain optimizer's dependencies."""
        children = dict(super()._trackable_children(save_type, **kwargs))
        runtime = getattr(self, "_safevars", None)  # None while Keras' __init__ runs
        if save_type == "savedmodel" and runtime is not None and runtime.ready:
            state = saved_guards([*runtime.guards, runtime.state_guard, *runtime.fixed_guards])
            state.bookkeeping = runtime.state
            children["safevars"] = state
        return children

    def get_config(self) -> dict[str, Any]:
        """The optimizer's own config, plus a ``"safevars"`` entry: class and settings."""
        config = super().get_config()
        runtime = self._safevars
        config["safevars"] = {
            "optimizer": class_identity(self._safevars_base),
            "accumulate_steps": runtime.accumulate_steps,
            "max_staleness": runtime.max_staleness,
            "on_stale": runtime.on_stale,
            "nonfinite": runtime.nonfinite,
            "deterministic": runtime.deterministic,
            "lock_span": runtime.lock_span,
        }
        return config

    @classmethod
    def from_config(
        cls, config: dict[str, Any], custom_objects: dict[str, Any] | None = None
    ) -> Any:
        """Rebuilds a safe optimizer from :meth:`get_config`.

        Also takes the config of safevars 0.1 (``{"optimizer": ..., settings}``) and, on
        a class made for one optimizer class, that optimizer's plain config.
        """
        root = cls._safevars_root  # SafeOptimizer
        config = dict(config)
        settings = config.pop("safevars", None)
        if settings is None:
            legacy = config.get("optimizer")
            if isinstance(legacy, dict) and "class_name" in legacy:
                inner = keras.saving.deserialize_keras_object(
                    config.pop("optimizer"), custom_objects=custom_objects
                )
                config.pop("name", None)
                return root(inner, **config)
            base = cls.__dict__.get("_safevars_base")
            if base is None:
                raise InvalidArgumentError(
                    "SafeOptimizer.from_config needs a config from SafeOptimizer."
                    f"get_config() (with a 'safevars' entry); got keys {sorted(config)}."
                )
            return root(base.from_config(config, custom_objects=custom_objects))
        settings = dict(settings)
        identity = settings.pop("optimizer")
        inner = keras.saving.deserialize_keras_object(
            {**identity, "config": config}, custom_objects=custom_objects
        )
        return root(inner, **settings)

    def __reduce__(self) -> Any:
        # Keras pickles through its saving format; the class made for this optimizer's
        # class has no importable name, so unpickle through SafeOptimizer.
        reduced = super().__reduce__()
        return (self._safevars_root._unpickle_model, reduced[1])
