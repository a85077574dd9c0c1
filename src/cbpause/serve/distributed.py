"""Weights by broadcast: the routes that let a trainer send an update over torch.distributed.

* ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size, group_name, backend,
  timeout}``: join the trainer's weight-update group (a group of its own, not the tensor-parallel one) as rank
  ``rank_offset``; the answer comes once every member has joined, or a ``504`` after ``timeout`` seconds.  Over gloo
  the server's end of the group is a process of its own (:mod:`.receiver`: what arrives on the wire cannot end the
  server); over NCCL it is in the server's process (:class:`~cbpause.client.weight_group.WeightGroup`).
* ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, weight_version, lease_id,
  write_timeout, bucket_bytes}``: receive the update broadcast by rank 0 and copy it in place, under the pause held by
  that lease (``WriteBegin`` with a staged transfer, ``Received``, ``WriteEnd``: ``tla/FleetPause.tla``).  With
  ``bucket_bytes`` the tensors come packed in buckets of that size, each with a header and a checksum that are checked
  before it is used (:mod:`cbpause.client.buckets`; what :class:`~cbpause.client.Fleet` sends); without, one
  broadcast per tensor, the format of a stock SGLang-style trainer, which carries no checksum (a short tensor is still
  refused: :mod:`.receiver`).
* ``POST /destroy_weights_update_group`` ``{group_name}``.

An update in cbpause's own format (``bucket_bytes`` named) is :mod:`cbpause.client.weight_group`'s three collectives:
a vote, the buckets, a vote; a stock trainer's is its tensors only, and each server takes what it received whole.
Every check comes first, and a refusal is answered at once, before any collective, whoever sent it. A server that
refuses an update that names a lease it issued (a lease gone, the fence, a manifest that does not match the model)
also leaves the group: its connections close, and the trainer and the other members fail their next collective at once
instead of waiting for a vote or a broadcast that will not come. A request that names no lease this server issued is
refused without touching the group (the lease id is the trainer's credential: a stray request must not break the
group). A transfer touches the model only from its first bucket on, arrived whole and checked (R-STAGED-TRANSFER):
one that fails before (a peer lost, a deadline passed, a member that refused, a bucket whose bytes are not its
manifest's) leaves the weights and their label as they were.  By default each bucket is then copied into the model as
it arrives (:data:`STAGINGS`, bounded), and a transfer that fails after the first copy leaves the weights torn, held
and refused until a complete update (R-TORN-HOLD); with ``--staging full`` every bucket is staged first, and only the
copy from the buffers, after the second vote, touches the model. A collective that fails leaves the
group unusable (gloo's pairs are in an unknown state): it is dropped, and the trainer initialises a new one.

Limits on what a caller can make the server hold: :data:`MAX_GROUPS` groups (joining or joined); a join waits
``timeout`` seconds at most (:data:`MAX_JOIN_S`), even for a master that never answers, and :data:`MAX_STUCK` joins at
most may stay stuck past it (over NCCL: a gloo join's process is killed); one update at a time per group; every
collective has the group's deadline, pushed on by each bucket that arrives (a transfer that progresses never loses its
lease; one that stops ends within the deadline, or at once when the group is destroyed).  The routes sit behind
:mod:`.guard`'s API key like every other.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from ..client.buckets import MAX_BUCKET_BYTES, MIN_BUCKET_BYTES
from ..client.weight_group import BACKENDS, DEFAULT_GROUP, WeightGroup
from ..integrations.manifest import check_manifest
from . import transfer
from .control import NEEDS_LEASE, _body, _jsonable, weight_version_of
from .leases import Fenced, LeaseGone, LeaseTable, StillTorn, Superseded, UnknownLease, WriteBusy, checked_seconds
from .receiver import START_S, ReceivingGroup
from .transfer import CopyFailed
from .transfer.broadcast import STAGINGS, Broadcast, Declined

__all__ = ["MAX_GROUPS", "MAX_JOIN_S", "MAX_STUCK", "STAGINGS", "WeightGroups", "add_distributed_routes"]

MAX_GROUPS = 4  # weight-update groups joining or joined at once: each holds sockets to every member
MAX_JOIN_S = 600.0  # the longest a join may wait for the other members
MAX_STUCK = 16  # joins past their timeout whose thread torch's store still holds (a master that never answers)
JOIN_GRACE_S = 2.0  # past a join's own timeout, how long its route waits for torch to give up by itself
DEFAULT_TIMEOUT_S = 60.0  # each collective's deadline, when the trainer names none


class Refused(Exception):
    """An update this server refuses, with the HTTP status that says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Joining:
    """The place of a group being joined: its receiving process (over gloo), which a destroy kills."""

    def __init__(self, receiving: ReceivingGroup | None) -> None:
        self.receiving = receiving


