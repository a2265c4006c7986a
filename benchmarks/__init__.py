"""The safevars benchmark suite: ``python -m benchmarks`` (see ``--help``).

Layout: :mod:`benchmarks.case` is the contract between the runner and the case families;
``bench_<family>.py`` modules are the families; :mod:`benchmarks.cli` parses the command
line; :mod:`benchmarks.discovery` finds the families; :mod:`benchmarks.devices` picks the
device and the sizes; :mod:`benchmarks.timing` times one case; :mod:`benchmarks.runner`
runs the selected families; :mod:`benchmarks.metadata`, :mod:`benchmarks.schema`,
:mod:`benchmarks.report` and :mod:`benchmarks.plots` describe and write the results.
"""
