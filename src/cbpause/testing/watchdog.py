"""A watchdog that fails a long run (the soak) when an operation, or the requests, make no progress within a bound."""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Watchdog"]


class Watchdog:
    """Fails the run when an operation outlives its bound; dumps every thread's stack first.

    ``ledger`` is a :class:`~cbpause.testing.Ledger`: while ``requests_expected`` is set, a run in which no request
    finished within the bound while some were open fails too.  ``name`` prefixes what it prints.
    """

    def __init__(self, bound: float, ledger: Any, name: str = "soak"):
        self.bound, self.ledger, self.name = bound, ledger, name
        self.ops: dict[int, tuple[str, float]] = {}
        self.lock = threading.Lock()
        self.hangs: list[str] = []
        self.failed = threading.Event()
        self.stopped = threading.Event()
        self.requests_expected = threading.Event()  # set while the loop should be making progress
        self.thread = threading.Thread(target=self._run, name=f"{name}-watchdog", daemon=True)
        self._next = 0

    @contextmanager
    def op(self, name: str) -> Iterator[None]:
        with self.lock:
            key, self._next = self._next, self._next + 1
            self.ops[key] = (name, time.monotonic() + self.bound)
        try:
            yield
        finally:
            with self.lock:
                self.ops.pop(key, None)

    def hang(self, what: str) -> None:
        self.hangs.append(what)
        print(f"{self.name}: HANG: {what}; every thread's stack follows", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        self.failed.set()

    def _run(self) -> None:
        while not self.stopped.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [name for name, deadline in self.ops.values() if deadline < now]
            if late:
                self.hang(f"{late[0]} made no progress within {self.bound} s")
                return
            if self.requests_expected.is_set() and self.ledger.open() and now - self.ledger.progress > self.bound:
                self.hang(f"no request finished within {self.bound} s while {self.ledger.open()} were open")
                return
