"""cbpause: a formally specified pause/stop/fatal-error protocol for
continuous-batching LLM generation loops.

The protocol is specified in prose (``spec/PROTOCOL.md``) and in TLA+
(``tla/PauseProtocol.tla``, model-checked by ``python -m cbpause.tlc``).
"""

__version__ = "0.1.0"
