"""Tests of ``safevars/optimizer/``: SafeOptimizer."""
