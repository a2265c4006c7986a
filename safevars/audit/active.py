"""The audits active now and the state they share.

``_ACTIVE`` (the detectors of the audits in progress) and ``_SESSION`` (their shared
happens-before state) are replaced, never mutated, by
``patching._activate`` and ``patching._deactivate``; every other module reads
them as ``active._ACTIVE`` / ``active._SESSION`` at the moment it needs them (a
``from ... import`` copy would go stale).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from safevars.audit.happens_before import _Access, _Detector, _Session

_SESSION: _Session | None = None

# Guards every detector, ``_ACTIVE`` and the traced-function summaries.
_DETECT_LOCK = threading.Lock()

_ACTIVE: tuple[_Detector, ...] = ()


def _deliver(accesses: list[_Access]) -> None:
    with _DETECT_LOCK:
        for detector in _ACTIVE:
            if not detector.closed:
                for access in accesses:
                    detector.observe(access)
