"""cbpause: a formally specified pause/stop/fatal-error protocol for continuous-batching LLM generation loops.

The protocol is specified in prose (``spec/PROTOCOL.md``) and in TLA+ (``tla/PauseProtocol.tla``,
model-checked by ``python -m cbpause.tlc``).  The folders are the layers:

* :mod:`cbpause.core`: the protocol, standard library only -- the pure transitions (one function per TLA+
  action), :class:`PauseProtocol` (one rank's side, thread-safe), the errors and the trace recorder;
* :mod:`cbpause.integrations`: the transformers integration, the only code that knows transformers' internals;
* :mod:`cbpause.tlc`: TLC, conformance and trace validation; :mod:`cbpause.testing`: what tests, benchmarks and
  the soak share; both read the core only;
* :mod:`cbpause.apps`: the applications (scenarios, bench, soak, hostile suite, demos, the docs' pictures),
  which nothing imports.
"""

from .core.dropin import PauseProtocol
from .core.errors import LoopPausedError, PeerParkTimeout
from .core.protocol import PauseHold, PauseMetrics, RankProtocol
from .core.recorder import TraceRecorder
from .core.transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED

__all__ = [
    "DONT_STOP",
    "FLUSH_AND_STOP",
    "HARD_STOP",
    "STOPPED",
    "LoopPausedError",
    "PauseHold",
    "PauseMetrics",
    "PauseProtocol",
    "PeerParkTimeout",
    "RankProtocol",
    "TraceRecorder",
]
__version__ = "0.1.0"
