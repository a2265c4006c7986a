"""A model in ``safevars.scope()`` computes bit for bit what it computes without safevars.

Each architecture is trained twice from the same seed, on the same batch, with Adam and
``tf.config.experimental.enable_op_determinism()`` (not under XLA, which Keras declines
with it; XLA on the CPU is deterministic anyway): once plain, once built in the scope,
and every weight (and each step's loss) must be equal bitwise after a few steps, for
Keras' ``fit`` step (``train_on_batch``: the whole step is one section), a custom traced
step (``GradientTape`` then ``apply``: the section spans the step from the forward
pass's reads), and ``jit_compile=True`` (the compiled call runs under the lock).

The architectures are the blocks of ``keras.applications``' models at one or two blocks
and 16x16 inputs, so that each costs seconds: MobileNetV2's inverted residual block
(convolutions, depthwise convolutions, BatchNormalization, ReLU6, a residual add),
EfficientNet's MBConv block (swish, squeeze-excitation, the input rescaling and
normalization), ResNet's bottleneck block, DenseNet's dense and transition blocks, and a
transformer block (``MultiHeadAttention``, ``LayerNormalization``, a GELU MLP). What
failed before issue 46: the section's control edges changed what
Grappler rewrites, so MobileNetV2 and EfficientNet trained to other bits
(:mod:`safevars.sections.gate`, ``narrow`` and ``stateful``).
``SAFEVARS_BITWISE=full`` also runs Keras' own MobileNetV2, EfficientNetB0, ResNet50 and
DenseNet121 (``weights=None``, 32x32) and keras-hub's BERT, GPT-2 and ViT from tiny
configurations (minutes).

By default ``jit_compile=True`` runs for the transformer block only (XLA compiles no
section op, the compiled call runs under the lock, and compiling costs seconds). The
keras-hub part needs keras-hub (not a test dependency): it is skipped, saying so, when
it is not installed; its default run takes one model (BERT, ``fit`` and the custom step).

``test_grappler_keeps_the_fused_ops_of_the_plain_step``: the graph TensorFlow runs after
Grappler (``RunMetadata``'s post-optimization graph) of a protected step holds the same
ops as the plain one's, fused kernels included, besides the section's own
(:data:`SECTION_OPS`).
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers
from tensorflow.python.eager import context
from tensorflow.python.framework import config as tf_config

import safevars

FULL = os.environ.get("SAFEVARS_BITWISE", "default") == "full"
BATCH = 8
STEPS = 2
SIZE = 16
CLASSES = 4
HOWS = ("fit", "custom", "jit")

# Ops a protected step has besides the plain step's (after Grappler): the lock and its
# release, the gate, the version adds, the constants they add, the captured handles of
# the mutex, the gate and the version variables, and the identities of the results.
SECTION_OPS = frozenset(
    ("MutexLock", "ConsumeMutexLock", "VarIsInitializedOp", "AssignAddVariableOp", "Const")
)
CAPTURES = frozenset(("_Arg", "Placeholder", "NoOp", "Identity"))


# ------------------------------------------------------------------- the architectures


def _conv_bn(x: Any, filters: int, kernel: int = 1, strides: int = 1, act: Any = None) -> Any:
    x = layers.Conv2D(filters, kernel, strides=strides, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x)
    return layers.Activation(act)(x) if act is not None else x


def mobilenet_v2(inputs: Any) -> Any:
    """MobileNetV2's stem and two inverted residual blocks (the second with a residual)."""
    x = layers.ZeroPadding2D(((0, 1), (0, 1)))(inputs)
    x = layers.Conv2D(8, 3, strides=2, padding="valid", use_bias=False)(x)
    x = layers.ReLU(6.0)(layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(x))
    for residual in (False, True):
        shortcut = x
        y = layers.ReLU(6.0)(_conv_bn(x, 8 * 6))
        y = layers.DepthwiseConv2D(3, padding="same", use_bias=False)(y)
        y = layers.ReLU(6.0)(layers.BatchNormalization(epsilon=1e-3, momentum=0.999)(y))
        y = _conv_bn(y, 8)
        x = layers.Add()([shortcut, y]) if residual else y
    return layers.GlobalAveragePooling2D()(x)


