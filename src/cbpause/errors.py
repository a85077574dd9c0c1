"""The exceptions of the protocol."""

from __future__ import annotations

__all__ = ["PeerParkTimeout"]


class PeerParkTimeout(RuntimeError):
    """A rank was parked for a peer's pause and no local holder came within ``peer_park_timeout`` seconds
    (P-PEER-PARK-TIMEOUT, which fixes upstream's D3).  Recorded as the loop's fatal error."""
