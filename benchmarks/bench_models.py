"""Family 17: Keras' own architectures in ``safevars.scope()`` against the same plain.

Each case builds one ``keras.applications`` architecture twice from the same seed
(``weights=None``, 32x32 inputs, 10 classes, batch 8, Adam): plain (the baseline) and
inside ``safevars.scope()`` (every variable of the model and its optimizer under one
lock; the step one critical section). Workloads:

* ``fit``: one ``model.train_on_batch`` (Keras' compiled train step, the step the scope
  makes one section from the forward pass to the metrics);
* ``custom``: one traced step of one's own (``GradientTape``, then the optimizer's
  ``apply``: the section spans the step from the forward pass's reads of the weights).

Goal (issue 46): each at most 1.05x the plain step. The architectures: MobileNetV2
(depthwise convolutions, BatchNormalization, ReLU6, residual adds) and EfficientNetB0
(swish, squeeze-excitation, the input's rescaling and normalization) for ``fit`` and
``custom``, ResNet50 for ``fit``; ``--quick`` keeps MobileNetV2's ``fit``. A model is
built and traced once per variant (several seconds each): a pass of the family takes 3 to 4
minutes (3 min 5 s alone on 2026-11-30) and its process keeps the memory of every model
it traced (3.4 GB peak; with ``--repeat`` each pass has a process of its own: 3.4 GB
for ``--repeat 2``, where three passes in one process reached 7.8 GB), so it runs only
when named (``--cases models``; ``DEFAULT = False``): one MobileNetV2 would take the whole budget of the ``--quick``
suite (45 s). The scope also trains these models bitwise as without safevars
(``tests/conformance/test_bitwise_models.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import safevars
from benchmarks.case import Case, Context
from benchmarks.tf_functions import variant_function

FAMILY = "models"
DESCRIPTION = (
    "keras.applications models (MobileNetV2, EfficientNetB0, ResNet50) at 32x32: a fit "
    "step and a custom traced step, built in safevars.scope() vs plain"
)
ORDER = 17
DEFAULT = False  # building and tracing these models takes tens of seconds: --cases models
# Measured 2026-11-29 on a quiet 2-core CPU: 12 min 44 s for --repeat 3 (about 250 s a
# pass, nearly all of it building and tracing); --quick keeps MobileNetV2's fit (35 s).
SECONDS = {"full": 250, "quick": 35}
ISOLATED = True  # its traced models' memory stays with the process (see the guide)

SIZE = 32
CLASSES = 10
BATCH = 8
GOAL = 1.05
WORKLOADS = (
    ("MobileNetV2", "fit"),
    ("MobileNetV2", "custom"),
    ("EfficientNetB0", "fit"),
    ("EfficientNetB0", "custom"),
    ("ResNet50", "fit"),
)
QUICK = (("MobileNetV2", "fit"),)
PLAIN, SCOPED = "plain", "safevars.scope()"


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 255.0, size=(BATCH, SIZE, SIZE, 3)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(BATCH, 1))


def _built(architecture: str, scoped: bool) -> tuple[keras.Model, Any]:
    keras.utils.set_random_seed(0)
    with safevars.scope() if scoped else contextlib.nullcontext():
        model = getattr(keras.applications, architecture)(
            weights=None, input_shape=(SIZE, SIZE, 3), classes=CLASSES
        )
        optimizer = keras.optimizers.Adam(1e-3)
    return model, optimizer


def _fit(architecture: str, scoped: bool) -> Callable[[], Any]:
    model, optimizer = _built(architecture, scoped)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    x, y = _data()

    def call() -> None:
        model.train_on_batch(x, y)

    return call


def _custom(architecture: str, scoped: bool) -> Callable[[], Any]:
    model, optimizer = _built(architecture, scoped)
    optimizer.build(model.trainable_variables)
    x, y = (tf.constant(a) for a in _data())
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @variant_function(autograph=False)
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    def call() -> None:
        step().numpy()  # wait for the step

    return call


def cases(ctx: Context) -> list[Case]:
    out = []
    for architecture, workload in QUICK if ctx.quick else WORKLOADS:
        make = _fit if workload == "fit" else _custom
        with tf.device(ctx.device):
            variants = {PLAIN: make(architecture, False), SCOPED: make(architecture, True)}
        out.append(
            Case(
                family=FAMILY,
                name=f"{workload}/{architecture}",
                variants=variants,
                params={
                    "architecture": architecture,
                    "workload": workload,
                    "input": f"{SIZE}x{SIZE}x3",
                    "batch": BATCH,
                },
                goal=(SCOPED, GOAL),
            )
        )
    return out
