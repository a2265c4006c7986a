"""What the cluster scripts share: their command-line header, hang dumps, results as text,
and deadlines scaled as the tests' are.

Every script prints one JSON line that a test reads (``tests/distributed/cluster_harness.py``);
arrays go into it as the hex of their bytes, so a test compares them bitwise, and a
safevars error as ``"ClassName: message"``. Nothing here imports TensorFlow at import
time: the ``*_mwms.py`` scripts must set ``TF_CONFIG`` before TensorFlow is imported.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import runpy
from collections.abc import Callable, Iterable
from typing import Any

#: Seconds times ``SAFEVARS_TEST_TIMEOUT_SCALE`` (inherited from the test's environment):
#: ``tests/support/deadlines.py``, run from its file, since the scripts run outside the
#: ``tests`` package (putting the checkout on ``sys.path`` would make them import its
#: safevars instead of the installed one, and the version matrix tests a wheel).
scaled: Callable[[float], float] = runpy.run_path(
    os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "support", "deadlines.py")
)["scaled"]


def parser(worker: bool = False, seed: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the header of the scripts.

    Args:
      worker: A MultiWorkerMirrored worker script: positional ``WORKER_INDEX`` and
        ``PORT0,PORT1[,...]`` (every worker gets the same list).
      seed: A required ``--seed``.
    """
    result = argparse.ArgumentParser()
    if worker:
        result.add_argument("index", type=int)
        result.add_argument("ports")
    if seed:
        result.add_argument("--seed", type=int, required=True)
    result.add_argument(
        "--dump-after",
        type=float,
        default=0.0,
        help="print every thread's stack and exit after this many seconds",
    )
    result.add_argument(
        "--blocks",
        action="store_true",
        help="deterministic accumulators of gradients from 4 elements store blocks of "
        "2-element rows, the first ones kept by reference (the layout of large models)",
    )
    return result


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses the command line; with ``--dump-after T`` a hang prints the stacks at T."""
    args = parser.parse_args()
    if args.blocks:  # before any accumulator is made
        from safevars.accumulator import state

        state._CHUNK, state._DIRECT = 2, 4
    if args.dump_after > 0:  # A hang shows where it hangs instead of only timing out.
        faulthandler.dump_traceback_later(args.dump_after, exit=True)
    return args


def hexes(values: Iterable[Any]) -> list[str]:
    """Each array (or tensor) as the hex of its bytes."""
    import numpy as np

    return [np.asarray(v).tobytes().hex() for v in values]


def error_of(call: Callable[[], Any]) -> str:
    """``"ClassName: message"`` of the safevars error ``call`` raises, or ``"no error"``."""
    from safevars.errors import SafeVarsError

    try:
        call()
    except SafeVarsError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
