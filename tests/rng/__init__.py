"""Tests of ``safevars/rng/``: ReplicaRNG and ReplicaStream."""
