"""Tests of ``safevars/data/``: ShardedInput."""
