"""One ``tf.function`` per variant, which TensorFlow's retracing warning tells apart.

TensorFlow warns "5 out of the last N calls to <function> triggered tf.function
retracing" when five traces fall within ten calls of functions that share one *Python
code object*: its detector (``_FrequentTracingDetectorManager`` in TensorFlow's
``polymorphic_function.py``) keys every ``tf.function`` by the ``__code__`` of the
function it wraps, after unwrapping ``__wrapped__`` and ``__func__``, not by the
``tf.function`` object. A family that builds one ``tf.function`` per variant (or per
pipeline instance) from one ``def``, a closure over that variant's model, variables or
iterator, traces each of them once, yet the detector counts every first trace against
the shared code: the ``data`` family's eight single-element readers and the
``accumulator`` family's eight ``last_micro_step`` functions printed that warning in the
middle of a progress line (issue 38), about functions that never retraced.

:func:`variant_function` wraps the function in a :func:`functools.partial` before
handing it to ``tf.function``: a partial has no ``__code__``, so the detector keys it by
the partial itself, one per ``tf.function``. A real retrace (one of those functions
traced again, for new shapes or Python arguments) still warns.

TensorFlow is imported at the first call, so that importing this module (and the CLI's
``--list``) stays free of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["critical_section_step", "training_step", "variant_function"]


def variant_function(python_function: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``tf.function(python_function, **options)``, keyed by itself for retracing warnings.

    Use it as ``tf.function`` is used, as a call or a decorator (``@variant_function(
    autograph=False)``), for a function built once per variant or instance.
    """
    if python_function is None:
        return functools.partial(variant_function, **options)
    import tensorflow as tf

    return tf.function(functools.partial(python_function), **options)


def training_step(model: Any, optimizer: Any, x: Any, y: Any, jit_compile: bool = False) -> Any:
    """A traced training step of ``model`` on one batch: the mean squared error of
    ``model(x)`` against ``y``, its gradients, ``optimizer.apply_gradients``; returns the
    loss. Built by :func:`variant_function` (one function per variant)."""
    import tensorflow as tf

    @variant_function(autograph=False, jit_compile=jit_compile)
    def step() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


def critical_section_step(model: Any, optimizer: Any, x: Any, y: Any, span: str = "step") -> Any:
    """:func:`training_step` with its update (``span="update"``) or the whole step
    (``"step"``) run by ``tf.CriticalSection.execute``: TensorFlow's own graph lock,
    without safevars, the reference for what any lock taken in a graph costs.

    ``execute`` releases the mutex once what its function returns is computed, and
    nothing else: the loss it returns here waits for every op the update made. Returning
    the loss alone let the writes run after the release (the ``threads`` family's
    reference lost updates that way, 2026-11-29)."""
    import tensorflow as tf

    section = tf.CriticalSection()

    def forward_backward() -> tuple[Any, list[Any]]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    def update(loss: Any, grads: list[Any]) -> Any:
        graph = tf.compat.v1.get_default_graph()
        before = set(graph.get_operations())
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        made = [op for op in graph.get_operations() if op not in before]
        with tf.control_dependencies(made):
            return tf.identity(loss)

    @variant_function(autograph=False)
    def step() -> Any:
        if span == "step":
            return section.execute(
                lambda: update(*forward_backward()), exclusive_resource_access=False
            )
        loss, grads = forward_backward()
        return section.execute(lambda: update(loss, grads), exclusive_resource_access=False)

    return step
