"""cbpause: a formally specified pause/stop/fatal-error protocol for
continuous-batching LLM generation loops.

The protocol is specified in prose (``spec/PROTOCOL.md``) and in TLA+
(``tla/PauseProtocol.tla``, model-checked by ``python -m cbpause.tlc``).
"""

from .protocol import PauseMetrics, PauseProtocol, PeerPauseTimeout
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED

__all__ = [
    "DONT_STOP",
    "FLUSH_AND_STOP",
    "HARD_STOP",
    "STOPPED",
    "PauseMetrics",
    "PauseProtocol",
    "PeerPauseTimeout",
]
__version__ = "0.1.0"