class WeightGroups:
    """The weight-update groups of one server, by name.  Thread-safe.

    A join runs in a thread of its own, and the route waits for it ``timeout`` seconds at most (from the receiving
    process's start, over gloo): a master that accepts the connection and never answers (a frozen trainer) makes
    torch's store wait for ever.  A join past its timeout frees its group's slot at once.  Over gloo its receiving
    process is killed then, as it is by a destroy or the server's stop while it joins; over NCCL the join's thread,
    still stuck inside torch, counts among :data:`MAX_STUCK` (then a join is a 429): a stuck join never holds a slot a
    trainer needs, and the threads are bounded."""

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self.max_groups = max_groups
        self._lock = threading.Lock()
        self._groups: dict[str, Any] = {}  # a WeightGroup or ReceivingGroup, or a _Joining while it is joined
        self.stuck = 0  # NCCL joins past their timeout whose thread has not ended
        self._closed = False

    def join(self, body: dict, device: str) -> Any:
        """Build the group a body describes (``Refused`` 400/409/429, 503 when the server stops or the receiving
        process cannot start, or 504 when the members did not all join)."""
        name, rank, world, address, port, backend, timeout = _init_args(body)
        if backend == "nccl" and not str(device).startswith("cuda"):
            raise Refused(400, f"backend nccl needs the model on a CUDA device; this server's is on {device}")
        with self._lock:
            if self._closed:
                raise Refused(503, "the server is stopping")
            if name in self._groups:
                raise Refused(409, f"a weight-update group {name!r} exists here (or is being joined): destroy it first")
            if len(self._groups) >= self.max_groups or self.stuck >= MAX_STUCK:
                raise Refused(429, f"{len(self._groups)} weight-update groups exist here and {self.stuck} joins are "
                                   "stuck past their timeout: destroy one first")  # fmt: skip
            place = self._groups[name] = _Joining(None)
        try:
            if backend == "gloo":  # (see .receiver: what arrives on the wire cannot end the server)
                place.receiving = ReceivingGroup(address, port, rank, world, group_name=name, timeout_s=timeout)
        except Exception as error:  # noqa: BLE001 -- no process could be started: the server's 503
            self._forget(name, place)
            raise Refused(503, f"could not start the process that receives for the group: {error}"[:400]) from None
        receiving = place.receiving
        done, out = threading.Event(), {}

        def build() -> None:
            try:
                if receiving is not None:
                    receiving.join()
                    out["group"] = receiving
                else:
                    out["group"] = WeightGroup(address, port, rank, world, group_name=name, backend=backend,
                                               timeout_s=timeout, device=device)  # fmt: skip
            except Exception as error:  # noqa: BLE001 -- the route's 504
                out["error"] = error
            with self._lock:
                late = out.get("abandoned", False)
                if late and receiving is None:
                    self.stuck -= 1
                kept = not late and "group" in out and not self._closed and self._groups.get(name) is place
                if kept:
                    self._groups[name] = out["group"]
                elif self._groups.get(name) is place:
                    del self._groups[name]
            if not kept and "group" in out:
                out["group"].destroy()  # joined after its route gave up, a destroy, or the server's stop
            done.set()

        threading.Thread(target=build, name=f"cbpause-join-{name}", daemon=True).start()
        if receiving is not None:
            receiving.started.wait(START_S)  # a process's start (importing torch) is not the members' join
        if not done.wait(timeout + JOIN_GRACE_S):
            with self._lock:
                if not done.is_set():
                    out["abandoned"] = True
                    self.stuck += receiving is None
                    if self._groups.get(name) is place:
                        del self._groups[name]
            if out.get("abandoned"):  # (not if the join ended just as the wait did: that group is kept)
                if receiving is not None:
                    receiving.destroy()  # nothing stays stuck: its process is killed
                raise Refused(504, f"could not join weight-update group {name!r} at {address}:{port} as rank {rank} "
                                   f"of {world} within {timeout} s: the master did not answer")  # fmt: skip
        if "group" not in out or self._groups.get(name) is not out["group"]:
            why = f"{type(out.get('error')).__name__}: {out.get('error')}" if "error" in out else \
                "it was destroyed while it joined"  # fmt: skip
            if self._closed:
                raise Refused(503, "the server is stopping")
            raise Refused(504 if "error" in out else 409, f"could not join weight-update group {name!r} at "
                          f"{address}:{port} as rank {rank} of {world} within {timeout} s: {why}"[:600])  # fmt: skip
        return out["group"]

    def get(self, name: Any) -> Any:
        with self._lock:
            group = self._groups.get(name) if isinstance(name, str) else None
        if group is None or isinstance(group, _Joining):
            raise Refused(404, f"no weight-update group {name!r} here: POST /init_weights_update_group first")
        return group

    def drop(self, name: Any, group: Any = None) -> bool:
        """Destroy the group named ``name`` (only if it is ``group``, when given), or end its join under way (its
        receiving process killed; an NCCL join is left to its own end, its slot freed); True if there was one."""
        with self._lock:
            found = self._groups.get(name) if isinstance(name, str) else None
            if found is None or (group is not None and found is not group):
                return False
            del self._groups[name]
        if isinstance(found, _Joining):
            if found.receiving is not None:
                found.receiving.destroy()
        else:
            found.destroy()
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            groups, self._groups = list(self._groups.values()), {}
        for group in groups:
            if isinstance(group, _Joining):
                if group.receiving is not None:
                    group.receiving.destroy()
            else:
                group.destroy()

    def _forget(self, name: str, place: _Joining) -> None:
        with self._lock:
            if self._groups.get(name) is place:
                del self._groups[name]


