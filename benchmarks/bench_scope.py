"""Family 10: a whole model protected by ``safevars.scope()`` against the same model plain.

Every case builds a ``keras.Sequential`` of ``Dense(16)`` layers (2 variables each) on 16
features, batch 64, trained with Adam, at about 20, 200 and 400 variables; the baseline
variant is the same model and optimizer built without safevars, the other is the model
built inside ``safevars.scope()`` (every variable of the block under one lock). Goals
(issue 35): each training at most 1.05x the baseline, whatever the size, and:

* ``custom_step``: a ``tf.function`` training step (forward, backward,
  ``apply_gradients``), ``SafeOptimizer(Adam)`` on the scope's model;
* ``fit_safe``: ``model.fit`` epochs of 16 steps, compiled with ``SafeOptimizer(Adam)``;
* ``fit_plain_inside`` and ``fit_plain_outside``: ``model.fit`` epochs with a plain
  ``Adam``, the model compiled inside the scope (the loss tracker is then the scope's
  too) or outside it;
* ``xla_step``: ``custom_step`` compiled with XLA (``jit_compile=True``) on both sides;
* ``snapshot``: ``safevars.snapshot(model)`` of the trained scope model (its lock in
  run-time mode) with no writer running, against ``read every weight``
  (``tf.convert_to_tensor`` of each weight: the cheapest plain read of its value; goal:
  at most 1.5x). The baseline shown is ``[w.value for w in model.weights]``, the
  expression issue 35 wrote for "reading every weight plainly": it reads nothing (a
  Keras weight's ``value`` is its ``tf.Variable``, returned unread), so the goal is taken
  against the reads, and that expression is reported beside them as what attribute
  lookups alone cost;
* ``snapshot_while_training``: the same snapshot while another thread trains the model
  without pause, against ``safevars.locked(model)`` plus a read of every weight, the way
  to get the same consistency by hand (goal: never slower, at most 1.0x).

``PLOT_AGAINST = "variables"``: the run also draws ``scope_vs_variables.png``, each
case's ratio against the number of variables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import safevars
from benchmarks.background import Background
from benchmarks.case import Case, Context
from benchmarks.tf_functions import variant_function

FAMILY = "scope"
DESCRIPTION = (
    "a model built in safevars.scope() at 20/200/400 variables: custom, fit (safe and "
    "plain Adam) and XLA steps, snapshot(model), against the same model without safevars"
)
ORDER = 10
PLOT_AGAINST = "variables"

FEATURES = 16
BATCH = 64
FIT_STEPS = 16
GOAL = 1.05
SNAPSHOT_GOAL = 1.5
LAYERS = (10, 100, 200)  # 20, 200 and 400 variables
QUICK_LAYERS = (2, 20)


def _model(layers: int) -> keras.Model:
    keras.utils.set_random_seed(layers)
    stack: list[Any] = [keras.Input((FEATURES,))]
    stack += [keras.layers.Dense(FEATURES, activation="tanh") for _ in range(layers)]
    return keras.Sequential(stack)


def _data(batches: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * batches, FEATURES)).astype("float32")
    return x, np.tanh(x[:, ::-1]).astype("float32")


def _built(
    layers: int, scoped: bool, safe: bool, compile_inside: bool = False
) -> tuple[keras.Model, Any]:
    """The model and its optimizer; ``compile_inside``: compiled in the same block."""
    if not scoped:
        return _model(layers), keras.optimizers.Adam(1e-3)
    with safevars.scope():
        model = _model(layers)
        optimizer = keras.optimizers.Adam(1e-3)
        if safe:
            optimizer = safevars.SafeOptimizer(optimizer)
        if compile_inside:
            model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model, optimizer


def _step(model: keras.Model, optimizer: Any, jit_compile: bool) -> Callable[[], None]:
    x, y = (tf.constant(a) for a in _data(1))
    optimizer.build(model.trainable_variables)

    @variant_function(autograph=False, jit_compile=jit_compile)
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def call() -> None:
        step().numpy()  # wait for the step

    return call


def _fit(model: keras.Model, optimizer: Any | None = None) -> Callable[[], None]:
    """``model.fit`` for one epoch; compiled here with ``optimizer`` unless it is None."""
    x, y = _data(FIT_STEPS)
    if optimizer is not None:
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)

    def call() -> None:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    return call


def _params(workload: str, layers: int, **extra: Any) -> dict[str, Any]:
    """A case's parameters: ``scope_vs_variables.png`` draws one curve per ``workload``
    (the parameters besides ``variables``)."""
    return {
        "workload": workload,
        "variables": 2 * layers,
        "units": FEATURES,
        "batch": BATCH,
        **extra,
    }


SAFE = "scope + SafeOptimizer(Adam)"


def _step_case(layers: int, workload: str, jit_compile: bool) -> Case:
    """A custom training step, plain Adam against the scope's model with SafeOptimizer."""
    plain, plain_opt = _built(layers, False, False)
    model, opt = _built(layers, True, True)
    extra = {"jit_compile": True} if jit_compile else {}
    return Case(
        family=FAMILY,
        name=f"{workload}/v{2 * layers}",
        variants={
            "Adam": _step(plain, plain_opt, jit_compile),
            SAFE: _step(model, opt, jit_compile),
        },
        params=_params(workload, layers, **extra),
        goal=(SAFE, GOAL),
    )


