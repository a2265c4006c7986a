"""ReplicaRNG: one seed, an independent reproducible random stream per replica and worker.

The problem: replicas seeded with the same seed draw the same augmentations and dropout
masks; seeding every worker by hand is error-prone; under ``ParameterServerStrategy`` a
``tf.random.Generator`` is one state on a parameter server shared by all workers (its
per-replica key hash uses replica 0 on every worker), so the values a worker gets depend
on how the coordinator interleaves the steps; a Keras ``SeedGenerator`` shared by the
replicas of a ``MirroredStrategy`` hands every replica the same seeds; and
``tf.random.set_seed`` inside ``strategy.run`` gives no per-replica control.

The fix: ``ReplicaRNG(seed)`` owns one Philox stream per replica. Stream ``r`` of worker
``w`` is keyed by a 64-bit key derived from ``(seed, w, r)`` with
``numpy.random.SeedSequence`` (a stable, documented function; never Python's ``hash``),
and its position is the Philox counter stored next to the key in a 3-element int64
resource variable ``[counter_lo, counter_hi, key]``: the same layout as
``tf.random.Generator``. Every value is the stateless function
``philox(key(seed, worker, replica), counter)``; a draw fetches the counter and advances
it by the number of values drawn in one atomic step under the variable's own mutex:
one fused kernel (``StatefulStandardNormalV2``, ...) eagerly and for graph draws
of fewer than 4,096 elements, ``RngReadAndSkip`` then the stateless ``*V2`` kernel for
larger graph draws, whose fills then run in parallel (bitwise the same values). Hence:

* the same seed gives bitwise the same streams in a new instance or a new process;
* different seeds, workers and replicas give different, independent streams;
* a draw never depends on which thread runs it, on how often a ``tf.function`` was
  traced (tracing draws nothing), or on other streams;
* the state is plain trackable TensorFlow state: ``tf.train.Checkpoint`` saves and
  restores it and a restored run continues exactly where it stopped.

Inside ``strategy.run`` the RNG's own :meth:`ReplicaRNG.normal` and friends use the stream
of the current replica (``tf.distribute.get_replica_context().replica_id_in_sync_group``).
Seeds derived without touching any stream (:meth:`ReplicaRNG.seed_for`,
:meth:`ReplicaRNG.numpy`, :meth:`ReplicaRNG.dataset_seed`,
:meth:`ReplicaRNG.element_seeds`) are pure functions of ``(seed, worker, replica, keys)``.
:meth:`ReplicaRNG.attach` makes the dropout and noise layers of a Keras model draw their
seeds from the calling replica's stream.

The worker part of the key is the ``(task_type, task_id)`` of the process: the
``worker=`` argument if given, else the ``cluster_resolver`` of the strategy the RNG is
created under, else ``TF_CONFIG``, else ``("worker", 0)``. So a single-process run has
the streams of task ``worker:0`` of a cluster.

Under ``tf.distribute`` (creating an RNG in the scope of any other strategy, or drawing
under one, raises :class:`~safevars.UnsupportedStrategyError` naming the supported ones):

* **No strategy, ``OneDeviceStrategy``, ``MirroredStrategy``**: one stream per replica
  of this process, each on its replica's device when created in ``strategy.scope()``;
  inside ``strategy.run`` a draw uses ``replica_id_in_sync_group``'s stream.
* **``MultiWorkerMirroredStrategy``**: every worker process creates the RNG in
  ``strategy.scope()`` with the same seed. Its worker part is the process's task from
  the strategy's ``cluster_resolver`` (that is, ``TF_CONFIG``), its replica ids are the
  global ``replica_id_in_sync_group``: replica ``r`` of worker ``w`` draws
  ``philox(key(seed, ("worker", w), r), counter)``. So two workers never share a stream
  even if they ran the same replica ids, and a rerun with the same seed on the same
  cluster gives bitwise the same values per (worker, replica). Each process holds
  ``num_replicas_in_sync`` streams but only those of its local replicas move.
* **``ParameterServerStrategy``** (with ``ClusterCoordinator``): the coordinator creates
  the RNG in ``strategy.scope()``. It holds ``num_replicas`` streams for every worker
  task ``w`` of the cluster, keyed by ``(seed, ("worker", w), r)`` (the streams of
  ``ReplicaRNG(seed, worker=("worker", w))``). Where the state lives is the design
  choice: not on the coordinator (every worker's draws would be a round trip to the
  process that drives the training), not in per-worker resources on the workers
  (``ClusterCoordinator`` rebuilds those from scratch on a restarted worker, which would
  replay values it already handed out, and a coordinator checkpoint cannot save them),
  but on parameter server ``w % num_ps``: where the model's variables already are,
  reachable from every worker, saved and restored by ``tf.train.Checkpoint`` on the
  coordinator, and untouched by a worker failure. In a function run by
  ``ClusterCoordinator.schedule``, a draw uses a state handle that is an input of the
  function, bound each time the coordinator calls it on a worker to that worker's
  stream (the call-time capture behind
  ``tf.distribute.coordinator.experimental_get_current_worker_index()``). It fetches and
  advances the counter on the PS (one ``RngReadAndSkip``: three integers travel) and
  computes the values on the worker with the stateless kernel. An eager draw on the
  coordinator runs on no worker and raises; :meth:`ReplicaRNG.for_worker` gives a
  named worker's stream.

  What "reproducible" means there: the coordinator decides at run time which worker runs
  which step, so *which step* gets which values from the worker streams is not
  reproducible. What is: worker ``w``'s draws, in the order it made them, are exactly
  stream ``(seed, w, r)``, bitwise the same in every run and process given the sequence
  of draws it made, and the workers' streams never overlap. A step's randomness that
  must not depend on scheduling (to compare two runs step by step) is keyed by the step
  instead: pass the step number as an argument of the scheduled function and draw with
  ``tf.random.stateless_*(..., seed=rng.element_seed(step))``. Pure seeds
  (:meth:`ReplicaRNG.seed_for`, :meth:`ReplicaRNG.element_seed`, ...) use the RNG's own
  worker part, the coordinator's (``("chief", 0)`` by default), so they are the same on
  every worker. Counters on the PS only move forward, so when ``ClusterCoordinator``
  reruns a step after a worker failure, no value is handed out twice.

NOTES:
  What is *not* guaranteed:

  * Draws from *one* stream by several threads at once are each atomic (no value is ever
    handed out twice) but which thread gets which values depends on the scheduler. Give
    every thread its own replica stream for reproducible results.
  * The position of a stream depends on the shapes and dtypes of the draws made from it:
    ``normal([2])`` then ``normal([3])`` is not ``normal([3])`` then ``normal([2])``.
  * Restoring a checkpoint restores keys and counters: an RNG created with another seed
    continues the *checkpointed* streams, while its pure seeds (:meth:`seed_for`, ...)
    still follow its own seed. Restore into an RNG built with the same arguments.
  * The ``numpy.random.Generator`` objects of :meth:`ReplicaRNG.numpy` are not
    checkpointed; derive one per epoch (``epoch=``) instead of carrying one across
    restarts.
  * Philox integer streams are identical on every device; floating-point transforms of
    them (normal, truncated normal) may differ in the last bits between CPU and GPU.
  * ``ParameterServerStrategy``: every draw is a round trip to a parameter server
    (three integers), like any PS variable read; the streams are placed by the RNG
    (round robin over the PS tasks, never sharded by the strategy's
    ``variable_partitioner``). A ``tf.function`` that draws and is called on the
    coordinator instead of being scheduled raises when called, not when traced.
  * ``MultiWorkerMirroredStrategy`` checkpoints: restore each worker from a checkpoint
    it wrote itself. Restoring the chief's checkpoint on another worker gives that
    worker the chief's keys: fresh streams (the chief never moved them), not a
    continuation of its own.

Where things live
=================

* ``replica_rng.py``: :class:`ReplicaRNG`: the constructor (worker identity, the
  streams and their devices), choosing a stream (:meth:`~ReplicaRNG.for_replica`,
  :meth:`~ReplicaRNG.for_worker`, the calling replica's under the current strategy) and
  the draws on the current replica's stream.
* ``replica_stream.py``: :class:`ReplicaStream`, one replica's Philox key and counter,
  and the stream chosen at run time (a replica id or worker known only when the graph
  runs).
* ``distributions.py``: normal, truncated normal, uniform, integers and seeds, built on
  one ``_generate``: the methods of :class:`ReplicaStream`, the stream chosen at run
  time and :class:`ReplicaRNG` (the calling replica's stream).
* ``kernels.py``: the Philox kernels: fused stateful kernels, ``RngReadAndSkip`` and the
  stateless ``*V2`` kernels, and when a draw uses which.
* ``seed_derivation.py``: the SeedSequence every key and seed comes from (domains, user
  keys, the stable hash of a task type).
* ``pure_seeds.py``: :meth:`~ReplicaRNG.seed_for`, :meth:`~ReplicaRNG.numpy`,
  :meth:`~ReplicaRNG.dataset_seed`, :meth:`~ReplicaRNG.element_seed` and
  :meth:`~ReplicaRNG.element_seeds`: seeds that move no stream.
* ``placement.py``: ``ParameterServerStrategy``: which parameter server holds a
  worker's streams, and the state handle bound at each scheduled call to the executing
  worker's stream.
* ``strategies.py``: the worker identity a strategy (or ``TF_CONFIG``) gives, and the
  supported uses the strategy errors name.
* ``keras_seed_generator.py``: ``ReplicaSeedGenerator`` (built on first use, reached as
  ``safevars.rng.ReplicaSeedGenerator``), :meth:`~ReplicaRNG.keras_seed_generator` and
  :meth:`~ReplicaRNG.attach`.
* ``arguments.py``: the seed, worker, dtype and bounds checks.
"""

from safevars.rng.keras_seed_generator import __getattr__ as __getattr__
from safevars.rng.replica_rng import ReplicaRNG
from safevars.rng.replica_stream import ReplicaStream

__all__ = ["ReplicaRNG", "ReplicaStream"]
