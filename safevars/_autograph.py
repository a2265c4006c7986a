"""Keeps AutoGraph from rewriting safevars' own code when it is called in a tf.function.

AutoGraph converts every function a ``tf.function`` calls unless its module is on the
do-not-convert list, the way ``tensorflow`` itself is. safevars' internals are plain
graph-building code (closures, ``nonlocal`` bookkeeping) that conversion only breaks, so
the package adds itself to that list once, at import. User callables passed to
``update`` or ``transaction`` are traced as written, like ``tf.CriticalSection.execute``
traces its ``fn``: use ``tf.cond``/``tf.where`` there rather than Python ``if`` on tensors.
"""

from __future__ import annotations

from safevars._tf_internal import autograph_config

# Private TensorFlow module; if it moves, conversion is merely slower, not wrong.
_config = autograph_config()


def register() -> None:
    """Adds ``safevars`` to AutoGraph's do-not-convert rules (idempotent)."""
    if _config is None or not hasattr(_config, "CONVERSION_RULES"):
        return
    rule = _config.DoNotConvert("safevars")
    if not any(getattr(r, "_prefix", None) == "safevars" for r in _config.CONVERSION_RULES):
        _config.CONVERSION_RULES = (rule,) + tuple(_config.CONVERSION_RULES)


register()
