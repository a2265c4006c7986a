"""Subprocess clusters: the harness the tests call (parent side) and, in ``scripts/``, what it runs."""
