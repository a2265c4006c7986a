"""Tests of ``safevars/variable/``: SafeVariable, its writes and their errors."""
