"""Tests of ``safevars/accumulator/``: GradientAccumulator."""
