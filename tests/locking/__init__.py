"""Tests of ``safevars/locking/``: locks, lock order, faults, versions, checkpoints."""
