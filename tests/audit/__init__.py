"""Tests of ``safevars/audit/``: audit()."""
