"""The applied-section tables, one per parameter server, and their watermark:
:class:`Tables` (checkpointed with the variables), :func:`tables` (this process's)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from safevars.distribute import on_parameter_server
from safevars.errors import InvalidArgumentError
from safevars.exactly_once import state
from safevars.exactly_once.state import _LOCK, _SECTION_BITS, _USER_TOKENS, _WATERMARK_KEY

__all__ = ["Tables", "tables"]


def _device_name(device: str) -> str:
    """The checkpoint name of the table of ``device``: ``ps_0`` for parameter server 0."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.job is None:
        return "local"
    return f"{spec.job}_{spec.task or 0}"


class Tables(tf.Module):
    """The applied-section tables of this coordinator: one per parameter server.

    A table maps each applied (token, section) key to 1 and holds the *watermark*:
    tokens below it were declared finished by :meth:`compact`. It lives on its
    parameter server, where sections look their keys up and record them, inside their
    locks. :func:`tables` returns this process's object; put it in the
    ``tf.train.Checkpoint`` that holds the variables the steps write::

        ckpt = tf.train.Checkpoint(model=model, optimizer=opt,
                                   exactly_once=exactly_once.tables(strategy))

    Its children are the tables, named by parameter-server task (``ps_0``, ...): a new
    coordinator with the same cluster layout restores each into the table of the same
    parameter server.

    Thread safety: a ``tf.train.Checkpoint`` save (``save``, ``write``, and so
    ``CheckpointManager.save``) whose object graph holds this object runs while no
    critical section over a lock of an exactly-once step runs: it holds the run-time
    mutex of every such lock from before the first value is read until the files are
    written (sections in progress finish first, the others wait). So a checkpoint holds
    a table entry exactly when it holds that section's writes, also while steps run.
    Restore before scheduling steps.

    Modes: eager, on the coordinator. The tables are anonymous resources: a coordinator
    never sees another's entries unless it restores them from a checkpoint.
    """

    def __init__(self) -> None:
        super().__init__(name="safevars_exactly_once")
        self._by_device: dict[str, Any] = {}
        self._floor = 0  # The watermark this process knows, when _floor_known.
        self._floor_known = True

    def table_for(self, device: str) -> Any:
        """The table of ``device`` (its parameter server), created the first time.

        Args:
          device: The device string of a parameter server's CPU (the device of the
            variables whose sections record there).

        Returns:
          The ``tf.lookup.experimental.MutableHashTable`` of that device, a child of
          this object named after the task (``ps_0``): a restore of this object
          (pending or done) fills it when it is created.

        Thread safety: created once per device, under a process-wide lock.

        Modes: eager or while tracing (the table is created outside the graph).
        """
        name = _device_name(device)
        with _LOCK:
            table = self._by_device.get(name)
            if table is not None:
                return table
            with tf.init_scope(), tf.device(device or None):
                # Anonymous: a table shared by name could hold another coordinator's keys.
                table = tf.lookup.experimental.MutableHashTable(
                    tf.int64,
                    tf.int64,
                    default_value=-1,
                    name=f"safevars_exactly_once_{name}",
                    checkpoint=True,
                    experimental_is_anonymous=True,
                )
            self._by_device[name] = table
            setattr(self, name, table)  # tracked: a deferred restore applies here
            self._floor_known = False  # which may bring a watermark
            return table

    def size(self) -> int:
        """Entries in every table, each table's watermark entry (once set) included.

        Thread safety: each table's count is read at the call; sections running
        meanwhile may add entries.

        Modes: eager, on the coordinator (one read per parameter server).
        """
        with tf.init_scope():
            return sum(int(t.size()) for t in list(self._by_device.values()))

    @property
    def watermark(self) -> int:
        """Tokens below this were declared finished (0: none); read from the tables.

        Thread safety: read at the call; it only goes up.

        Modes: eager, on the coordinator (one read per parameter server).
        """
        floor = 0
        with tf.init_scope():
            for table in list(self._by_device.values()):
                floor = max(floor, int(table.lookup(tf.constant(_WATERMARK_KEY, tf.int64))))
        self._floor, self._floor_known = floor, True
        return floor

    def _known_floor(self) -> int:
        """The watermark, read from the tables only after a restore (else remembered)."""
        return self._floor if self._floor_known else self.watermark

    def _restoring(self) -> None:
        self._floor_known = False

    def compact(self, below: int) -> int:
        """Declares every token below ``below`` finished and removes its entries.

        Call it with a token below which no step will be scheduled again: with token =
        step number, the first step not known to be ``"done"``. Afterwards a section of
        a token below the watermark writes nothing (it is discarded as a duplicate is,
        and counted in ``statistics().duplicates_discarded``), and :func:`schedule`
        refuses such a token with :class:`~safevars.InvalidArgumentError`. The
        watermark never goes down, and it is saved in checkpoints with the tables.

        Args:
          below: The new watermark, an ``int`` in ``[0, 2**42]``. Drawn tokens
            (``token=None``) are above every token you choose.

        Returns:
          The number of entries removed.

        Raises:
          InvalidArgumentError: ``below`` is not such an ``int``.

        Thread safety: safe while steps run. The watermark is raised before any entry
        is removed, and a section reads the watermark after its lookup: an attempt of a
        finished token is discarded whether it looks up before or after the removal.
        An attempt below ``below`` that had applied nothing and passed both checks just
        before may still record its entry; the next ``compact`` removes it.

        Modes: eager, on the coordinator; the removal runs on each parameter server.
        """
        if (
            isinstance(below, bool)
            or not isinstance(below, (int, np.integer))
            or not 0 <= below <= _USER_TOKENS
        ):
            raise InvalidArgumentError(
                f"compact(below) needs an int in [0, 2**{_USER_TOKENS.bit_length() - 1}] "
                f"(a token below which every step is finished), got {below!r}."
            )
        floor = self._known_floor()
        removed = 0
        for table in list(self._by_device.values()):
            removed += int(_compact_table(table, tf.constant(int(below), tf.int64)))
        self._floor = max(floor, int(below))
        return removed


