"""``safevars.audit()``: find unsynchronized variable access in existing code.

The problem: ``v.assign(v.read_value() + 1)`` on a ``tf.Variable`` shared by threads
loses updates, silently, and only sometimes; a thread that reads two variables while
another updates both computes from half an update. Thread sanitizers see C++ memory,
not a Python read-then-write of a variable, and neither leaves a trace in the result
except numbers that are a little off. ::

    with safevars.audit() as report:
        train_with_threads()
    print(report)          # each race: variables, threads, file:line of reads and writes, fix

While an audit is active, every ``tf.Variable`` used by any thread (plain ones, Keras
variables' backing variables and the variables inside :class:`~safevars.SafeVariable`)
is watched: reads (``read_value``, ``value``, ``numpy``, tensor conversion, ``v + 1``,
``sparse_read``, ``gather_nd``, ``safevars.snapshot``) and writes (``assign``,
``assign_add``, ``assign_sub``, the ``scatter_*`` family, slice assignment) are recorded
with the thread, the user code line that made them (the first stack frame outside
TensorFlow, Keras, wrapt, safevars and the threading machinery) and the safevars locks
the thread holds; and so is the synchronization between threads (locks, conditions,
semaphores, events, barriers, queues, futures, thread start and join).

Detection rules
===============

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
* **torn_read.** A thread's *run* is what it does between two synchronization operations
  (see below), or during one ``tf.function`` call. A run's writes of several variables
  made under the same section instances are one *update* (one call's writes, one Keras
  step, one ``safevars.locked`` section, writes with nothing in between); a run's reads
  are one *view*. A view of thread R and an update of thread W conflict when at least
  two variables are in both, the update is not ordered entirely before the view nor the
  view entirely before the update, no lock was held across the whole view and the whole
  update (safevars sections), and no single ``safevars.snapshot`` call read them all
  (a snapshot is read at one instant: two snapshots taken apart are not). R may then
  compute from values of before and after W's update.
* safevars' own bookkeeping is not audited: the version counters of SafeVariables, and
  the read SafeVariable returns after a graph write. A ``compare_and_assign`` write
  checked under the lock that no write intervened since the caller's snapshot, so it
  opens no window (it is still a write other threads' windows can conflict with); nor
  does a write made by Keras' metric resets or ``set_weights`` (their values do not
  come from a read).

*Ordering* is happens-before, tracked with vector clocks over the synchronization the
audit can see:

* program order in a thread; ``threading.Thread.start`` (everything the parent did
  before ``start`` happens before the child, ``threading.Timer`` included) and a
  ``Thread.join`` that returned with the thread finished (everything the thread did
  happens before what the joiner does next);
* ``threading.Lock`` and ``RLock``: a release before every later acquire; a
  ``Condition`` through its lock (a notify is followed by the notifier's release, a
  woken wait re-acquires); ``Semaphore``/``BoundedSemaphore``: a release before every
  later acquire; ``Event``: a ``set`` before a ``wait`` or ``is_set`` that returned
  true; ``Barrier``: every arrival of a generation before every departure from it;
* ``queue.Queue``, ``LifoQueue``, ``PriorityQueue``, ``SimpleQueue``: a ``put`` before
  the ``get`` that returns that item, every ``task_done`` before a ``join`` that
  returned;
* ``concurrent.futures``: ``submit`` before the task; the task before ``result()`` and
  ``exception()``, a ``done()`` that returned true, a done callback, ``wait`` and
  ``as_completed`` for the futures they return, ``shutdown(wait=True)``.

Initialising a variable before starting the workers and reading it after joining them
is never reported, nor is code ordered by any of the above; two workers whose accesses
nothing orders always are, however the GIL happened to interleave them. Locks are
ordering, as in ThreadSanitizer: two critical sections of one lock are ordered in the
order they ran, so a read and a write in two sections of one lock are reported only
when another thread's write came in between (or could have, unordered).

Locks are C objects whose methods cannot be patched: a lock is seen through a proxy of
the same lock (``sync.py``). While an audit is active, ``threading.Lock``/``RLock`` made
by the project's code (any file outside the standard library, installed packages and
safevars) are proxies, and locks made before the audit are swapped for proxies where
the project keeps a reference the audit can reach (``adopting.py``: module globals,
the objects, lists and dicts they reach, closures, default arguments, the arguments of
threads started and tasks submitted); the swaps are undone when the last audit ends.
Locks the standard library, TensorFlow or Keras make for themselves stay plain and order
nothing (their uses would order accesses by chance and hide races); the standard
library's primitives are understood at their own API instead.

Every finding carries an ``evidence``: ``"observed"`` when the recorded intervals
actually overlapped (B's write ``[begin, end]`` intersects A's window ``[read.begin,
write.end]``; a write of the update between the first and last read of the view),
``"predicted"`` when the conflict comes from the ordering alone. With
``predictive=False`` only observed findings are reported, for code that orders its
accesses by means the audit cannot see.

Findings are deduplicated by (variable, kind, read site, write sites); each keeps the
names of every thread involved (``"name #n"`` when two threads share a name), how many
times the pattern matched and whether it came from eager code or a ``tf.function``.
Variables are identified by their resource handle and shown by name: a Keras variable's
``path`` (``"sequential/dense/kernel"``, an optimizer slot ``"adam/..._momentum"``),
else the ``tf.Variable``'s name. An access made by a Keras call names it
(``Race.calls``: ``train_on_batch``, ``fit``, ``apply_gradients``); the variables of
one call racing at the same lines are one finding, and its fix is the one for that call
(``safevars.scope()``, ``SafeOptimizer``).

Inside ``tf.function``
======================

Graph execution happens in C++ and is invisible to Python patching. What the audit does
instead:

* Accesses made while a function is being *traced* are not run-time accesses (they
  happen once, when the graph is built); they are recorded, in program order, as the
  function's access list, with the ``tf.CriticalSection`` s and safevars graph sections
  they were traced in (SafeVariable's run-time locks) and the user lines they come from
  (AutoGraph's generated code is mapped back to the source).
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

Nothing is patched when no audit is active: the first audit installs the patches and
searches the project's modules for locks made before it, the last one to end removes
them, restores the original functions and swaps the locks back, also when its block
raises. While active, every variable access walks a few stack frames and takes one lock,
every acquire and release of a tracked lock moves a vector clock (the benchmark family
``audit`` measures it).

Audits may nest and may be active in several threads at once: each one sees every access
made by any thread while it is active.

NOTES:
  What the audit cannot see, so cannot count as ordering: other processes
  (``multiprocessing``, ``ProcessPoolExecutor`` tasks, parameter-server workers), the
  C++ locks and threads inside TensorFlow (the graph runtime, ``tf.data``), pipes,
  sockets, files and sleeps, ``asyncio``, a lock used through ``_thread`` directly, a
  lock made before the audit that the audit cannot reach (held only in a local variable
  of a running function and used there, inside a tuple, or inside an installed
  library's objects), and a critical section entered before the audit began. Code that
  orders its accesses only by those is reported as racy (``evidence="predicted"``):
  pass ``predictive=False``, or make the ordering visible (a ``threading`` primitive
  the audit tracks). Writes to disjoint indices (``scatter_update`` on different rows)
  are treated as writes of the whole variable. Under ``tf.distribute`` each component
  variable is audited on its own.

Where things live
=================

Bottom to top: each module imports only modules listed before it.

* ``report.py``: :class:`AuditReport`, :class:`Race` and their text; the race kinds,
  evidences and the fix each finding suggests.
* ``clocks.py``: vector clocks per thread and per synchronization object, runs.
* ``happens_before.py``: the analysis: accesses, the lock sets of an access, the
  detector (windows, conflicts, views and updates, findings) and the lock that guards
  it.
* ``active.py``: the audits active now and the state they share.
* ``sites.py``: the user line of an access (stack frames classified by file, AutoGraph's
  generated code mapped back), the Keras call it came from and the Keras variable
  behind it, and which code is the project's.
* ``tf_function.py``: accesses traced into a ``tf.function`` and replayed at each call.
* ``recording.py``: the hooks that record eager accesses, snapshots, critical sections
  and thread joins.
* ``sync.py``: the standard library's synchronization as happens-before edges: lock and
  queue proxies, the hooks of conditions, semaphores, events, barriers, queues, futures.
* ``adopting.py``: locks and queues made before the audit, found and swapped for
  proxies, then swapped back; thread starts and pool submissions.
* ``patching.py``: what is patched, installed by the first audit and removed by the last.
* ``context_manager.py``: :func:`audit`, the entry point.
* ``pytest_support.py``: one test inside an audit, for the pytest plugin
  (``_safevars_pytestplugin``, a top-level module: ``pytest --safevars-audit``).
"""

from safevars.audit import report
from safevars.audit.context_manager import audit
from safevars.audit.report import CONCURRENT_WRITE as CONCURRENT_WRITE
from safevars.audit.report import LOST_UPDATE as LOST_UPDATE
from safevars.audit.report import OBSERVED as OBSERVED
from safevars.audit.report import PREDICTED as PREDICTED
from safevars.audit.report import TORN_READ as TORN_READ
from safevars.audit.report import AuditReport as AuditReport
from safevars.audit.report import Race as Race

# The records and race kinds: report.py's public names (one list, kept there).
__all__ = ["audit"]
__all__ += report.__all__