def efficientnet(inputs: Any) -> Any:
    """EfficientNet's input rescaling and normalization, stem and one MBConv block with
    squeeze-excitation and its residual."""
    x = layers.Rescaling(1.0 / 255.0)(inputs)
    x = layers.Normalization(mean=[0.485, 0.456, 0.406], variance=[0.052, 0.050, 0.051])(x)
    x = _conv_bn(x, 8, 3, strides=2, act="swish")
    shortcut = x
    y = _conv_bn(x, 8 * 6, act="swish")
    y = layers.DepthwiseConv2D(3, padding="same", use_bias=False)(y)
    y = layers.Activation("swish")(layers.BatchNormalization()(y))
    se = layers.GlobalAveragePooling2D(keepdims=True)(y)
    se = layers.Conv2D(2, 1, activation="swish")(se)
    se = layers.Conv2D(8 * 6, 1, activation="sigmoid")(se)
    y = layers.Multiply()([y, se])
    y = _conv_bn(y, 8)
    x = layers.Add()([layers.Dropout(0.2, noise_shape=(None, 1, 1, 1), seed=1)(y), shortcut])
    return layers.GlobalAveragePooling2D()(x)


def resnet(inputs: Any) -> Any:
    """ResNet50's stem and one bottleneck block with a projection shortcut."""
    x = layers.ZeroPadding2D(3)(inputs)
    x = layers.Conv2D(8, 7, strides=2)(x)
    x = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(x))
    x = layers.MaxPooling2D(3, strides=2, padding="same")(layers.ZeroPadding2D(1)(x))
    shortcut = layers.BatchNormalization(epsilon=1.001e-5)(layers.Conv2D(16, 1)(x))
    y = layers.Activation("relu")(
        layers.BatchNormalization(epsilon=1.001e-5)(layers.Conv2D(4, 1)(x))
    )
    y = layers.Conv2D(4, 3, padding="same")(y)
    y = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(y))
    y = layers.BatchNormalization(epsilon=1.001e-5)(layers.Conv2D(16, 1)(y))
    x = layers.Activation("relu")(layers.Add()([shortcut, y]))
    return layers.GlobalAveragePooling2D()(x)


def densenet(inputs: Any) -> Any:
    """DenseNet's stem, a dense block of two conv blocks and a transition block."""
    x = layers.Conv2D(8, 3, strides=2, padding="same", use_bias=False)(inputs)
    x = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(x))
    for _ in range(2):
        y = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(x))
        y = layers.Conv2D(16, 1, use_bias=False)(y)
        y = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(y))
        y = layers.Conv2D(4, 3, padding="same", use_bias=False)(y)
        x = layers.Concatenate()([x, y])
    x = layers.Activation("relu")(layers.BatchNormalization(epsilon=1.001e-5)(x))
    x = layers.AveragePooling2D(2, strides=2)(layers.Conv2D(8, 1, use_bias=False)(x))
    return layers.GlobalAveragePooling2D()(x)


def transformer(inputs: Any) -> Any:
    """A transformer encoder block over the image's rows (ViT-style, post-norm)."""
    x = layers.Dense(16)(layers.Reshape((SIZE, SIZE * 3))(inputs))
    x = layers.LayerNormalization()(x + layers.MultiHeadAttention(2, 8)(x, x))
    y = layers.Dense(16)(layers.Dense(32, activation="gelu")(x))
    x = layers.LayerNormalization()(x + y)
    return layers.GlobalAveragePooling1D()(x)


