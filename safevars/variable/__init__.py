"""SafeVariable: a drop-in ``tf.Variable`` with locked writes, versions and snapshots.

Where things live (one idea per file):

* ``safe_variable.py``: the class :class:`SafeVariable` (what it guarantees and what
  not), construction, identity, copies and pickling, versions, snapshots, checkpoints,
  tensor conversion.
* ``snapshots.py``: :class:`~safevars.Snapshot` and how snapshots are read (the
  optimistic sequence-lock read, or under the locks); the public
  :func:`safevars.snapshot` is a layer above, in ``safevars/snapshot.py``.
* ``writes.py``: every write (``assign*``, slice assignment, ``update``,
  ``compare_and_assign``): the lock, the version count, the dtype and shape check, the
  eager fast path.
* ``scatter.py``: the ``scatter_*`` methods and the index check that writes nothing on a
  bad index.
* ``checks.py``: the checks of an expected version and of a value's shape.
* ``write_counting.py``: :func:`writes_counted_by_caller` (enclosing code counts the
  writes).
* ``write_order.py``: ``program_order()`` (graph writes of a transaction wait for every
  op traced before them).
* ``wrapping.py``: :func:`wrap` and :func:`as_safe_variables`.

The locks and versions themselves are :mod:`safevars.locking`. Why mixins: the write and
scatter methods stay methods of the one class (``help(SafeVariable)`` shows one class);
the mixins add no state, no attribute the proxy would stop forwarding, and are not meant
to be used alone. Besides ``__all__``, this package re-exports (``name as name``) the
internal names other safevars modules import from ``safevars.variable``, and
``_unpickle``, which pickles of SafeVariables name.
"""

from safevars.variable.safe_variable import SafeVariable
from safevars.variable.safe_variable import _unpickle as _unpickle
from safevars.variable.wrapping import as_safe_variables, wrap
from safevars.variable.write_counting import _writes_to_count as _writes_to_count
from safevars.variable.write_counting import writes_counted_by_caller
from safevars.variable.write_order import program_order as program_order

__all__ = ["SafeVariable", "as_safe_variables", "wrap", "writes_counted_by_caller"]
