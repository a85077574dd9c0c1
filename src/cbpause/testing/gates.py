"""Hold a loop at a chosen point of its iteration, or make it fail there: forced interleavings, no sleeps.

A :class:`StepGate` wraps one method of a :class:`~cbpause.PauseProtocol` for its next call: the loop then
blocks right after the step (the rank stays in the phase the step leads to), or right before it with
``before=True``, until the gate is released; or raises ``fail_with`` instead of taking the step (an exception
in the loop's own code at that phase); or runs ``then`` there.  :func:`wait_for_phase` waits for a rank to
reach a phase that a notifying step leads to (a window, a park, a stop).  Standard library only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .threads import HANG_S

__all__ = ["StepGate", "wait_for_phase"]


class StepGate:
    """Hold the loop at its next call of ``method`` (see the module's docstring); acts once.

    ``reached`` is set once the loop got there; :meth:`release` lets it go on.  The original method is put back
    before the gate acts.
    """

    def __init__(self, protocol: Any, method: str, *, before: bool = False, fail_with: BaseException | None = None,
                 then: Callable[[], object] | None = None, wait: float = HANG_S):  # fmt: skip
        self.protocol, self.method, self.before, self.fail_with = protocol, method, before, fail_with
        self.then, self.wait = then, wait
        self.reached = threading.Event()
        self._release = threading.Event()
        self._original = getattr(protocol, method)
        setattr(protocol, method, self._gated)

    def _hold(self) -> None:
        self.reached.set()
        if self.then is not None:
            self.then()
        else:
            self._release.wait(self.wait)

    def _gated(self, *args: Any, **kwargs: Any) -> Any:
        self.restore()
        if self.fail_with is not None:
            self.reached.set()
            raise self.fail_with
        if self.before:
            self._hold()
            return self._original(*args, **kwargs)
        result = self._original(*args, **kwargs)
        self._hold()
        return result

    def restore(self) -> None:
        """Put the original method back (the gate no longer acts)."""
        if self.protocol.__dict__.get(self.method) is not None:
            delattr(self.protocol, self.method)

    def release(self) -> None:
        self.restore()
        self._release.set()


def wait_for_queued(protocol: Any, timeout: float, n: int = 1) -> bool:
    """Wait until ``n`` holders are queued at ``protocol``'s closing window (P-QUEUE-PAUSE); False after
    ``timeout`` seconds."""
    with protocol._lock:
        return protocol._condition.wait_for(lambda: protocol._queued_now() >= n, timeout)


def wait_for_phase(protocol: Any, phases: str | tuple[str, ...], timeout: float) -> bool:
    """Wait until ``protocol``'s rank is in one of ``phases``; False after ``timeout`` seconds.

    Only for phases reached by a step that wakes the protocol's waiters (a window opening or closing, a park
    for a peer, a stop): the steady loop's steps wake nobody; hold it with a :class:`StepGate` instead.
    """
    phases = (phases,) if isinstance(phases, str) else phases
    with protocol._lock:
        return protocol._condition.wait_for(lambda: protocol.state.phase in phases, timeout)
