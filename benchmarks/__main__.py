"""``python -m benchmarks``: the safevars benchmark suite (see ``--help``)."""

import os
import sys

# Quiet TensorFlow's C++ start-up chatter before anything imports it.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
