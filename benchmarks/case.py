"""The contract between the benchmark runner and the case families.

Each family lives in ``benchmarks/bench_<family>.py`` and defines::

    FAMILY = "eager"                       # the name --cases selects
    DESCRIPTION = "one line for the table"
    def cases(ctx: Context) -> list[Case | LazyCase]: ...
    DEFAULT = False                        # optional: run only when --cases names it
    ORDER = 3                              # optional: position in runs and reports
    PLOT_AGAINST = "variables"             # optional: a plot of ratios against a parameter
    SECONDS = {"full": 40, "quick": 3}     # optional: about how long it runs (progress)
    ISOLATED = True                        # optional: a full run measures it in a process of its own

Write ``FAMILY``, ``DESCRIPTION``, ``DEFAULT``, ``ORDER``, ``PLOT_AGAINST``, ``SECONDS``
and ``ISOLATED`` as literals: the runner reads them without importing the module, so a family that fails
to import is still listed and reported by name, and an optional family is not imported
unless selected (a module whose ``FAMILY`` is not a literal is imported to read it). ``DEFAULT`` may be left
out (True); so may ``ORDER`` (families without it come after the others, by file name;
the issue's family number is a good ``ORDER``). ``PLOT_AGAINST`` names a numeric entry
of the cases' ``params`` (for instance ``"variables"`` for cases built at 20, 200 and 400
variables): besides ``overhead_<family>.png``, the run then draws
``<family>_vs_<param>.png``, each variant's ratio to the baseline against that parameter,
one panel per set of cases sharing every other parameter (see :mod:`benchmarks.plots`).
``SECONDS`` is about how long the family runs on a quiet 2-core CPU, full and ``--quick``:
the progress line's estimate of the time left is built on it (scaled by how fast the
run goes, so only the families' proportions matter); a family without it counts as the
average of the others. ``ISOLATED = True``:
a full run that selects other families too measures this one first, in a process of its
own (one per pass with ``--repeat``), before the main process imports TensorFlow (see
:mod:`benchmarks.cli`). TensorFlow
keeps some memory for every function a process ever traced (about 10 MB for a 50-layer
training step, 40 MB for its XLA compilation, after the function and its model are
gone), so a family that traces many large models would otherwise leave its memory to
every family after it.

A :class:`Case` holds *variants*: zero-argument callables doing one unit of work. The
first variant is the baseline (plain ``tf.Variable`` or the stock TensorFlow/Keras way);
the runner warms every variant up, then times them A/B interleaved in the same process
over several rounds and reports per-variant median/min/max and the ratio of medians to
the baseline, each with a 95% confidence interval (see :mod:`benchmarks.timing`). A
variant may return a ``dict`` of extra figures (for example ``{"lost_updates": 12}``);
the runner records the value from the last round.

A family whose cases are costly to build (Keras models, traced functions, pipelines)
returns :class:`LazyCase` entries instead: a name and a function that builds the
:class:`Case` when its turn comes. The runner builds it, measures it, tears it down and
drops it (then ``keras.backend.clear_session()`` and a garbage collection), so only one
such case is alive at a time and the run's memory does not grow with its cases; a
resumed run (``--resume``) skips a finished lazy case without building it. A family
may mix both kinds; build what several cases share inside each builder, or share it
through a cache the builders close over and let the last of them drop it.

A goal is a bound on one ratio: ``(variant, 1.10)`` (or ``(variant, "<=", 1.10)``: the
variant's median at most 1.10 times the reference's) or ``(variant, ">=", 2.0)`` (at
least twice, e.g. a throughput ratio). The report's verdict comes from the interval:
"met" when the whole interval satisfies the bound, "missed" when none of it does,
"inconclusive" when it straddles the bound.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

GOAL_OPERATORS = ("<=", ">=")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a family needs to build its cases.

    Attributes:
      quick: ``--quick``: smaller sizes and fewer rounds (the whole suite < 45 s on CPU).
      device: TensorFlow device string every variable must be placed on ("/CPU:0",
        "/GPU:0"); build variables inside ``with tf.device(ctx.device):``.
      device_kind: "cpu" or "gpu".
      sizes: element counts for size-parametrized cases (e.g. (1, 1_000, 1_000_000)).
      threads: thread counts for contention cases (e.g. (1, 2, 4, 8)).
    """

    quick: bool
    device: str
    device_kind: str
    sizes: tuple[int, ...]
    threads: tuple[int, ...]


