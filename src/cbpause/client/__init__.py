"""The trainer's side of ``cbpause serve``: pause a fleet of servers, update their weights, let them go (issue 29).

``Fleet([urls])``: ``with fleet.pause(mode=..., timeout=..., ttl=...)`` takes a lease on every server (in parallel),
renews them in the background while the block runs, and resumes them all when it ends; inside,
``fleet.update_weights_from_disk(path, version)`` makes every server load the safetensors files at ``path``.  The
actions are ``FleetPause.tla``'s: ``TrainerPause``, ``TrainerRenew``, ``TrainerWrite``, ``TrainerRelease``.

Decisions, each one a property the model checks:

* all or nothing: if any server cannot be paused within ``timeout``, the leases already taken are resumed and
  :class:`FleetError` names every server that failed and why;
* a trainer that dies holding leases leaves every server running again within the ttl (the servers expire the
  leases; nothing on the trainer's side is needed);
* a write goes only under a lease; a server whose lease was lost (a renewal refused: it expired) is not written to,
  and a write a server refuses is reported: :class:`FleetError` lists the servers that missed the update (and
  ``updated`` those that took it), so that the trainer never believes a server has weights it has not;
* leaving the block never raises: a resume that fails is logged; that lease expires on its own within its ttl.

Needs ``httpx`` (the ``serve`` extra) and nothing else of cbpause.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx

__all__ = ["Fleet", "FleetError"]

logger = logging.getLogger("cbpause.client")

RENEWALS_PER_TTL = 3  # renew every ttl / 3: two renewals may be lost before a lease expires
SIGNAL_CHECK_S = 0.2  # how soon a Ctrl-C interrupts a wait for the servers' pauses


MODES = ("keep", "retract", "drain", "abort")  # the server's (cbpause.serve.control.MODES; a test checks they agree)


def _seconds(name: str, value: Any, *, none: bool, zero: bool) -> float | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds{' or None' if none else ''}, not {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be {'non-negative' if zero else 'positive'}, not {value!r}")
    return float(value)


class FleetError(RuntimeError):
    """Some servers did not do what the fleet asked: ``failed`` maps each one's URL to the reason; ``updated`` lists
    the servers that did (for an update)."""

    def __init__(self, what: str, failed: dict[str, str], updated: Iterable[str] = ()) -> None:
        self.failed, self.updated = dict(failed), list(updated)
        detail = "; ".join(f"{url}: {reason}" for url, reason in self.failed.items())
        super().__init__(f"{what} on {len(self.failed)} server(s): {detail}")


class Fleet:
    """A set of ``cbpause serve`` servers (their base URLs).  ``holder`` names this trainer in the servers' logs
    (default: host and process id).  ``request_timeout``: seconds for a control request beyond the pause's own
    timeout.  ``api_key``: the servers' ``--api-key`` (default: ``$CBPAUSE_API_KEY``), sent as a bearer token.
    Thread-safe for one pause at a time."""

    def __init__(self, urls: Iterable[str], *, holder: str | None = None, request_timeout: float = 10.0,
                 api_key: str | None = None, transport: Any = None) -> None:  # fmt: skip
        self.urls = [str(u).rstrip("/") for u in urls]
        if not self.urls or len(set(self.urls)) != len(self.urls):
            raise ValueError(f"a fleet needs one or more distinct server URLs, not {self.urls!r}")
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.request_timeout = _seconds("request_timeout", request_timeout, none=False, zero=False)
        api_key = api_key if api_key is not None else os.environ.get("CBPAUSE_API_KEY") or None
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._client_options = {"timeout": request_timeout, "transport": transport, "headers": headers}
        self._http = httpx.Client(**self._client_options)
        self.leases: dict[str, str] = {}  # url -> lease id, while a pause is held
        self.lost: dict[str, str] = {}  # url -> why its lease was lost during the pause held now
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- the trainer's calls

    @contextmanager
    def pause(self, mode: str = "keep", timeout: float | None = 30.0, ttl: float = 10.0) -> Iterator[Fleet]:
        """``TrainerPause`` on every server; renewals while the block runs; ``TrainerRelease`` at its end.

        ``timeout``: seconds each server may take to open its window (``None``: no limit); ``ttl``: seconds a lease
        lives without a renewal (renewed every ``ttl / 3``).  Both are checked here, before any server is asked
        (``ValueError``).  A server that answers without a lease id counts as failed; whatever fails, the leases
        already taken are resumed before :class:`FleetError` is raised, and so they are if the call is interrupted.
        """
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, not {mode!r}")
        timeout = _seconds("timeout", timeout, none=True, zero=True)
        ttl = _seconds("ttl", ttl, none=False, zero=False)
        if self.leases:
            raise RuntimeError("this fleet already holds a pause: leave it first")
        body = {"mode": mode, "timeout": timeout, "ttl": ttl, "holder": self.holder}
        wait = None if timeout is None else timeout + self.request_timeout
        taken, failed = self._pause_each(body, wait, forever=timeout is None)
        if failed:
            self._release(taken)
            raise FleetError("could not pause", failed)
        self.leases, self.lost = taken, {}
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew, args=(stop, ttl / RENEWALS_PER_TTL), daemon=True,
                                   name="cbpause-fleet-renewer")  # fmt: skip
        renewer.start()
        try:
            yield self
        finally:
            stop.set()
            renewer.join(timeout=self.request_timeout + 5)
            leases, self.leases = self.leases, {}
            self._release(leases)

    def update_weights_from_disk(self, path: str, weight_version: Any = None) -> list[str]:
        """``TrainerWrite``: every server loads the safetensors files at ``path`` (as the servers see it, inside their
        ``--weights-dir``) and labels its tokens ``weight_version``.  Returns the servers updated; ``FleetError``
        (``failed``, ``updated``) when some were not (their lease lost, a refusal, no answer)."""
        return self._write("/update_weights_from_disk", {"path": path, "weight_version": weight_version})

    def update_weight_version(self, weight_version: Any) -> list[str]:
        """Every server labels its tokens ``weight_version`` from the resume on (weights changed by other means)."""
        return self._write("/update_weight_version", {"weight_version": weight_version})

    def status(self) -> dict[str, Any]:
        """Each server's ``/is_paused`` and weight version (an error text for a server that did not answer)."""
        def one(url: str) -> Any:
            paused = self._http.get(url + "/is_paused").raise_for_status().json()
            info = self._http.get(url + "/weight_info").raise_for_status().json()
            return {**paused, "weight_version": info["weight_version"]}

        return self._each(one)

    # ------------------------------------------------------------------------------------------- inside

    def _pause_each(self, body: dict, wait: float | None, forever: bool) -> tuple[dict[str, str], dict[str, str]]:
        """``POST /pause`` to every server at once, in threads of their own: ``(taken, failed)``.  The caller's
        thread waits on an event, so that Ctrl-C (or any exception) interrupts it at once; then the leases taken so
        far are resumed, and so is every lease a pause still under way brings back later, by its own thread (issue
        39's review: the lease of a pause that answered after the interrupt was dropped, and held its server until
        its ttl)."""
        lock, done = threading.Lock(), threading.Event()
        http = httpx.Client(**self._client_options)  # its own: closing the fleet must not cut a pause under way
        taken: dict[str, str] = {}
        failed: dict[str, str] = {}
        state = {"abandoned": False, "left": len(self.urls)}

        def ask(url: str) -> None:
            try:
                r: Any = self._post(url, "/pause", body, timeout=wait, forever=forever, http=http)
            except BaseException as error:  # noqa: BLE001 -- reported, as _each does
                r = f"{type(error).__name__}: {error}"
            lease = r.get("lease_id") if isinstance(r, dict) else None
            with lock:
                abandoned = state["abandoned"]
                if isinstance(lease, str) and lease:
                    if not abandoned:
                        taken[url] = lease
                else:
                    failed[url] = r if isinstance(r, str) else f"answered without a lease id: {r!r}"[:300]
                state["left"] -= 1
                last = not state["left"]
            if abandoned and isinstance(lease, str) and lease:
                answer = self._post(url, "/resume", {"lease_id": lease}, http=http)
                if not isinstance(answer, dict):
                    logger.warning("resuming %s failed (%s); its lease expires within its ttl", url, answer)
            if last:
                http.close()
                done.set()

        threads = [threading.Thread(target=ask, args=(url,), daemon=True, name="cbpause-fleet-pause")
                   for url in self.urls]  # fmt: skip
        for thread in threads:
            thread.start()
        try:
            # Woken now and then: a Ctrl-C that the kernel hands to another thread of this process interrupts no
            # wait of this one, and is seen only when it wakes (its handler runs here, the main thread's).
            while not done.wait(SIGNAL_CHECK_S):
                pass
        except BaseException:
            with lock:
                state["abandoned"] = True
                mine = dict(taken)
            self._release(mine)
            raise
        return taken, failed

    def _write(self, route: str, body: dict) -> list[str]:
        if not self.leases:
            raise RuntimeError("a weight update needs the fleet's pause: call it inside `with fleet.pause(...)`")
        with self._lock:
            lost = dict(self.lost)
        targets = {url: lease for url, lease in self.leases.items() if url not in lost}
        results = self._each(lambda url: self._post(url, route, {**body, "lease_id": targets[url]}), list(targets))
        updated = [url for url, r in results.items() if isinstance(r, dict)]
        failed = {**{url: f"lease lost: {why}" for url, why in lost.items()},
                  **{url: r for url, r in results.items() if not isinstance(r, dict)}}  # fmt: skip
        if failed:
            raise FleetError("missed the update", failed, updated)
        return updated

    def _renew(self, stop: threading.Event, every: float) -> None:
        """``TrainerRenew``, every ``every`` seconds until ``stop``; a lease a server refuses to renew is lost."""
        while not stop.wait(every):
            for url, lease in list(self.leases.items()):
                if url in self.lost:
                    continue
                outcome = self._post(url, f"/pause/{lease}/renew", {})
                if isinstance(outcome, str) and ("410" in outcome or "404" in outcome):
                    logger.error("the lease on %s was lost: %s", url, outcome)
                    with self._lock:
                        self.lost[url] = outcome

    def _release(self, leases: dict[str, str]) -> None:
        results = self._each(lambda url: self._post(url, "/resume", {"lease_id": leases[url]}), list(leases))
        for url, r in results.items():
            if not isinstance(r, dict):
                logger.warning("resuming %s failed (%s); its lease expires within its ttl", url, r)

    def _post(self, url: str, route: str, body: dict, timeout: float | None = None, forever: bool = False,
              http: httpx.Client | None = None) -> dict | str:  # fmt: skip
        """The answer's JSON, or a text saying why there is none (the status and the server's message).  ``timeout``
        (default ``request_timeout``) bounds the request, unless ``forever``."""
        try:
            bound = None if forever else (timeout or self.request_timeout)
            response = (http or self._http).post(url + route, json=body, timeout=bound)
        except httpx.HTTPError as error:
            return f"no answer ({type(error).__name__}: {error})"
        if response.status_code != 200:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            return f"{response.status_code} {message}"
        try:
            return response.json()
        except ValueError:
            return f"{response.status_code} an answer that is not JSON: {response.text[:200]!r}"

    def _each(self, fn: Any, urls: list[str] | None = None) -> dict[str, Any]:
        urls = self.urls if urls is None else urls
        if not urls:
            return {}
        with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="cbpause-fleet") as pool:
            futures = {url: pool.submit(fn, url) for url in urls}
            out = {}
            for url, future in futures.items():
                try:
                    out[url] = future.result()
                except Exception as error:  # noqa: BLE001 -- a server's failure is reported, not raised
                    out[url] = f"{type(error).__name__}: {error}"
            return out
