"""Tests of ``safevars/sections/``: graph sections, coarsening, step spans, XLA."""
