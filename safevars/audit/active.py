"""The audits active now and the state they share.

``_ACTIVE`` (the detectors of the audits in progress) and ``_SESSION`` (their shared
happens-before state) are replaced, never mutated, by
``patching._activate`` and ``patching._deactivate``; every other module reads
them as ``active._ACTIVE`` / ``active._SESSION`` at the moment it needs them (a
``from ... import`` copy would go stale).
"""

from __future__ import annotations

from safevars.audit.clocks import _Session
from safevars.audit.happens_before import _DETECT_LOCK, _Access, _Detector

__all__ = ["_DETECT_LOCK"]  # Guards every detector, _ACTIVE and the function summaries.

_SESSION: _Session | None = None

_ACTIVE: tuple[_Detector, ...] = ()


def _deliver(accesses: list[_Access]) -> None:
    with _DETECT_LOCK:
        for detector in _ACTIVE:
            if not detector.closed:
                for access in accesses:
                    detector.observe(access)