ARCHITECTURES: dict[str, Callable[[Any], Any]] = {
    "mobilenet_v2": mobilenet_v2,
    "efficientnet": efficientnet,
    "resnet": resnet,
    "densenet": densenet,
    "transformer": transformer,
}
APPLICATIONS = ("MobileNetV2", "EfficientNetB0", "ResNet50", "DenseNet121")


def _block_model(name: str) -> keras.Model:
    inputs = keras.Input((SIZE, SIZE, 3))
    features = ARCHITECTURES[name](inputs)
    return keras.Model(inputs, layers.Dense(CLASSES)(features))


def _application(name: str) -> keras.Model:
    build = getattr(keras.applications, name)
    return build(
        weights=None, input_shape=(32, 32, 3), classes=CLASSES, classifier_activation=None
    )


def _data(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 255.0, size=(BATCH, *shape)).astype("float32")
    return x, rng.integers(0, CLASSES, size=(BATCH,))


# ----------------------------------------------------------------------- the training


@contextlib.contextmanager
def _determinism(on: bool) -> Iterator[None]:
    """Op determinism ``on`` (or off) while in the block, then back as it was."""
    was = tf_config.is_op_determinism_enabled()
    if on:
        tf.config.experimental.enable_op_determinism()
    else:
        tf_config.disable_op_determinism()
    try:
        yield
    finally:
        if was:
            tf.config.experimental.enable_op_determinism()
        else:
            tf_config.disable_op_determinism()


def _loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(build: Callable[[], keras.Model], how: str, scoped: bool, x: Any, y: Any) -> Any:
    """``STEPS`` steps of a model ``build()`` makes (in the scope if ``scoped``): the
    losses and the weights after them."""
    keras.utils.set_random_seed(0)
    with safevars.scope() if scoped else contextlib.nullcontext():
        model = build()
        optimizer = keras.optimizers.Adam(1e-2)
    if how in ("fit", "jit"):
        model.compile(optimizer=optimizer, loss=_loss(), jit_compile=how == "jit")
        assert model.jit_compile == (how == "jit")  # Keras may decline XLA, and say so
        losses = [model.train_on_batch(x, y) for _ in range(STEPS)]
    else:
        loss_fn = _loss()
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)
            return loss

        losses = [float(step(x, y)) for _ in range(STEPS)]
    return losses, [w.numpy() for w in model.weights]


def assert_bitwise(build: Callable[[], keras.Model], how: str, x: Any, y: Any) -> None:
    """Plain and scoped training of ``build()`` give the same bits. Op determinism is on,
    except under XLA: Keras declines ``jit_compile=True`` when it is on, and an XLA
    computation on the CPU is deterministic by itself."""
    with _determinism(how != "jit"):
        plain_losses, plain = train(build, how, False, x, y)
        losses, weights = train(build, how, True, x, y)
    differ = [i for i, (a, b) in enumerate(zip(plain, weights)) if a.tobytes() != b.tobytes()]
    worst = max((float(np.max(np.abs(plain[i] - weights[i]))) for i in differ), default=0.0)
    assert not differ and losses == plain_losses, (
        f"{len(differ)} of {len(plain)} weights differ (by up to {worst:.3g}); losses "
        f"{losses} in the scope, {plain_losses} plain"
    )


# XLA compiles no section op (the compiled call runs under the lock), and compiling costs
# seconds: by default one architecture runs with jit_compile=True, all of them when full.
BLOCK_CASES = [
    (name, how)
    for name in ARCHITECTURES
    for how in HOWS
    if FULL or how != "jit" or name == "transformer"
]


@pytest.mark.parametrize(("name", "how"), BLOCK_CASES)
def test_a_model_in_the_scope_trains_bitwise_as_without(name, how):
    x, y = _data((SIZE, SIZE, 3))
    assert_bitwise(lambda: _block_model(name), how, x, y)


