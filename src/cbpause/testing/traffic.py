"""Requests flowing through a manager while a test, the soak or a trace scenario does its worst to the loop.

:class:`Traffic` keeps a number of requests in flight (random prompts and lengths, some cancelled at once), and
records every terminal output in a :class:`Ledger`, which says at the end how many accepted requests got none
(lost) or more than one (duplicated).  Standard library only: the manager is whatever has transformers'
``add_request``/``cancel_request``/``get_result``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from .threads import JOIN_TIMEOUT

__all__ = ["Ledger", "Traffic"]


class Ledger:
    """Every accepted request and the terminal outputs it received."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outputs: dict[str, int] = {}
        self.waiting: set[str] = set()  # accepted, no output yet: read every few ms, so kept, not scanned
        self.progress = time.monotonic()
        self.cancelled = 0
        self.errors: list[str] = []  # the error of every failed output, in order
        self.label_faults: list[str] = []  # outputs whose version labels break R-VERSIONS or R-KV-VERSIONS

    def submitted(self, rid: str) -> None:
        with self.lock:
            self.outputs[rid] = 0
            self.waiting.add(rid)

    def delivered(self, rid: str, error: str | None = None) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(error)
            self.outputs[rid] = self.outputs.get(rid, 0) + 1
            self.waiting.discard(rid)
            self.progress = time.monotonic()

    def check_labels(self, out: Any) -> None:
        """R-VERSIONS and R-KV-VERSIONS on one output of a manager whose versions are integers (``None`` before the
        first): the spans cover its tokens, each label never decreases along them, and no token's KV is newer than
        its weights.  A fault is kept in ``label_faults``."""
        weights, kv = getattr(out, "weight_versions", None), getattr(out, "kv_versions", None)
        n = len(out.generated_tokens)
        logprobs = getattr(out, "logprobs", None)
        if logprobs and len(logprobs) != n:  # a manager that returns them gives one per token (R-SAMPLING)
            with self.lock:
                self.label_faults.append(f"{out.request_id}: {n} tokens, {len(logprobs)} log-probabilities")
        if weights is None or kv is None or n == 0:
            return
        try:
            w, k = _per_token(weights, n), _per_token(kv, n)
            ok = w == sorted(w) and k == sorted(k) and all(x <= y for x, y in zip(k, w, strict=True))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            with self.lock:
                self.label_faults.append(f"{out.request_id}: {n} tokens, weights {weights}, kv {kv}")

    def open(self) -> int:
        """How many accepted requests have had no output yet."""
        with self.lock:
            return len(self.waiting)

    def lost_and_duplicated(self) -> tuple[int, int]:
        with self.lock:
            return sum(n == 0 for n in self.outputs.values()), sum(n > 1 for n in self.outputs.values())


def _per_token(spans: list, n: int) -> list[int]:
    """Each of ``n`` tokens' label from ``(first_index, version)`` spans (``None`` read as -1); ``ValueError`` unless
    the spans start at token 0 and stay within the tokens."""
    if not spans or spans[0][0] != 0 or any(first >= n for first, _ in spans):
        raise ValueError(spans)
    bounds = [first for first, _ in spans[1:]] + [n]
    return [-1 if v is None else v for (first, v), end in zip(spans, bounds, strict=True) for _ in range(first, end)]


class Traffic:
    """A feeder that keeps ``in_flight`` requests submitted to ``manager`` (a share of them cancelled at once), and
    a consumer that records every terminal output in ``ledger``.

    :meth:`start` starts both threads; :meth:`stop_feeding` ends the feeder; once the loop has stopped for good,
    :meth:`finish` lets the consumer drain what is left and joins it.
    """

    def __init__(self, manager: Any, vocab_size: int, max_new_tokens: int, *, in_flight: int = 8, seed: int = 0,
                 cancel_rate: float = 0.1, join_timeout: float = JOIN_TIMEOUT,
                 sampling: Callable[[random.Random], Any] | None = None):  # fmt: skip
        self.manager, self.vocab_size, self.max_new = manager, vocab_size, max_new_tokens
        # For a manager that samples per request: most requests get sampling(rng) (a SamplingParams), the others the
        # manager's default.
        self.sampling = sampling
        self.in_flight, self.cancel_rate, self.join_timeout = in_flight, cancel_rate, join_timeout
        self.rng = random.Random(seed)
        self.ledger = Ledger()
        self.requests = 0
        self._done = threading.Event()  # no more requests
        self._finished = threading.Event()  # the loop has stopped for good
        self._feeder = threading.Thread(target=self._feed, name="traffic-feeder", daemon=True)
        self._consumer = threading.Thread(target=self._consume, name="traffic-consumer", daemon=True)

    def start(self) -> Traffic:
        self._feeder.start()
        self._consumer.start()
        return self

    def _feed(self) -> None:
        rng = self.rng
        while not self._done.is_set():
            if self.ledger.open() < self.in_flight:
                prompt = [rng.randrange(1, self.vocab_size) for _ in range(rng.randrange(3, 12))]
                extra = {"sampling": self.sampling(rng)} if self.sampling and rng.random() < 0.7 else {}
                rid = self.manager.add_request(prompt, max_new_tokens=rng.randrange(4, self.max_new + 1), **extra)
                if rid is not None:  # None: refused while stopping or stopped (upstream's contract)
                    self.ledger.submitted(rid)
                    self.requests += 1
                    if rng.random() < self.cancel_rate:
                        self.manager.cancel_request(rid)
                        self.ledger.cancelled += 1
            self._done.wait(0.002)

    def _consume(self) -> None:
        while True:
            out = self.manager.get_result(timeout=0.05)
            if out is not None:
                self.ledger.check_labels(out)
                self.ledger.delivered(out.request_id, out.error)
            elif self._finished.is_set():
                return  # the loop has stopped for good: every output is already in the queue
            else:
                self._finished.wait(0.01)  # get_result returns at once while the loop is down

    def stop_feeding(self) -> None:
        self._done.set()
        self._feeder.join(self.join_timeout)

    def finish(self) -> tuple[int, int]:
        """After the loop's last stop: drain the outputs; (lost, duplicated)."""
        self.stop_feeding()
        self._finished.set()
        self._consumer.join(self.join_timeout)
        return self.ledger.lost_and_duplicated()
