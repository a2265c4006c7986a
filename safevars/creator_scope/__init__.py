"""``safevars.scope()``: every variable created inside is a SafeVariable, Keras' included.

The problem: real training code does not create its variables, Keras layers and
optimizers do. Wrapping each weight by hand misses the optimizer's slots, and writes that
Keras makes on the underlying ``tf.Variable`` (its optimizers update each replica's copy
of a mirrored variable through ``strategy.extended.update``) bypass a SafeVariable's lock
and version even when the weight itself is wrapped.

The fix:

* :func:`scope` is a variable-creator scope that wraps every ``tf.Variable`` created
  inside in a :class:`~safevars.SafeVariable`, and every variable of one block shares
  one lock (each keeps its own version). A ``keras.Variable`` keeps its value in such a
  ``tf.Variable``, so a model built inside has SafeVariable-backed weights:
  ``layer.kernel.assign``, ``model.set_weights``, ``model.load_weights`` and every write
  Keras makes go through the lock and count a version.
* A training step is one critical section that takes that lock once, however many
  variables the model has: a :class:`~safevars.SafeOptimizer` step; a plain Keras
  optimizer's step (``optimizer_steps.py``); ``model.fit``'s whole train step, from the
  forward pass to the metrics (``train_steps.py``). In a ``tf.function`` that is one
  ``MutexLock`` per step, and the versions of every weight and slot the step wrote are
  counted with one add. Forward-pass reads take no lock of their own.
* Optimizer slots made for safe weights are safe under the weights' lock, even when the
  optimizer is made outside the scope (``slots.py``); ``strategy.extended.update`` of a
  SafeVariable is one section counting one version however many replica copies it
  writes (``strategy_updates.py``); ``keras.Variable.assign_add``/``assign_sub`` become
  atomic updates, Keras variables checkpoint their versions, and a SavedModel of a
  function that writes them (``tf.saved_model.save``, ``model.export``, Keras'
  ``ExportArchive``) exports their locks too (``keras_variables.py``,
  :mod:`safevars.locking.saved_model`).

These are patches of TensorFlow's and Keras' classes (``patches.py``), installed with
``safevars``; they change nothing for variables that are not SafeVariables. A
SafeVariable made by hand (``safevars.SafeVariable`` or ``safevars.wrap``) benefits too:
a plain optimizer's update of it is locked and counted, and its slots are safe.

What a version counts: one per ``assign*``/``scatter_*``/``update`` through the variable,
one per optimizer step that wrote it (plain or safe; its slots likewise), one per
``strategy.extended.update`` of it outside such a step.

NOTES:
  What is *not* covered:

  * Variables created outside the scope by objects that were not made in it either (a
    plain ``keras.Variable``, a model built and trained entirely outside). Protect such
    a model with :func:`protect`; :func:`is_protected` and :func:`unprotected_variables`
    tell what is not protected. A Keras layer, optimizer or metric made inside a block
    is marked with it, so the variables Keras creates for it later, outside the block
    (a subclassed model's weights at its first call, slots at the first step, compiled
    metrics), join the block's lock (``marks.py``); a model trained inside a block is
    protected under it first (``protection.py``).
  * Writes made directly on a replica's copy of a mirrored variable
    (``v.values[0].assign(...)``) or through ``v.__wrapped__``.
  * One lock per block: threads writing different variables of one block take turns.
    Build independent models in blocks of their own.
  * In a custom training loop, a write traced before the optimizer's update (a metric
    of the scope, a ``BatchNormalization`` layer's moving statistics) is a section of
    its own, and the step's section then spans only the reads traced after it: the
    forward pass before it is not in the step's section. ``model.fit`` has no such gap
    (its whole train step is one section).
  * Under a strategy, a sync-on-read variable (Keras metrics) is written per replica:
    each replica's write of its own copy counts one version; ``model.fit``'s train step
    runs per replica there, and its optimizer's update is the one section.
  * A SavedModel loaded inside the scope (``tf.saved_model.load``, Keras'
    ``TFSMLayer``): the variables the loader recreates are SafeVariables, so writes made
    through them (a Keras optimizer fine-tuning a ``TFSMLayer``) are locked and counted,
    and each version starts at 0 (a SavedModel holds none). The *loaded functions*,
    though, write through the handles they captured when they were saved: those writes
    take neither these variables' locks nor their versions (functions saved from
    safevars objects, a model built in the scope included, keep their own locks among
    themselves).

Where things live:

* ``scoping.py``: :func:`scope`.
* ``creators.py``: the creators, the one lock per block, blocks that survive
  ``keras.backend.clear_session()``.
* ``backing.py``: which variables are SafeVariable-backed.
* ``slots.py``, ``strategy_updates.py``, ``keras_variables.py``, ``optimizer_steps.py``,
  ``train_steps.py``: one patch each (above); ``keras_classes.py``: what they reach of
  Keras.
* ``marks.py``: which block a Keras object belongs to, so the variables it creates
  later join it.
* ``protection.py``: :func:`protect`, :func:`is_protected`, :func:`unprotected_variables`,
  and Keras' training calls that protect a model trained inside a block.
* ``model_files.py``: a protected model's ``.keras`` file, pickle, deep copy and
  ``clone_model`` come back protected.
* ``patches.py``: installing the patches.
"""

from safevars.creator_scope.optimizer_steps import traced_plainly as traced_plainly
from safevars.creator_scope.patches import install
from safevars.creator_scope.protection import (
    UnprotectedVariable,
    is_protected,
    protect,
    unprotected_variables,
)
from safevars.creator_scope.scoping import scope
from safevars.creator_scope.slots import slots_of
from safevars.creator_scope.train_steps import STEP_GUARD_HOOKS

__all__ = [
    "STEP_GUARD_HOOKS",
    "UnprotectedVariable",
    "install",
    "is_protected",
    "protect",
    "scope",
    "slots_of",
    "unprotected_variables",
]