def _fit_case(layers: int, workload: str, safe: bool, inside: bool) -> Case:
    """``model.fit`` epochs, plain Adam against the scope's model (compiled inside the
    block with ``SafeOptimizer(Adam)`` or ``Adam``, or outside it with ``Adam``)."""
    plain, plain_opt = _built(layers, False, False)
    if inside:
        model, _ = _built(layers, True, safe, compile_inside=True)
        scoped = _fit(model)
    else:
        model, _ = _built(layers, True, False)
        scoped = _fit(model, keras.optimizers.Adam(1e-3))
    label = SAFE if safe else f"scope + Adam, compiled {'inside' if inside else 'outside'}"
    return Case(
        family=FAMILY,
        name=f"{workload}/v{2 * layers}",
        variants={"Adam": _fit(plain, plain_opt), label: scoped},
        ops_per_call=FIT_STEPS,
        params=_params(workload, layers, steps_per_epoch=FIT_STEPS),
        goal=(label, GOAL),
    )


def _training_cases(ctx: Context, layers: int) -> list[Case]:
    with tf.device(ctx.device):
        return [
            _step_case(layers, "custom_step", jit_compile=False),
            _fit_case(layers, "fit_safe", safe=True, inside=True),
            _fit_case(layers, "fit_plain_inside", safe=False, inside=True),
            _fit_case(layers, "fit_plain_outside", safe=False, inside=False),
            _step_case(layers, "xla_step", jit_compile=True),
        ]


def _snapshot_cases(ctx: Context, layers: int) -> list[Case]:
    n = 2 * layers
    with tf.device(ctx.device):
        model, opt = _built(layers, True, True)
        step = _step(model, opt, False)
    step()  # the lock in run-time mode, as after any traced training
    weights = model.weights

    def values() -> None:
        [w.value for w in weights]

    def reads() -> None:
        [tf.convert_to_tensor(w) for w in weights]

    def snapshot() -> None:
        safevars.snapshot(model)

    def locked_reads() -> None:
        with safevars.locked(model):
            [tf.convert_to_tensor(w) for w in weights]

    trainer = Background(step)  # a thread training the model without pause

    def while_training(read: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            trainer.ensure_running()
            read()

        return call

    return [
        Case(
            family=FAMILY,
            name=f"snapshot/v{n}",
            variants={
                "[w.value for w in model.weights]": values,
                "read every weight": reads,
                "safevars.snapshot(model)": snapshot,
            },
            params=_params("snapshot", layers),
            goal=("safevars.snapshot(model)", SNAPSHOT_GOAL),
            goal_reference="read every weight",
        ),
        Case(
            family=FAMILY,
            name=f"snapshot_while_training/v{n}",
            variants={
                "safevars.locked(model) + reads": while_training(locked_reads),
                "safevars.snapshot(model)": while_training(snapshot),
            },
            params=_params("snapshot_while_training", layers),
            goal=("safevars.snapshot(model)", 1.0),
            teardown=trainer.close,
        ),
    ]


def cases(ctx: Context) -> list[Case]:
    found: list[Case] = []
    for layers in QUICK_LAYERS if ctx.quick else LAYERS:
        found += _training_cases(ctx, layers)
        found += _snapshot_cases(ctx, layers)
    return found
