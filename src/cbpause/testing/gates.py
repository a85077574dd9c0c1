"""Hold a loop at a chosen point of its iteration, or make it fail there: forced interleavings, no sleeps.

A :class:`StepGate` wraps one method of a :class:`~cbpause.PauseProtocol` for its next call from the loop's
thread: the loop then blocks right after the step (the rank stays in the phase the step leads to) until the
gate is released, or raises ``fail_with`` instead of taking the step (an exception in the loop's own code at
that phase).  Standard library only.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["StepGate"]


class StepGate:
    """Hold the loop after its next call of ``method`` (or fail it before the call).

    ``reached`` is set once the loop got there; :meth:`release` lets it go on.  The original method is put back
    before the gate lets the loop go, so that the gate acts once.
    """

    def __init__(self, protocol: Any, method: str, *, fail_with: BaseException | None = None, wait: float = 30.0):
        self.protocol, self.method, self.fail_with, self.wait = protocol, method, fail_with, wait
        self.reached = threading.Event()
        self._release = threading.Event()
        self._original = getattr(protocol, method)
        setattr(protocol, method, self._gated)

    def _gated(self, *args: Any, **kwargs: Any) -> Any:
        self.restore()
        if self.fail_with is not None:
            self.reached.set()
            raise self.fail_with
        result = self._original(*args, **kwargs)
        self.reached.set()
        self._release.wait(self.wait)
        return result

    def restore(self) -> None:
        """Put the original method back (the gate no longer acts)."""
        if self.protocol.__dict__.get(self.method) is not None:
            delattr(self.protocol, self.method)

    def release(self) -> None:
        self.restore()
        self._release.set()