@tf.function(autograph=False)
def _compact_table(table: Any, below: tf.Tensor) -> tf.Tensor:
    """Raises ``table``'s watermark to ``below``, then removes the entries under it."""
    with tf.device(table.resource_handle.device):
        watermark_key = tf.constant(_WATERMARK_KEY, tf.int64)
        floor = tf.reshape(tf.maximum(table.lookup(watermark_key), below), [])
        raised = table.insert(watermark_key, floor)
        with tf.control_dependencies([raised]):
            keys = tf.reshape(table.export()[0], [-1])
        dropped = tf.boolean_mask(
            keys, tf.logical_and(keys >= 0, keys < floor * (1 << _SECTION_BITS))
        )
        with tf.control_dependencies([table.remove(dropped)]):
            return tf.size(dropped)


def tables(strategy: Any = None) -> Tables:
    """This process's exactly-once tables, to checkpoint with the variables they protect.

    Example::

        once = exactly_once.tables(strategy)
        ckpt = tf.train.Checkpoint(model=model, exactly_once=once)
        manager = tf.train.CheckpointManager(ckpt, directory, max_to_keep=3)
        manager.restore_or_initialize()   # a new coordinator: before scheduling steps
        ...
        manager.save()                    # while steps run: tables and variables agree
        once.compact(below=first_step_not_done)   # keeps the tables bounded

    Args:
      strategy: A ``ParameterServerStrategy``: a table is created now on each of its
        parameter servers, so that a restore finds them. None: the tables created so
        far (a table is created when a section over a lock on its device is first
        traced in a scheduled step).

    Returns:
      The :class:`Tables` of this process (the same object at every call).

    Raises:
      InvalidArgumentError: ``strategy`` has no ``ps`` job.

    Thread safety: safe from any thread.

    Modes: eager, on the coordinator.
    """
    with _LOCK:
        if state.TABLES is None:
            state.TABLES = Tables()
        result = state.TABLES
    if strategy is not None:
        # The cluster's devices, as the coordinator connected to them.
        devices = [
            d.name for d in tf.config.list_logical_devices("CPU") if on_parameter_server(d.name)
        ]
        if not devices or not hasattr(strategy, "extended"):
            raise InvalidArgumentError(
                f"tables(strategy) needs a ParameterServerStrategy, on a coordinator "
                f"connected to parameter servers, got {strategy!r}. Pass None for the "
                "tables created so far."
            )
        for device in devices:
            result.table_for(device)
    return result
