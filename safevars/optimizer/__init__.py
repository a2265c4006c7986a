"""SafeOptimizer: a Keras 3 optimizer made safe to share, with atomic, versioned updates.

The problem: a Keras optimizer's ``apply_gradients`` is many separate operations (read
a slot, compute, write the slot, write the variable, add 1 to ``iterations``). Called
from several threads, asynchronous workers or concurrently running ``tf.function`` s, the
steps interleave: Adam's moments and SGD's momentum are read by one step and overwritten
by another (lost updates), ``iterations`` no longer matches the moments it bias-corrects,
and gradients computed from parameters that have since moved are applied as if fresh.

The fix: ``SafeOptimizer(optimizer)`` makes the optimizer you already use safe and
returns it. Each ``apply_gradients`` / ``apply`` call is then **one critical section**
over every variable it updates *and* the optimizer's own state (slots, ``iterations``,
learning rate, Keras' gradient accumulators, safevars' counters):

* eagerly under the variables' safevars locks (:func:`safevars.locking.hold`; a plain
  ``tf.Variable`` or ``keras.Variable`` gets its lock from :func:`safevars.wrap`);
* inside a ``tf.function`` (``model.fit``, custom loops, ``strategy.run``) the update is
  traced inside the same locks' mutexes (:func:`safevars.sections.graph_section`), so the
  exclusion holds when the graph runs, across threads, graph executions and eager code;
* each call adds exactly 1 to the version of every variable it wrote.

When it is built, the optimizer asks :func:`safevars.locking.share_lock` to let its
model variables and its state share one lock (each keeping its own version): one step
then takes one lock, however many variables the model has; and
:func:`safevars.locking.join_versions` to count the versions of a step that writes
every model variable with one add. In a ``tf.function`` the section spans the whole
step by default, from the forward pass's reads of the weights (``lock_span="step"``,
:mod:`safevars.sections.step_span`).

**Why a class made per optimizer class, not a proxy.** ``SafeOptimizer(adam)`` gives
``adam`` the class ``SafeOptimizer[Adam]`` (made once per optimizer class, a subclass of
both :class:`SafeOptimizer` and ``Adam``) and returns the same object. It therefore *is*
the optimizer: every attribute and hyperparameter (read and write), every method
(``exclude_from_weight_decay``, EMA, Nadam's and Muon's own), ``name``,
``loss_scale_factor`` as ``LossScaleOptimizer`` and ``MultiOptimizer`` set it, Keras'
warnings and errors for missing gradients, and the state layout (``variables``,
``get_weights``, checkpoints, ``.keras`` files) are the optimizer's own, with nothing in
between; ``isinstance(opt, Adam)`` holds. Keras' internal calls (``apply_gradients``
calling ``apply``, ``LossScaleOptimizer`` and ``MultiOptimizer`` calling the optimizer
they hold, ``model.fit``) reach the safe ``apply`` by ordinary method resolution. A
transparent proxy (what :class:`~safevars.SafeVariable` is for ``tf.Variable``) would
forward reads to the wrapped object, whose own methods then run on the wrapped object:
every path into an update would need intercepting, and anyone holding the plain object
(the one passed in) would update it unlocked. Here no plain object is left. The price:
the call changes the class of the object you pass (it cannot be undone), and
``type(opt) is Adam`` is false.

**Where safevars' own state lives.** The counters of :meth:`SafeOptimizer.statistics`
and the pending gradients of ``accumulate_steps`` are not optimizer variables: they are
in :attr:`SafeOptimizer.safevars_state`, a trackable that checkpoints only if you add it
(``tf.train.Checkpoint(..., safevars=opt.safevars_state)``). A ``.keras`` file or a
checkpoint of ``SafeOptimizer(Adam)`` is therefore laid out exactly as one of ``Adam``:
either loads into the other and training continues bitwise as it would have.

On top of the section: a staleness policy (``max_staleness`` with ``on_stale="drop" |
"raise" | "scale"``), deterministic accumulation (``accumulate_steps``; Keras' own
``gradient_accumulation_steps`` works too, made thread-safe) and an opt-in non-finite
policy, with every decision counted in :meth:`SafeOptimizer.statistics`.

Under ``tf.distribute`` (create the optimizer and make it safe inside
``strategy.scope()``; anything else is refused with an error naming the fix):

* ``MirroredStrategy`` / ``OneDeviceStrategy``: inside ``strategy.run`` the gradients
  are summed across replicas (as Keras does) and the section runs once per step, in
  cross-replica context, over every replica's copy.
* ``MultiWorkerMirroredStrategy``: the same on every worker; the gradients are
  all-reduced across the workers first, so the workers' weights, versions and counters
  agree.
* ``ParameterServerStrategy`` (TF2, with ``ClusterCoordinator``): variables, slots and
  counters live on the parameter servers and so do the locks: one ``apply_gradients``
  of a scheduled function is one critical section on the parameter server. An eager
  call on the coordinator runs the same section inside a ``tf.function``.
  ``ShardedVariable`` s are refused. Keras 3's ``model.fit`` does not support
  ParameterServerStrategy; use a custom loop.

NOTES:
  What is *not* guaranteed:

  * Writes that bypass safevars (another optimizer on the same variables, or
    ``layer.kernel.assign(...)`` on a plain Keras variable) are neither locked nor
    counted. Write through :func:`safevars.wrap` or use ``safevars.locked``.
  * Eagerly, and in a ``tf.function`` with ``lock_span="update"`` (or where
    ``"step"`` falls back, see :mod:`safevars.sections.step_span`), computing the gradient is not
    part of the section: a gradient may be computed from parameters another thread
    updates before it is applied. That is what ``version=`` and ``max_staleness`` are
    for. With ``lock_span="step"`` (the default) a traced step's reads of the weights
    are inside the section, so its gradient is that of the weights it updates, and
    threads' traced steps on one model take turns for whole steps.
  * An error the validation cannot foresee (a kernel failing half-way) leaves the update
    half done, as with the plain optimizer. Every mistake that can be checked before the
    update (unknown variable, shape, dtype, versions, staleness, non-finite values) is
    checked first and changes nothing.
  * A ``tf.function`` traced before the optimizer was made safe (a model's
    ``train_function`` after a first ``fit``) keeps the plain, unlocked update: make
    the optimizer safe before the first step, or compile the model again
    (``model.compile(optimizer=model.optimizer, ...)``; the optimizer keeps its state).
  * Inside an XLA-compiled function (``jit_compile=True``) the locks are taken around
    the compiled call (:mod:`safevars.sections`); the ``"raise"`` policies need run-time
    assertions, which XLA drops, so they are refused there.

Where things live
=================

* ``safe_optimizer.py``: :class:`SafeOptimizer`, the class users call: its settings,
  ``build`` (and the locks), ``apply_gradients`` / ``apply`` and the dispatch of a call.
* ``class_switch.py``: ``SafeOptimizer(opt)``: the metaclass, the checks, and the class
  ``SafeOptimizer[type(opt)]`` made once per optimizer class.
* ``runtime.py``: what a safe optimizer keeps besides Keras' state (settings, guards,
  counters variable, :class:`SafevarsState`), one validated call, the parts' base.
* ``validation.py``: every check before the section (settings, variables, gradients,
  the call itself).
* ``versions.py``: the ``version=`` argument and the staleness measured from it (the
  policy's shared rules are in :mod:`safevars.staleness`).
* ``locked_step.py``: the critical section and the policies run inside it (staleness,
  non-finite), then the update and the counters.
* ``accumulation.py``: ``accumulate_steps`` (a :class:`~safevars.GradientAccumulator`).
* ``keras_update.py``: Keras' own update in the section, Keras'
  ``gradient_accumulation_steps``, and the versions it adds.
* ``statistics.py``: :class:`OptimizerStatistics` and the counters.
* ``strategies.py``: the supported ``tf.distribute`` strategies, replicas merged into one
  section, Keras' merge calls made direct.
* ``coordinator.py``: ParameterServerStrategy: eager calls on the coordinator.
* ``whole_state.py``: ``set_weights``, the saving hooks and EMA's finalization, under
  every lock.
* ``serialization.py``: the registered name and module saved files hold, the config
  (``get_config`` / ``from_config``) and pickling.
* ``decisions.py``: trace-safe decisions (one path for eager and graph) and the XLA test.
"""

from safevars.optimizer.runtime import SafevarsState as SafevarsState
from safevars.optimizer.safe_optimizer import SafeOptimizer
from safevars.optimizer.statistics import OptimizerStatistics

__all__ = ["OptimizerStatistics", "SafeOptimizer"]
