"""TRL's ``AsyncGRPOTrainer`` with its engines in other processes: ``cbpause serve`` servers driven by a
:class:`cbpause.client.Fleet` (issue 42; TRL 1.16.x, ``pip install 'cbpause[trl,serve]'``).

* :class:`FleetWeightSync`, the trainer's ``weight_transfer``: ``pause()`` takes the fleet's pause (a lease on every
  server, renewed in the background), ``send_weights()`` sends the trainer's parameters by broadcast over the fleet's
  weight-update group (``Fleet.update_weights_from_distributed``: a failed transfer leaves each server's weights as
  they were, or torn and refusing generation until the next complete sync, R-TORN-HOLD) and labels them with the sync
  count, ``resume()`` lets the servers go.
* :class:`FleetEngine`, what :class:`~cbpause.integrations.trl.CBRolloutWorker` drives in place of an in-process
  manager: each request is a completion on one of the servers (in turn), a prompt of token ids asking for the
  tokens' log-probabilities and their ids back (``logprobs: 0``, ``return_token_ids: true``, as TRL's own rollout
  worker asks vLLM), whose answer carries their weight versions too.  So the rollout worker is TRL's
  ``rollout_worker`` unchanged: ``CBRolloutWorker(FleetEngine(urls), ...)``.  (TRL's own worker against
  ``cbpause serve``, with no cbpause code on the trainer's side but the weight sync, is docs/trl.md's first way.)

Decisions: each request is sampled with ``sampling`` (OpenAI's and vLLM's arguments: ``temperature``, ``top_p``,
``top_k``...), else the server's checkpoint's generation config; a request a server refuses during a pause (``503``)
is sent again after its ``Retry-After``, as the server asks; a request ended by an ``abort`` pause or the staleness
bound comes back as the in-process engine's error, which the worker submits again; any other failure fails the
worker.  Neither class imports the client: the fleet is the caller's.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .modes import ABORTED_BY_PAUSE

__all__ = ["FleetEngine", "FleetWeightSync"]

logger = logging.getLogger("cbpause")


class FleetWeightSync:
    """TRL's ``WeightTransferProtocol`` over a fleet of ``cbpause serve`` servers (``fleet``: a
    :class:`cbpause.client.Fleet`).  ``master_address``: where the servers reach this process's weight-update group;
    ``mode``, ``timeout``, ``ttl``: the fleet's pause.  The servers' weight version after sync ``n`` is ``n``, as
    :class:`~cbpause.integrations.trl.PauseWeightSync` labels it."""

    def __init__(self, fleet: Any, *, master_address: str = "127.0.0.1", backend: str = "gloo", mode: str = "keep",
                 timeout: float = 60.0, ttl: float = 30.0, group_timeout: float = 60.0) -> None:  # fmt: skip
        self.fleet, self.master_address, self.backend = fleet, master_address, backend
        self.mode, self.timeout, self.ttl, self.group_timeout = mode, timeout, ttl, group_timeout
        self.syncs = 0
        self._pause: Any = None

    def init_weight_transfer(self) -> None:
        """Form the weight-update group with every server (``FleetError`` naming those that did not join)."""
        if self.fleet.weight_group is None:
            self.fleet.init_weights_update_group(self.master_address, backend=self.backend,
                                                 timeout=self.group_timeout)  # fmt: skip

    def pause(self) -> None:
        if self._pause is not None:
            raise RuntimeError("pause(): this weight sync holds the fleet's pause already (resume() it first)")
        context = self.fleet.pause(mode=self.mode, timeout=self.timeout, ttl=self.ttl)
        context.__enter__()
        self._pause = context

    def send_weights(self, iterator: Any) -> None:
        """Every ``(name, tensor)`` to every server, by broadcast; the version is the new sync count.  A transfer that
        failed raises ``FleetError``: each server's weights are as they were, or torn (refusing generation until the
        next complete sync mends them); the group, closed by it, is formed again at the next sync."""
        if self._pause is None:
            raise RuntimeError("send_weights() outside pause(): the servers would generate while the weights change")
        pairs = [(name, tensor.detach()) for name, tensor in iterator]
        if not pairs:
            raise ValueError("send_weights() got no tensor: nothing was synced, and the weight version is unchanged")
        if self.fleet.weight_group is None:  # a failed transfer closed it
            self.init_weight_transfer()
        self.fleet.update_weights_from_distributed(pairs, weight_version=self.syncs + 1)
        self.syncs += 1

    def resume(self) -> None:
        if self._pause is None:
            raise RuntimeError("resume() without pause()")
        context, self._pause = self._pause, None
        context.__exit__(None, None, None)

    def destroy(self) -> None:
        """Release the fleet's pause if still held and end the weight-update group; never raises (TRL calls it in a
        ``finally``)."""
        try:
            if self._pause is not None:
                self.resume()
            self.fleet.destroy_weights_update_group()
        except Exception:
            logger.exception("FleetWeightSync.destroy() failed")


@dataclass
class _Answer:
    """What :class:`~cbpause.integrations.trl.CBRolloutWorker` reads of an engine's output."""

    request_id: str
    generated_tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    weight_versions: list = field(default_factory=list)
    error: str | None = None