def _init_args(body: dict) -> tuple[str, int, int, str, int, str, float]:
    name = body.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not name or len(name) > 64 or not name.isprintable():
        raise Refused(400, f"group_name must be a printable string of 1-64 characters, not {name!r}"[:200])
    address, port = body.get("master_address"), body.get("master_port")
    if not isinstance(address, str) or not address or len(address) > 255:
        raise Refused(400, f"master_address must be a host name or address, not {address!r}"[:200])
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise Refused(400, f"master_port must be a port number, not {port!r}"[:200])
    rank, world = body.get("rank_offset"), body.get("world_size")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, world)) or not 0 < rank < world <= 1024:
        raise Refused(400, f"rank_offset and world_size must be integers with 0 < rank_offset < world_size <= 1024 "
                           f"(rank 0 is the trainer), not {rank!r} and {world!r}"[:300])  # fmt: skip
    backend = body.get("backend", "gloo")
    if backend not in BACKENDS:
        raise Refused(400, f"backend must be one of {list(BACKENDS)}, not {backend!r}"[:200])
    try:
        timeout = checked_seconds("timeout", body.get("timeout"), default=DEFAULT_TIMEOUT_S, upper=MAX_JOIN_S,
                                  zero=False)  # fmt: skip
    except ValueError as error:
        raise Refused(400, str(error)) from None
    return name, rank, world, address, port, backend, timeout


def add_distributed_routes(app: FastAPI, manager: Any, leases: LeaseTable, groups: WeightGroups,
                           metrics: Any = None, staging: str = "bounded") -> None:  # fmt: skip
    """Add the three routes of weights by broadcast to ``app`` (``metrics``: the server's, which time each update;
    ``staging``: one of :data:`STAGINGS`)."""
    if staging not in STAGINGS:
        raise ValueError(f"staging must be one of {list(STAGINGS)}, not {staging!r}")

    def answer(call: Any) -> Any:
        async def route(request: Request) -> JSONResponse:
            body = await _body(request) or {}
            try:
                return JSONResponse(await run_in_threadpool(call, body))
            except Refused as refusal:
                return JSONResponse({"error": str(refusal)}, status_code=refusal.status)

        return route

    def init(body: dict) -> dict:
        group = groups.join(body, str(_device(manager.model)))
        return {"group_name": group.name, "rank": group.rank, "world_size": group.world_size,
                "backend": group.backend}  # fmt: skip

    def update(body: dict) -> dict:
        started = time.monotonic()
        answer = update_weights_from_distributed(body, manager, leases, groups, staging)
        if metrics is not None:
            metrics.weight_update("broadcast", time.monotonic() - started)
        return answer

    def destroy(body: dict) -> dict:
        return {"destroyed": groups.drop(body.get("group_name", DEFAULT_GROUP))}

    app.add_api_route("/init_weights_update_group", answer(init), methods=["POST"])
    app.add_api_route("/update_weights_from_distributed", answer(update), methods=["POST"])
    app.add_api_route("/destroy_weights_update_group", answer(destroy), methods=["POST"])


def _device(model: Any) -> Any:
    return next(iter(model.parameters())).device


