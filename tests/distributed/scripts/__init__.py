"""The scripts the cluster harness runs as subprocesses, one cluster each (see ``cluster_harness``).

Run as scripts: each imports its neighbours ``script_common`` and ``loopback`` from its
own directory. Not test modules; a test may import one for its data only."""
