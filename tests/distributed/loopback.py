"""TF_CONFIG for one worker of a MultiWorkerMirroredStrategy cluster on 127.0.0.1.

The ``*_mwms.py`` scripts take ``WORKER_INDEX PORT0,PORT1[,...]``: every worker gets the
same ports list and calls :func:`set_tf_config` before importing TensorFlow.
"""

from __future__ import annotations

import json
import os


def set_tf_config(index: int, ports: str) -> None:
    """Sets ``TF_CONFIG`` (and quiet TensorFlow logs) for worker ``index`` of ``ports``."""
    workers = [f"127.0.0.1:{p}" for p in ports.split(",")]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    )
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
