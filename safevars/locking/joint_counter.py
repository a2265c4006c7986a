"""JointCounter: one counter whose value adds to the version of each of its members.

The counter itself; which guards get one and how a step adds to it is
:mod:`safevars.locking.joint_versions`. Below :mod:`~safevars.locking.guard` (a guard
holds its counter), so it knows a member only as :class:`Counted`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import tensorflow as tf

from safevars import _tf_internal as tfi

__all__ = ["Counted", "JointCounter"]


class Counted(Protocol):
    """A member of a joint counter (a :class:`~safevars.locking.Guard`)."""

    joint: JointCounter | None


class JointCounter:
    """The counter whose value adds to the version of each of its members.

    Attributes:
      variable: The int64 scalar resource variable, on the members' device.
      size: How many guards it counts for.
    """

    __slots__ = ("variable", "size", "__weakref__")

    def __init__(self, guards: Sequence[Counted], device: str) -> None:
        with tf.init_scope(), tf.device(device):
            self.variable = tfi.ResourceVariable(
                initial_value=tf.constant(0, tf.int64),
                trainable=False,
                name="safevars_joint_versions",
                shape=(),
            )
        self.size = len(guards)

    def counts_exactly(self, guards: Sequence[Counted]) -> bool:
        """Whether ``guards`` (distinct) are exactly this counter's members."""
        if len(guards) != self.size or len({id(g) for g in guards}) != self.size:
            return False
        return all(g.joint is self for g in guards)

    def value(self) -> int:
        """The counter, eagerly (the caller holds a member's lock)."""
        return int(self.variable.numpy())
