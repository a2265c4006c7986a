"""GradientAccumulator: thread-safe, deterministic accumulation of gradients.

One class, :class:`GradientAccumulator`, and its statistics record. The class is large
(one public surface over eager, graph and distributed paths), so its methods are grouped
by concern into mixins, one per file; ``GradientAccumulator`` combines them and holds
the configuration and the trackable state. Where things live:

``gradient_accumulator.py``
    The class: its docstring (guarantees, modes, strategies, memory cost, what is not
    guaranteed), the constructor (argument checks, the state variables and their
    lock), properties, ``statistics()``, ``locked()``.
``contributions.py``
    ``add()`` and everything before the lock: gradients matched to the variables,
    checked (structure, shape, dtype, sparse indices, non-finite values) and flattened
    into one contribution; ``version`` normalized for the staleness check.
``commit.py``
    The critical section of ``add``, one code path eager and in a graph: the staleness
    decision (policy in :mod:`safevars.staleness`), the contribution kept by reference
    or copied into the buffer's next free block (and its growth) or added to the
    running sum, the counters.
``take.py``
    ``take()``, ``take_if_ready()``, ``reset()``: the eager wait, the graph take, the
    reduction under the lock, the division and the split into one tensor per variable.
``reproducible_sum.py``
    The order-independent float summation that makes ``deterministic=True`` bitwise
    reproducible (Demmel and Nguyen), and its compile-shape table.
``placement.py``
    Where the state lives (with the first variable, or on a parameter server) and how
    the coordinator's eager calls reach state on a parameter server; the strategy check.
``replicas.py``
    ``add`` inside ``strategy.run``: MirroredStrategy's ``merge_call`` and
    MultiWorkerMirroredStrategy's all-gather, so every replica counts once.
``state.py``
    The shared data types (a variable's slot in the flat state, the layout of a
    deterministic contribution's block, the first blocks kept by reference, a
    contribution on its way to the commit, the untracked helpers) and the declarations
    of the attributes
    and cross-file methods the mixins rely on, so each file type-checks on its own.
``statistics.py``
    :class:`AccumulatorStatistics` and the layout of the counters it is read from.

Why mixins rather than helper functions: the methods keep their names, signatures and
``self`` state (the split moved code without rewriting it), each file still reads as
methods of the one accumulator, and ``help(GradientAccumulator)`` shows one class. The
mixins add no state of their own and are not meant to be used alone.
"""

from safevars.accumulator.gradient_accumulator import GradientAccumulator
from safevars.accumulator.statistics import AccumulatorStatistics

__all__ = ["AccumulatorStatistics", "GradientAccumulator"]