class _Status:
    fatal_error: BaseException | None = None


class _Config:
    return_logprobs = True


# The sampling arguments a FleetEngine passes on with each request (cbpause serve's, vLLM's names).
SAMPLING_ARGUMENTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class FleetEngine:
    """The part of a cbpause manager that :class:`~cbpause.integrations.trl.CBRolloutWorker` uses, answered by
    ``cbpause serve`` servers.  ``max_in_flight`` requests at once (threads); ``api_key`` as the fleet's (default:
    ``$CBPAUSE_API_KEY``); ``sampling``: the sampling arguments sent with every request (a dict of
    :data:`SAMPLING_ARGUMENTS`; ``ValueError`` for another key), each request with a seed of its own."""

    def __init__(self, urls: list[str], *, max_in_flight: int = 16, api_key: str | None = None,
                 request_timeout: float = 300.0, sampling: dict | None = None) -> None:  # fmt: skip
        import os

        import httpx

        self.urls = [u.rstrip("/") for u in urls] if isinstance(urls, (list, tuple)) else []
        if not self.urls or not all(isinstance(u, str) for u in self.urls):
            raise ValueError(f"FleetEngine needs a list of one or more server URLs, not {urls!r}")
        self.sampling = dict(sampling or {})
        unknown = set(self.sampling) - set(SAMPLING_ARGUMENTS)
        if unknown:
            raise ValueError(f"unknown sampling arguments {sorted(unknown)}: one of {list(SAMPLING_ARGUMENTS)}")
        api_key = api_key if api_key is not None else os.environ.get("CBPAUSE_API_KEY") or None
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._http = httpx.Client(timeout=request_timeout, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="cbpause-fleet-engine")
        self._results: queue.Queue = queue.Queue()
        self._ids, self._next = itertools.count(), itertools.cycle(range(len(self.urls)))
        # Two engines (two workers, two trainers) on one server must never send the same id: the server refuses an
        # id still in flight, and a trace names each request by it.
        self._prefix = f"fleet-{secrets.token_hex(6)}"
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.background_thread_status = _Status()
        self.continuous_batching_config = _Config()

    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> str | None:
        if self._closed:
            return None
        request_id = f"{self._prefix}-{next(self._ids)}"
        url = self.urls[next(self._next)]
        self._pool.submit(self._complete, url, request_id, list(prompt_ids), max_new_tokens)
        return request_id

    def get_result(self, timeout: float | None = None) -> _Answer | None:
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel_request(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)

    def is_running(self) -> bool:
        return self.background_thread_status.fatal_error is None and not self._closed

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def _complete(self, url: str, request_id: str, prompt_ids: list[int], max_new_tokens: int) -> None:
        body = {"prompt": prompt_ids, "max_tokens": max_new_tokens, "logprobs": 0, "return_token_ids": True,
                "seed": random.getrandbits(63), **self.sampling}  # fmt: skip
        try:
            while True:
                with self._lock:
                    if request_id in self._cancelled or self._closed:
                        return
                r = self._http.post(url + "/v1/completions", json=body, headers={"x-request-id": request_id})
                if r.status_code == 503 and "Retry-After" in r.headers:
                    detail = r.text[:300]
                    if "aborted" in detail:  # an abort pause or the staleness bound ended it: the worker resubmits
                        self._results.put(_Answer(request_id, error=f"{ABORTED_BY_PAUSE} (on {url}): {detail}"))
                        return
                    time.sleep(_retry_after(r.headers["Retry-After"]))  # refused during a pause: sent again, as asked
                    continue
                break
            if r.status_code != 200:
                self._results.put(_Answer(request_id, error=f"{url} answered {r.status_code}: {r.text[:300]}"))
                return
            choice = r.json()["choices"][0]
            tokens, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            if len(tokens) != len(logprobs) or choice.get("prompt_token_ids") != prompt_ids:
                raise RuntimeError(f"{url} answered {len(tokens)} tokens with {len(logprobs)} log-probabilities, for "
                                   f"the prompt {choice.get('prompt_token_ids')} (sent: {prompt_ids})")  # fmt: skip
            # A label that is not an integer (a PartialSync, as text) is no policy: the worker counts it as -1.
            versions = [(start, version) for start, version in choice.get("weight_versions", [])]
            self._results.put(_Answer(request_id, tokens, logprobs, versions))
        except Exception as error:  # noqa: BLE001 -- the worker sees it as a failed request
            self._results.put(_Answer(request_id, error=f"{type(error).__name__}: {error}"))


MAX_RETRY_AFTER_S = 30.0  # however long a server asks a refused request to wait: close() waits for that sleep


def _retry_after(header: str) -> float:
    """A ``Retry-After`` in seconds, within ``[0.05, MAX_RETRY_AFTER_S]`` (1 s when it is not a number)."""
    try:
        seconds = float(header)
    except ValueError:
        return 1.0
    return min(max(seconds, 0.05), MAX_RETRY_AFTER_S) if seconds == seconds else 1.0
