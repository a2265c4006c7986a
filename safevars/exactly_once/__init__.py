"""Exactly-once writes for steps scheduled on parameter servers (``ClusterCoordinator``).

The problem: ``ClusterCoordinator.schedule`` retries a step whose worker failed, on
another worker. When the worker died *after* the step's update reached the parameter
server (it was killed while sending the result back, say), the retry applies the update
a second time: a counter updated by 300 successful steps ends at 301 or 302. No
TensorFlow API tells a retry from a first attempt.

The fix: :func:`schedule` gives every scheduled call an int64 *token* (drawn on the
coordinator, or chosen by the caller) and passes it into the step as an argument, so
every attempt of the call (the first and each retry) carries the same token. Every
safevars critical section the step traces (``SafeVariable`` writes and ``update``,
``safevars.transaction``, ``SafeOptimizer.apply_gradients``,
``GradientAccumulator.add``...) becomes, inside its locks and on the parameter server
that holds them::

    if (token, section) is not in the table:   # a hash table on the lock's parameter server
        run the section; record (token, section)        # in the same critical section
    else:
        write nothing; count one discarded duplicate    # statistics().duplicates_discarded

Lookup, writes and record run under the section's locks, so two attempts of one step can
never both apply a section, whichever workers run them and in whatever order. A section
starts writing only once every tensor it uses has reached the parameter server (it runs
as one function call there), so a worker that dies while a section's inputs are in
flight leaves that section not applied, never half applied.

What a step reported as failed may have done: each section of the step was applied at
most once, but a step whose result did not come back (``fetch()`` raised, for instance
``CancelledError`` after another step failed, or the step's own error) may have applied
any of its sections. :meth:`ScheduledStep.outcome` reads the tables and says which
(``"applied"``, ``"partly_applied"`` or ``"not_applied"``); :meth:`ScheduledStep.
reschedule` (or :func:`schedule` with the same ``token=``) runs the step again with the
same token, which applies exactly the sections that are missing. So with every failed
or cancelled step scheduled again until its result is fetched, every step takes effect
exactly once.

NOTES:
  * A section is recognised by its place in the traced step. One that could run more
    than once per step, inside a ``tf.while_loop`` (or an AutoGraph ``for`` over a
    tensor) or inside another ``tf.function`` the step calls, is refused at trace time
    with :class:`~safevars.UnsupportedStrategyError`: put the loop around the scheduled
    steps, or call the inner function's Python code directly. So is a step holding a
    critical section traced without the token: a ``tf.function`` it calls that was
    traced before elsewhere, or a ``tf.CriticalSection`` of the caller's own. Writes in
    a replica function of ``strategy.run`` (traced in a thread of its own) are covered:
    the wrapper is registered for the step's graph, whichever thread traces into it.
  * A discarded section writes nothing and returns zeros (of the dtypes and shapes it
    would have returned) in place of its results: a step's result is that of the
    attempt whose result came back. Read-only sections (snapshots, ``statistics()``)
    are never recorded: a retry reads again.
  * Checkpoints: :func:`tables` is this coordinator's table object; put it in the
    ``tf.train.Checkpoint`` (or ``CheckpointManager``) of the variables the steps
    write. A save of it holds the mutex of every lock of an exactly-once section
    while it reads (sections in progress finish first, others wait), so each
    checkpoint holds a section's entry exactly when it holds its writes, even while
    steps run. A new coordinator that restores it and schedules every step again with
    the same tokens applies each step exactly once. Section ids come from the step's
    qualified name and the section's place in the trace, so they are the same in the
    new process. (Two *different* step functions given the same token could share a
    section id with probability about 2**-20 per pair of sections on one parameter
    server: give each function its own token range, or draw tokens.)
  * Bounded tables: each applied section keeps one entry (42-44 bytes of resident
    memory, measured with 0.5-2 million entries) until :meth:`Tables.compact` declares
    the tokens below a watermark finished and removes theirs. Compacting every ``W``
    tokens to ``below = newest - W`` keeps at most ``2 * W`` tokens' entries per table
    (times the sections a step has on that parameter server), plus one for the
    watermark. A token below the watermark is refused by :func:`schedule` and
    discarded at run time. A retry must call the same function with arguments of the
    same types and shapes (the same trace).
  * Writes made outside safevars (a plain ``tf.Variable.assign``) are not protected.

Where things live (each module imports only those above it):

* ``state.py``: the key layout, the tokens, the locks, and this process's tables.
* ``applied_tables.py``: :class:`Tables` (one table per parameter server, the
  watermark) and :func:`tables`.
* ``recording.py``: a step's sections, each looked up by its key and applied and
  recorded, or discarded and counted.
* ``steps.py``: :func:`schedule` and :class:`ScheduledStep`.
* ``checkpoints.py``: a save that holds the tables is fenced, a restore rereads the
  watermark (installed over ``TrackableSaver`` when this package is imported).
"""

from __future__ import annotations

from safevars.exactly_once import checkpoints as _checkpoints  # noqa: F401  (installs it)
from safevars.exactly_once.applied_tables import Tables, tables
from safevars.exactly_once.steps import ScheduledStep, schedule

__all__ = ["ScheduledStep", "Tables", "schedule", "tables"]
