"""The exceptions of the protocol."""

from __future__ import annotations

__all__ = ["LoopPausedError", "PeerParkTimeout"]


class PeerParkTimeout(RuntimeError):
    """A rank was parked for a peer's pause and no local holder came within ``peer_park_timeout`` seconds
    (P-PEER-PARK-TIMEOUT, which fixes upstream's D3).  Recorded as the loop's fatal error."""


class LoopPausedError(RuntimeError):
    """``add_request`` on a manager built with ``while_paused="reject"`` while a pause is asked or held (spec
    R-ADMISSION): nothing was enqueued, and the same call may be retried once the pause is over."""
