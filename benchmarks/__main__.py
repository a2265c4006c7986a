"""``python -m benchmarks``: the safevars benchmark suite (see ``--help``).

TensorFlow is imported by :func:`benchmarks.cli.main` once the arguments are parsed, with
its C++ start-up log hidden unless ``--verbose``.
"""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
