"""Threads that tests start and join with a bound."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

__all__ = ["JOIN_TIMEOUT", "enter_and_leave", "run_thread"]

JOIN_TIMEOUT = 10.0  # seconds: the bound on joining a thread that must end


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