def update_weights_from_distributed(body: dict, manager: Any, leases: LeaseTable, groups: WeightGroups,
                                    staging: str = "bounded") -> dict:  # fmt: skip
    """The route's work, in a worker thread: ``{"updated": n, "weight_version": v}`` or ``Refused``.

    Every check comes before any collective, and a refusal is answered at once: under a lease this server issued, the
    server also leaves the group (the trainer's collectives fail at once, whether it votes or not); a request that
    names no such lease, one on a group unknown here or busy with another update, never touches the group (a
    stranger must not break it)."""
    group = groups.get(body.get("group_name", DEFAULT_GROUP))
    if not group.busy.acquire(blocking=False):
        raise Refused(409, "an update over this weight-update group is under way: one at a time")
    try:
        return _transfer(body, manager, leases, groups, group, staging)
    finally:
        group.busy.release()


def _transfer(body: dict, manager: Any, leases: LeaseTable, groups: WeightGroups, group: WeightGroup,
              staging: str) -> dict:  # fmt: skip
    # The lease id is the trainer's credential: only a request that names a lease this server issued takes part in
    # the group's vote.  Any other is refused at once, outside the group (a stray request voting no waited for a
    # vote of rank 0 that never came, then broke the group: found by review).
    member = "lease_id" in body and leases.issued(body["lease_id"])
    with ExitStack() as stack:
        try:
            if "lease_id" not in body:
                raise Refused(409, NEEDS_LEASE)
            new = weight_version_of(body)
            manifest = check_manifest(manager.model, body.get("names"), body.get("dtypes"), body.get("shapes"))
            bucket_bytes = _bucket_bytes(body)
            lease = stack.enter_context(leases.write_weights(body["lease_id"], body.get("write_timeout",
                                        3 * group.timeout_s), new, staged=True,
                                        names=[entry.name for entry in manifest]))  # fmt: skip
        except Exception as error:  # noqa: BLE001 -- the answer, at once
            refusal = _refusal(error)
            if member and groups.drop(group.name, group):
                # No vote: a stock trainer casts none and would leave it waiting.  Leaving the group closes this
                # member's connections, so the trainer and the other members fail their next collective at once.
                refusal = Refused(refusal.status, f"{refusal}; this server left the weight-update group "
                                  f"{group.name!r} at once: initialise it again")  # fmt: skip
            raise refusal from None
        transport = Broadcast(group, manifest, bucket_bytes, staging, still_writing=lambda: not lease.cut)
        try:
            copied = transfer.write(leases, lease, manager, transport, new, seconds=group.timeout_s)
        except transfer.WriteFailed as failed:
            cause = failed.cause
            if not isinstance(cause, Declined):  # (a vote that said no leaves the group in step)
                groups.drop(group.name, group)  # its connections are in an unknown state
            status = cause.status if isinstance(cause, Declined) else 500 if isinstance(cause, CopyFailed) else 502
            closed = "" if isinstance(cause, Declined) else "; the weight-update group was closed: initialise it again"
            raise Refused(status, f"{failed}{closed}") from None
        except (UnknownLease, LeaseGone) as error:
            groups.drop(group.name, group)
            raise _refusal(error) from None
    return {"updated": copied, "weight_version": _jsonable(new)}


def _bucket_bytes(body: dict) -> int | None:
    """The body's ``bucket_bytes``: the packed, checked format (:mod:`cbpause.client.buckets`), or ``None``: one
    broadcast per tensor, unchecked (a stock trainer's format)."""
    value = body.get("bucket_bytes")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not MIN_BUCKET_BYTES <= value <= MAX_BUCKET_BYTES):  # fmt: skip
        raise ValueError(f"bucket_bytes must be an integer in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}] or null, not "
                         f"{value!r}"[:200])  # fmt: skip
    return value


def _refusal(error: Exception) -> Refused:
    if isinstance(error, Refused):
        return error
    if isinstance(error, UnknownLease):
        return Refused(404, error.args[0])
    if isinstance(error, LeaseGone):
        return Refused(410, str(error))
    if isinstance(error, (Fenced, Superseded, StillTorn, WriteBusy)):
        return Refused(409, str(error))
    if isinstance(error, ValueError):
        return Refused(400, str(error))
    return Refused(500, f"{type(error).__name__}: {error}"[:600])


def _vote(groups: WeightGroups, group: WeightGroup, ok: bool) -> bool:
    """This member's vote; ``Refused`` (502) if the vote fails (a member lost, the deadline): the group is dropped."""
    try:
        return group.vote(ok)
    except RuntimeError as error:
        groups.drop(group.name, group)
        raise Refused(502, f"the weight-update group's vote failed ({error}); nothing was copied; the group was "
                           "closed: initialise it again") from None  # fmt: skip
