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

Weights by broadcast (issue 42): ``fleet.init_weights_update_group(master_address)`` makes the trainer rank 0 of a
torch.distributed group of its own with the servers as ranks 1..N; ``fleet.update_weights_from_distributed(
named_tensors, weight_version)`` inside the pause sends an update by broadcast (:mod:`cbpause.serve.distributed`:
a vote, the tensors in packed buckets, a vote; a server copies each bucket into its model as it arrives, or, started
with ``--staging full``, only once every member has the whole update), and
``fleet.destroy_weights_update_group()`` ends it.  A transfer that fails raises :class:`FleetError` naming the
servers, within the group's deadline, and leaves the group closed on every member (initialise it again).

Needs ``httpx`` (the ``serve`` extra) and nothing else of cbpause; weights by broadcast need torch too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from typing import Any

import httpx

from .buckets import DEFAULT_BUCKET_BYTES, layout
from .weight_group import DEFAULT_GROUP

__all__ = ["Fleet", "FleetError"]

logger = logging.getLogger("cbpause.client")

RENEWALS_PER_TTL = 3  # renew every ttl / 3: two renewals may be lost before a lease expires
MIN_RENEW_S = 0.05  # however short the ttl, a fleet renews each lease at most 20 times a second
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
    ``bucket_bytes``: the size of the packed, checked buckets a broadcast sends (:mod:`.buckets`; a server stages
    two).  Thread-safe for one pause at a time."""

    def __init__(self, urls: Iterable[str], *, holder: str | None = None, request_timeout: float = 10.0,
                 api_key: str | None = None, transport: Any = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:  # fmt: skip
        self.urls = [str(u).rstrip("/") for u in urls]
        if not self.urls or len(set(self.urls)) != len(self.urls):
            raise ValueError(f"a fleet needs one or more distinct server URLs, not {self.urls!r}")
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.request_timeout = _seconds("request_timeout", request_timeout, none=False, zero=False)
        layout([], bucket_bytes)  # ValueError for a size out of bounds, before any server is asked
        self.bucket_bytes = bucket_bytes
        api_key = api_key if api_key is not None else os.environ.get("CBPAUSE_API_KEY") or None
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._client_options = {"timeout": request_timeout, "transport": transport, "headers": headers}
        self._http = httpx.Client(**self._client_options)
        self.leases: dict[str, str] = {}  # url -> lease id, while a pause is held
        self.lost: dict[str, str] = {}  # url -> why its lease was lost during the pause held now
        self._lock = threading.Lock()
        self.weight_group: Any = None  # the trainer's rank 0 of the weight-update group, once initialised

    def close(self) -> None:
        if self.weight_group is not None:
            self.destroy_weights_update_group()
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
        lives without a renewal (renewed every ``ttl / 3``, and at most every :data:`MIN_RENEW_S`: a ttl shorter than
        three times that may expire between renewals).  Both are checked here, before any server is asked
        (``ValueError``).  With no ``timeout``, each server must first answer ``GET /health`` within the fleet's
        ``request_timeout``, and the pause's connection is bounded by it too: only the wait for the window is not
        (a server that accepts connections and never answers fails, it does not hold the call for ever).  A server
        that answers without a lease id counts as failed; whatever fails, the leases
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
        every = max(ttl / RENEWALS_PER_TTL, MIN_RENEW_S)
        renewer = threading.Thread(target=self._renew, args=(stop, every), daemon=True, name="cbpause-fleet-renewer")
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

    def init_weights_update_group(self, master_address: str, master_port: int | None = None, backend: str = "gloo",
                                  group_name: str = DEFAULT_GROUP, timeout: float = 60.0) -> None:  # fmt: skip
        """Join every server and this trainer in a weight-update group: this process is rank 0 and serves the group's
        store at ``master_address:master_port`` (a free port if ``None``), the servers are ranks 1..N in the fleet's
        order.  ``timeout``: seconds to wait for every member, and each collective's deadline after it.  Returns once
        every member has joined; ``FleetError`` naming the servers that did not (the group is then closed)."""
        from .weight_group import BACKENDS, WeightGroup

        if self.weight_group is not None:
            raise RuntimeError("this fleet has a weight-update group: destroy it first")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, not {backend!r}")
        timeout = _seconds("timeout", timeout, none=False, zero=False)
        port = master_port if master_port is not None else _free_port(master_address)
        world = len(self.urls) + 1
        bodies = {url: {"master_address": master_address, "master_port": port, "rank_offset": rank,
                        "world_size": world, "group_name": group_name, "backend": backend, "timeout": timeout}
                  for rank, url in enumerate(self.urls, 1)}  # fmt: skip
        wait = timeout + self.request_timeout
        with ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="cbpause-fleet-join") as pool:
            asked = {url: pool.submit(self._post, url, "/init_weights_update_group", body, timeout=wait)
                     for url, body in bodies.items()}  # fmt: skip
            try:
                group: Any = WeightGroup(master_address, port, 0, world, group_name=group_name, backend=backend,
                                         timeout_s=timeout)  # fmt: skip
            except Exception as error:  # noqa: BLE001 -- the servers' answers say who did not join
                group = f"{type(error).__name__}: {error}"
            answers = {url: future.result() for url, future in asked.items()}
        failed = {url: a for url, a in answers.items() if not isinstance(a, dict)}
        if failed or isinstance(group, str):
            if not isinstance(group, str):
                group.destroy()
            joined = [url for url in self.urls if url not in failed]
            self._each(lambda url: self._post(url, "/destroy_weights_update_group", {"group_name": group_name}),
                       joined)  # fmt: skip
            raise FleetError("could not form the weight-update group", failed or {"(the trainer)": group})
        self.weight_group = group

    def update_weights_from_distributed(self, named_tensors: Iterable[tuple[str, Any]],
                                        weight_version: Any = None) -> list[str]:  # fmt: skip
        """``TrainerWrite`` by broadcast: every server receives ``named_tensors`` (``(name, tensor)`` pairs, any
        subset of the model's tensors, names as in ``model.named_parameters()`` or a wrapper's) and labels its tokens
        ``weight_version``.  Inside the fleet's pause only.  Returns the servers updated; ``FleetError`` naming the
        servers that were not (a refusal, a lease lost, a server lost mid-transfer), within the group's deadline.  A
        transfer that fails leaves the group closed (initialise it again), and each server's weights as they were,
        or, on a server that had copied part of it (bounded staging, the default), torn: labelled, refusing generation
        until a complete update (its answer in ``FleetError.failed`` says so)."""
        if not self.leases:
            raise RuntimeError("a weight update needs the fleet's pause: call it inside `with fleet.pause(...)`")
        if self.weight_group is None:
            raise RuntimeError("no weight-update group: call init_weights_update_group first")
        import torch

        pairs = list(named_tensors)
        if not pairs or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
            raise ValueError("named_tensors must be (name, tensor) pairs, and not none")
        if not all(isinstance(t, torch.Tensor) for _, t in pairs):  # checked before any server is asked (review)
            raise ValueError(f"not a tensor: {next(n for n, t in pairs if not isinstance(t, torch.Tensor))!r}")
        group = self.weight_group
        with self._lock:
            lost = dict(self.lost)
        if lost:  # a server without its lease would refuse; the others would wait for it: nothing is sent
            raise FleetError("missed the update", {url: f"lease lost: {why}" for url, why in lost.items()})
        body = {"names": [n for n, _ in pairs], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in pairs],
                "shapes": [list(t.shape) for _, t in pairs], "group_name": group.name,
                "weight_version": weight_version, "bucket_bytes": self.bucket_bytes}  # fmt: skip
        # A server answers once the collectives ended, but for the copy from its buffers: the request's bound is the
        # whole transfer's, and the trainer waits for the answers one group timeout past its own collectives' end,
        # so that a server that hangs costs a deadline, not the transfer's bound (found by review: 135 s).
        wait = group.timeout_s * (len(pairs) + 2) + self.request_timeout
        sent: Any = None
        pool = ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="cbpause-fleet-write")
        try:
            asked = {url: pool.submit(self._post, url, "/update_weights_from_distributed",
                                      {**body, "lease_id": self.leases[url]}, timeout=wait)
                     for url in self.urls}  # fmt: skip
            try:
                if group.vote(True):
                    group.send([t for _, t in pairs], self.bucket_bytes)
                    sent = group.vote(True)
            except BaseException as error:
                # A collective failed (or the call was interrupted in one): the group is unusable on every member.
                # Freed at once, it closes its connections, so that the members still inside a collective fail now,
                # not at its deadline.
                sent, self.weight_group = f"{type(error).__name__}: {error}", None
                group.destroy()
                if not isinstance(error, RuntimeError):
                    raise
            after = group.timeout_s
            futures_wait(list(asked.values()), timeout=after)
            results = {url: f.result() if f.done() else f"no answer within {after:g} s of the transfer's end"
                       for url, f in asked.items()}  # fmt: skip
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        updated = [url for url, r in results.items() if isinstance(r, dict)]
        failed = {url: r for url, r in results.items() if not isinstance(r, dict)}
        if isinstance(sent, str):
            # Best effort, and not waited for: each member drops the group when its own collective fails, and a
            # server that hangs must not hold the trainer for a request's bound (found by a test).
            def destroy(url: str) -> Any:
                return self._post(url, "/destroy_weights_update_group", {"group_name": group.name})

            threading.Thread(target=self._each, args=(destroy,), daemon=True, name="cbpause-fleet-destroy").start()
            failed = failed or {"(the group)": sent}
        if failed:
            raise FleetError("missed the update", failed, updated)
        return updated

    def destroy_weights_update_group(self) -> None:
        """End the weight-update group on every server and here (a server that does not answer drops it when a
        collective fails, or when it stops)."""
        group, self.weight_group = self.weight_group, None
        if group is None:
            return
        group.destroy()
        results = self._each(lambda url: self._post(url, "/destroy_weights_update_group", {"group_name": group.name}))
        for url, r in results.items():
            if not isinstance(r, dict):
                logger.warning("destroying the weight-update group on %s failed (%s)", url, r)

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
                r: Any = self._alive(url, http) if forever else None
                r = r or self._post(url, "/pause", body, timeout=wait, forever=forever, http=http)
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

    def _alive(self, url: str, http: httpx.Client) -> str | None:
        """None if the server answers ``GET /health`` within ``request_timeout``; else why not."""
        try:
            response = http.get(url + "/health", timeout=self.request_timeout)
        except httpx.HTTPError as error:
            return f"no answer to /health within {self.request_timeout} s ({type(error).__name__}: {error})"
        return None if response.status_code == 200 else f"{response.status_code} from /health: {response.text[:200]}"

    def _post(self, url: str, route: str, body: dict, timeout: float | None = None, forever: bool = False,
              http: httpx.Client | None = None) -> dict | str:  # fmt: skip
        """The answer's JSON, or a text saying why there is none (the status and the server's message).  ``timeout``
        (default ``request_timeout``) bounds the request; ``forever``: only its connection is bounded, not the wait
        for its answer."""
        limit = self.request_timeout
        try:
            bound = httpx.Timeout(None, connect=limit, write=limit, pool=limit) if forever else (timeout or limit)
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


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host if host not in ("localhost",) else "127.0.0.1", 0))
        return probe.getsockname()[1]
