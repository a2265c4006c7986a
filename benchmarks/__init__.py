"""The safevars benchmark suite: ``python -m benchmarks`` (see ``--help``).

Layout: :mod:`benchmarks.case` is the contract between the runner and the case families;
``bench_<family>.py`` modules are the families; :mod:`benchmarks.cli` parses the command
line (and ``--check``); :mod:`benchmarks.discovery` finds the families;
:mod:`benchmarks.devices` picks the device and the sizes; :mod:`benchmarks.timing` times
one case; :mod:`benchmarks.runner` runs the selected families, holding what TensorFlow
logs while a progress line is open (:mod:`benchmarks.logs`);
:mod:`benchmarks.tf_functions` builds the families' per-variant ``tf.function``s;
:mod:`benchmarks.metadata`, :mod:`benchmarks.schema`, :mod:`benchmarks.report` (the
120-column stdout table, ``results.md``) and :mod:`benchmarks.plots` describe and write
the results.
"""
