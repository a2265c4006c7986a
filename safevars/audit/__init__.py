"""``safevars.audit()``: find unsynchronized variable access in existing code.

The problem: ``v.assign(v.read_value() + 1)`` on a ``tf.Variable`` shared by threads
loses updates, silently, and only sometimes. Thread sanitizers see C++ memory, not a
Python read-then-write of a variable, and a lost update leaves no trace in the result
except a number that is a little off. ::

    with safevars.audit() as report:
        train_with_threads()
    print(report)          # each race: variable, threads, file:line of the read and writes

While an audit is active, every ``tf.Variable`` used by any thread (plain ones, Keras
variables' backing variables and the variables inside :class:`~safevars.SafeVariable`)
is watched: reads (``read_value``, ``value``, ``numpy``, tensor conversion, ``v + 1``,
``sparse_read``, ``gather_nd``) and writes (``assign``, ``assign_add``, ``assign_sub``,
the ``scatter_*`` family, slice assignment) are recorded with the thread, the user code
line that made them (the first stack frame outside TensorFlow, Keras, wrapt, safevars and
the threading machinery) and the safevars locks the thread holds.

Detection rule
==============

Each recorded access gets two numbers from one global counter: ``begin`` before the
TensorFlow call and ``end`` after it returns. For each variable and thread, the thread's
*pending read* is its last read of the variable since its own last write of it.

* **Window.** When thread A writes ``v`` while it has a pending read of ``v``, the pair
  (that read, this write) is a *read-modify-write window*: A's write may be based on what
  it read. A window is *protected by* a lock if the read and the write happened inside
  one continuous hold of it (same ``safevars.locked``/``update``/``transaction``
  section of a safevars guard, same ``tf.CriticalSection.execute``). A write with no
  pending read is a *blind* write.
* **lost_update.** A window of thread A and a write of the same variable by another
  thread B conflict when B's write is *not ordered* with respect to the window (see
  below), unless the window is protected by a lock that B also held for its write, or
  both writes are commutative updates of one family (``assign_add``/``assign_sub``/
  ``scatter_add``/..., whose effects cannot be lost). Whether B's write actually fell
  between A's read and A's write is irrelevant: the detector reports what *can* happen,
  so it does not depend on the scheduler producing a lost update during the audit.
* **concurrent_write.** Two blind writes of ``v`` by different threads conflict when
  they are not ordered, they hold no common safevars lock, and they are not commutative
  updates of one family (last writer wins, nondeterministically).
* safevars' own bookkeeping is not audited: the version counters of SafeVariables, and
  the read SafeVariable returns after a graph write. A ``compare_and_assign`` write
  checked under the lock that no write intervened since the caller's snapshot, so it
  opens no window (it is still a write other threads' windows can conflict with).

*Ordering* is happens-before, tracked with vector clocks over the synchronization the
audit can see: program order in a thread, ``threading.Thread.start`` (everything the
parent did before ``start`` happens before the child) and a ``Thread.join`` that
returned with the thread finished (everything the thread did happens before what the
joiner does next). Initialising a variable before starting the workers and reading or
resetting it after joining them is therefore never reported; two workers that run at the
same time always are, however the GIL happened to interleave them.

Every finding carries an ``evidence``: ``"observed"`` when the recorded intervals
actually overlapped (B's write ``[begin, end]`` intersects A's window ``[read.begin,
write.end]``: the operations were in flight at the same time, or B's write fell between
A's read and write), ``"predicted"`` when the conflict comes from the ordering alone.
With ``predictive=False`` only observed findings are reported, for code that orders its
accesses by means the audit cannot see.

Findings are deduplicated by (variable, kind, read site, write sites); each keeps the
names of every thread involved (``"name #n"`` when two threads share a name), how many
times the pattern matched and whether it came from eager code or a ``tf.function``.
Variables are identified by their resource handle and shown by name.

Inside ``tf.function``
======================

Graph execution happens in C++ and is invisible to Python patching. What the audit does
instead:

* Accesses made while a function is being *traced* are not run-time accesses (they
  happen once, when the graph is built); they are recorded, in program order, as the
  function's access list, with the ``tf.CriticalSection`` s and safevars graph sections
  they were traced in (SafeVariable's run-time locks) and the user lines they come from (AutoGraph's
  generated code is mapped back to the source).
* Each eager call of a concrete function traced while an audit was active replays that
  list as accesses of the calling thread, spanning the call, with its sections counted
  per call. Two threads running functions that read then write a shared variable (or a
  function racing with eager code) are then reported like eager code, with
  ``context`` naming the function. A nested function call adds its list to the caller's.

A variable passed to the function as an argument, rather than captured, is attributed
to the variable passed in each call.

What it cannot see: functions traced before any audit was active (their calls are
counted under "not analysed" in the report: trace them inside the block), accesses made
with raw ops on a handle (``tf.raw_ops.AssignVariableOp``), and data dependence: a
``tf.cond`` branch or loop body counts as executed once per call, so a conditional write
counts as a write and a loop's read-then-write as one window.

Cost
====

Nothing is patched when no audit is active: the first audit installs the patches, the
last one to end removes them and restores the original functions, also when its block
raises. While active, every variable access walks a few stack frames and takes one lock
(the benchmark family ``audit`` measures it).

Audits may nest and may be active in several threads at once: each one sees every access
made by any thread while it is active.

NOTES:
  What is *not* understood as synchronization: ``threading.Lock``, queues, events,
  barriers, futures. Code that orders variable accesses only with those is reported as
  racy (``evidence="predicted"``); make the read-modify-write atomic with
  :meth:`SafeVariable.update` or ``safevars.locked``, which the audit understands, or
  pass ``predictive=False``. Writes to disjoint indices (``scatter_update`` on
  different rows) are treated as writes of the whole variable. Under ``tf.distribute``
  each component variable is audited on its own.

Where things live
=================

Bottom to top: each module imports only modules listed before it.

* ``report.py``: :class:`AuditReport`, :class:`Race` and their text; the race kinds and
  evidences.
* ``happens_before.py``: the analysis: vector clocks per thread (program order,
  ``Thread.start``/``join``), the lock sets of an access, the detector (windows,
  conflicts, findings) and the lock that guards it.
* ``active.py``: the audits active now and the state they share.
* ``sites.py``: the user line of an access (stack frames classified by file, AutoGraph's
  generated code mapped back).
* ``tf_function.py``: accesses traced into a ``tf.function`` and replayed at each call.
* ``recording.py``: the hooks that record eager accesses, critical sections and thread
  starts/joins.
* ``patching.py``: what is patched, installed by the first audit and removed by the last.
* ``context_manager.py``: :func:`audit`, the entry point.
"""

from safevars.audit import report
from safevars.audit.context_manager import audit
from safevars.audit.report import CONCURRENT_WRITE as CONCURRENT_WRITE
from safevars.audit.report import LOST_UPDATE as LOST_UPDATE
from safevars.audit.report import OBSERVED as OBSERVED
from safevars.audit.report import PREDICTED as PREDICTED
from safevars.audit.report import AuditReport as AuditReport
from safevars.audit.report import Race as Race

# The records and race kinds: report.py's public names (one list, kept there).
__all__ = ["audit"]
__all__ += report.__all__
