"""Integrations of :class:`cbpause.PauseProtocol` with generation loops; each needs its own extra."""