@pytest.mark.skipif(not FULL, reason="Keras' applications take minutes: SAFEVARS_BITWISE=full")
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", APPLICATIONS)
def test_keras_applications_train_bitwise_in_the_scope(name, how):
    x, y = _data((32, 32, 3))
    assert_bitwise(lambda: _application(name), how, x, y)


# --------------------------------------------------------------------------- keras-hub

HUB_CASES = [
    (name, how)
    for name in ("bert", "gpt2", "vit")
    for how in HOWS
    if FULL or (name == "bert" and how != "jit")
]


def _hub_model(hub: Any, name: str) -> keras.Model:
    tiny = {"num_layers": 2, "num_heads": 2, "hidden_dim": 64}
    text = {"vocabulary_size": 100, "intermediate_dim": 128, "max_sequence_length": 16}
    if name == "bert":
        backbone = hub.models.BertBackbone(**tiny, **text, dropout=0.0)
        return hub.models.BertTextClassifier(
            backbone, num_classes=CLASSES, preprocessor=None, dropout=0.0
        )
    if name == "gpt2":
        backbone = hub.models.GPT2Backbone(**tiny, **text, dropout=0.0)
        return hub.models.GPT2CausalLM(backbone, preprocessor=None)
    backbone = hub.models.ViTBackbone(
        image_shape=(SIZE, SIZE, 3), patch_size=4, mlp_dim=128, **tiny
    )
    return hub.models.ViTImageClassifier(backbone, num_classes=CLASSES, preprocessor=None)


def _hub_data(name: str) -> tuple[Any, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 100, size=(BATCH, 16)).astype("int32")
    mask = np.ones((BATCH, 16), "int32")
    if name == "bert":
        x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": mask}
        return x, rng.integers(0, CLASSES, size=(BATCH,))
    if name == "gpt2":
        return {"token_ids": tokens, "padding_mask": mask}, np.roll(tokens, -1, axis=1)
    return _data((SIZE, SIZE, 3))


@pytest.mark.parametrize(("name", "how"), HUB_CASES)
def test_keras_hub_models_train_bitwise_in_the_scope(name, how):
    if importlib.util.find_spec("keras_hub") is None:
        pytest.skip("keras-hub is not installed (pip install --no-deps keras-hub)")
    import keras_hub

    x, y = _hub_data(name)
    assert_bitwise(lambda: _hub_model(keras_hub, name), how, x, y)


# ----------------------------------------------------------------- the rewritten graph


def _optimized_ops(build: Callable[[], keras.Model], scoped: bool, x: Any, y: Any) -> Any:
    """The op types of the graph TensorFlow runs for a ``fit`` step, after Grappler."""
    keras.utils.set_random_seed(0)
    with safevars.scope() if scoped else contextlib.nullcontext():
        model = build()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=_loss())
    eager = context.context()
    eager.enable_run_metadata()
    try:
        model.train_on_batch(x, y)
        metadata = eager.export_run_metadata()
    finally:
        eager.disable_run_metadata()
    graphs = [f.post_optimization_graph for f in metadata.function_graphs]
    step = max(graphs, key=lambda g: len(g.node))
    return collections.Counter(node.op for node in step.node)


@pytest.mark.parametrize("name", ["efficientnet", "mobilenet_v2"] if FULL else ["efficientnet"])
def test_grappler_keeps_the_fused_ops_of_the_plain_step(name):
    x, y = _data((SIZE, SIZE, 3))
    plain = _optimized_ops(lambda: _block_model(name), False, x, y)
    protected = _optimized_ops(lambda: _block_model(name), True, x, y)
    assert any(op.startswith("_Fused") or op.startswith("_Mkl") for op in plain)
    added = {op: protected[op] - plain[op] for op in protected if protected[op] > plain[op]}
    lost = {op: plain[op] - protected[op] for op in plain if plain[op] > protected[op]}
    assert not lost and set(added) <= SECTION_OPS | CAPTURES, (added, lost)
