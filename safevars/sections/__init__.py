"""Critical sections inside ``tf.function``: what orders graph execution, not tracing.

A *section* is the run-time counterpart of ``safevars.locked``: a traced body placed
between a ``MutexLock`` op on the ``tf.CriticalSection`` mutex of each lock it needs
(in the global lock order, see :mod:`safevars.locking`) and the ``ConsumeMutexLock`` ops
that release them once every op of the body has run. A Python lock taken inside
``tf.function`` would only guard tracing: the graph runs later, from any thread, any
number of times, so only ops can order its execution against other graphs and against
eager sections (which take the same mutex once the lock is in run-time mode).

XLA cannot compile mutex ops: a section traced inside a ``jit_compile=True`` function
records its locks, and the compiled call runs under them as a whole.

Where things live (one idea per file; each module imports only those above it):

* ``tracing.py``: the sections this thread is tracing (what an enclosing section holds
  already) and the body-wrapper hooks of :mod:`safevars.exactly_once`.
* ``xla.py``: what an XLA-compiled function records while traced (its locks, the
  preparations of ``record_xla_preparation``).
* ``gate.py``: what a section's ops wait for, its last ``MutexLock`` or a gate op.
* ``reentry.py``: which locks a traced graph takes, and the eager call of it that would
  wait on a lock its own thread holds (raised as ``LockReentryError``).
* ``coarsening.py``: consecutive sections on the same locks joined into one, and their
  version counts merged.
* ``section.py``: :func:`graph_section` / ``lock_section``, the ops of one section.
* ``compiled_calls.py``: the ``ConcreteFunction._call_flat`` wrapper that runs a
  compiled function under its locks (installed when this package is imported).
* ``step_span.py``: how much of a traced training step runs under its lock
  (``lock_span``).

Besides ``__all__``, this package re-exports (``name as name``) the internal names that
other safevars modules reach as ``safevars.sections.<name>``.
"""

from safevars.sections import compiled_calls as _compiled_calls  # noqa: F401  (installs it)
from safevars.sections.section import defer_count, graph_section
from safevars.sections.tracing import (
    body_wrappers,
    graph_body_wrappers,
    graph_inputs,
    held_in_graph,
)
from safevars.sections.xla import record_xla_preparation

__all__ = [
    "body_wrappers",
    "defer_count",
    "graph_body_wrappers",
    "graph_inputs",
    "graph_section",
    "held_in_graph",
    "record_xla_preparation",
]
