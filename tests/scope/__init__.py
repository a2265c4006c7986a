"""Tests of ``safevars/creator_scope.py``: safevars.scope()."""