@dataclasses.dataclass
class Case:
    """One comparison: variants timed side by side, the first one the baseline.

    Attributes:
      family: The family name (``FAMILY`` of the module).
      name: Case name, unique in the family, e.g. "assign_add/1K".
      variants: Ordered mapping of variant name to a zero-argument callable doing
        ``ops_per_call`` units of work. The first entry is the baseline.
      ops_per_call: Units of work per call (to report per-op time and throughput).
      sync: Callable run after each timed call on a GPU, to wait for the device
        (default: nothing; variants should return a tensor-free result or call
        ``.numpy()`` themselves when timing matters).
      params: Free-form parameters recorded in the JSON (size, threads, ...).
      goal: Optional ``(variant, max_ratio)``, ``(variant, "<=", max_ratio)`` or
        ``(variant, ">=", min_ratio)``: the issue's performance goal for that variant's
        median over the reference's; the report says whether it was met, missed or
        is inconclusive (see the module docstring).
      teardown: Optional callable run once after the case was measured.
      goal_reference: Optional variant name the goal's ratio is taken against, when it
        is not the baseline (e.g. ``update`` against a hand-written ``threading.Lock``).
        Default ``None``: the baseline (first variant).
      rounds_factor: This case takes ``rounds_factor`` times the suite's rounds (``--rounds``
        or the default), for cases whose rounds vary so much that the suite's count gives
        an interval too wide to decide their goal (``tf.data`` pipelines, whose speed
        switches between two modes, so one round's ratio swings by 0.5). An int
        ``>= 1``; every variant's ``rounds`` in ``results.json`` is the count taken.
    """

    family: str
    name: str
    variants: dict[str, Callable[[], Any]]
    ops_per_call: int = 1
    sync: Callable[[], Any] | None = None
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    goal: tuple[str, float] | tuple[str, str, float] | None = None
    teardown: Callable[[], Any] | None = None
    goal_reference: str | None = None
    rounds_factor: int = 1


@dataclasses.dataclass(frozen=True)
class LazyCase:
    """A case built when its turn comes (see the module docstring).

    Attributes:
      family: The family name.
      name: The name of the :class:`Case` that ``build`` returns (unique in the family;
        a resumed run matches finished cases by it).
      build: Builds the case (its models, variables, traced functions). Called once,
        right before the case is measured; the runner drops the case afterwards.
    """

    family: str
    name: str
    build: Callable[[], Case]


def goal_spec(goal: Any) -> tuple[str, str, float]:
    """``(variant, operator, bound)`` of a :class:`Case` goal.

    Raises:
      ValueError: ``goal`` is not ``(variant, bound)`` or ``(variant, "<=" | ">=",
        bound)`` with a positive bound.
    """
    if isinstance(goal, tuple) and len(goal) == 2:
        goal = (goal[0], "<=", goal[1])
    if (
        not isinstance(goal, tuple)
        or len(goal) != 3
        or not isinstance(goal[0], str)
        or goal[1] not in GOAL_OPERATORS
        or isinstance(goal[2], bool)
        or not isinstance(goal[2], (int, float))
        or not goal[2] > 0
    ):
        raise ValueError(
            f"a goal must be (variant, bound) or (variant, '<=' or '>=', bound) with a "
            f"positive bound, got {goal!r}."
        )
    return goal[0], goal[1], float(goal[2])


def size_label(size: int) -> str:
    """``scalar``, ``1K``, ``1M``, ``16M``..."""
    if size == 1:
        return "scalar"
    for suffix, scale in (("M", 1_000_000), ("K", 1_000)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{suffix}"
    return str(size)
