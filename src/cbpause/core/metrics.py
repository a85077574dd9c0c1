"""``PauseMetrics``: what :meth:`cbpause.PauseProtocol.metrics` reports, a read-only snapshot."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PauseMetrics"]


@dataclass(frozen=True)
class PauseMetrics:
    """A read-only snapshot of :meth:`PauseProtocol.metrics`."""
    pauses_taken: int
    """Holders that entered a pause since construction."""
    holders_inside: int
    holders_waiting: int
    windows_opened: int
    total_paused_s: float
    """Time the window was open, summed over closed windows."""
    last_paused_s: float | None
    """How long the last closed window was open."""
    last_entry_latency_s: float | None
    """From the request to the entry of the last holder that entered."""
    open_window_s: float | None = None
    """How long the window now open has been open (None while none is): a window that does not close shows here,
    where ``total_paused_s`` counts closed windows only."""
    open_window_entries: int = 0
    """How many holders entered the window now open (0 while none is)."""
    window_closing: bool = False
    """The open window admits no newcomer: a holder has left it or given up on it (R-WINDOW-CLOSES)."""
    holders_queued: int = 0
    """Holders that asked while the window was closing and wait for it to close (P-QUEUE-PAUSE), counted in
    neither ``holders_waiting`` nor ``holders_inside`` until then."""
