"""cbpause: a formally specified pause/stop/fatal-error protocol for continuous-batching LLM generation loops.

The protocol is specified in prose (``spec/PROTOCOL.md``) and in TLA+ (``tla/PauseProtocol.tla``,
model-checked by ``python -m cbpause.tlc``).  This package's core is standard library only:

* :mod:`cbpause.transitions` and :mod:`cbpause.group`: the protocol's state changes as pure functions, one per
  TLA+ action, for one rank and for the whole group;
* :class:`PauseProtocol` (:mod:`cbpause.protocol`, :mod:`cbpause.loop`): one rank's side, thread-safe;
* :mod:`cbpause.errors` and :mod:`cbpause.recorder` (opt-in trace recording).

Around the core: :mod:`cbpause.tlc` (TLC, conformance, trace validation), :mod:`cbpause.testing` (what tests,
benchmarks and the soak share), :mod:`cbpause.integrations.transformers`, and the applications
``cbpause.bench``, ``cbpause.soak`` and ``cbpause.demo``.
"""

from .errors import LoopPausedError, PeerParkTimeout
from .protocol import PauseHold, PauseMetrics, PauseProtocol
from .recorder import TraceRecorder
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED

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
    "TraceRecorder",
]
__version__ = "0.1.0"
