"""Threads that tests start and join with a bound."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

__all__ = ["HANG_S", "JOIN_TIMEOUT", "enter_and_leave", "run_thread"]

# Seconds after which something that must happen (a thread ends, an output arrives, a window opens) is taken to hang.
# Generous on purpose: it only turns a hang into a failure, and it must never fail a run that is merely slow (a loaded
# CI machine can be ten times slower than an idle one).  Progress is asserted by events, never by elapsed time; a
# test that measures time is a benchmark (nox -s bench).  One value for every such wait of the tests and the tools.
HANG_S = 300.0
JOIN_TIMEOUT = HANG_S  # the bound on joining a thread that must end


def run_thread(target: Callable[[], object], name: str = "holder") -> tuple[threading.Thread, dict]:
    """Start ``target`` in a daemon thread; the dict gets ``result`` or ``error``."""
    box: dict = {}

    def wrapper() -> None:
        try:
            box["result"] = target()
        except BaseException as exc:  # noqa: BLE001 - the caller inspects it
            box["error"] = exc

    thread = threading.Thread(target=wrapper, name=name, daemon=True)
    thread.start()
    return thread, box


def enter_and_leave(context: AbstractContextManager) -> None:
    """Enter a context (a pause) and leave it at once: a lambda cannot hold a ``with`` statement."""
    with context:
        pass
