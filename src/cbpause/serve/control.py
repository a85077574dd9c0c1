"""The control API of ``cbpause serve``: leased pauses, weights from disk, versions, health and metrics (issue 29).

Routes (``docs/serving.md`` documents each; ``spec/PROTOCOL.md`` section 6.6 names their actions):

* ``POST /pause`` ``{mode, timeout, ttl, holder}`` -> ``{lease_id, expires_at, ttl, mode, weight_version}`` once the
  window is open (``PauseLease``); ``POST /pause/{lease_id}/renew`` ``{ttl}`` (``RenewLease``); ``POST /resume``
  ``{lease_id}`` (``ResumeLease``); ``GET /is_paused``;
* ``POST /update_weights_from_disk`` ``{lease_id, path, weight_version}``; ``POST /update_weight_version``
  ``{lease_id, weight_version}``; ``GET /weight_info``; ``GET /health``; ``GET /metrics``;
* the names existing clients use (:data:`COMPAT`): vLLM's ``POST /pause?mode=&clear_cache=`` (no body), SGLang's
  ``POST /pause_generation`` ``{mode}``, and their resumes ``POST /resume`` (no lease id) and
  ``POST /continue_generation``.  Such a pause is a lease with the server's default ttl, whose id the answer gives;
* vLLM's introspection, as TRL's ``VLLMClient`` reads it: ``GET /server_info?config_format=json|text`` (the served
  model's dtype and ``max_model_len``, the parallel sizes, no LoRA) and ``GET /get_world_size``.

Errors (and, in front of every route, :mod:`.guard`'s ``401``, ``413`` and ``400`` for bad JSON): ``400`` for bad
input (an unknown mode, a timeout or ttl that is not a non-negative number, a path outside ``--weights-dir``, a
weights file that does not match the model), ``403`` when updates from disk are disabled, ``404`` for a lease id never
issued here, ``409`` for a write without a lease id, under a lease older than the one the weights were last written
under, or while another write runs, ``410`` for a lease that expired or was resumed, ``429`` when ``max_leases``
leases wait or are held, ``503`` when the loop is not running, ``504`` when the window did not open within
``timeout``.  A request that fails changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool

from ..integrations.transfer import InProcess
from . import transfer
from .guard import BadJSON, parse_json_object
from .leases import Fenced, LeaseGone, LeaseTable, StillTorn, Superseded, TooManyLeases, UnknownLease, WriteBusy
from .transfer import disk

__all__ = ["COMPAT", "MODES", "add_control_routes", "compat_mode"]

MODES = ("keep", "retract", "drain", "abort")

# How each engine's pause mode treats the requests in flight, and the cbpause mode that does the same: the one home of
# the table docs/serving.md shows (tests/test_serve.py checks that the page agrees).  Keys: (engine, mode, clear_cache).
COMPAT: dict[tuple[str, str, bool | None], tuple[str, str]] = {
    ("vllm", "abort", None): ("abort", "in-flight requests end at once, aborted, with the tokens they had"),
    ("vllm", "wait", None): ("drain", "admission closes; the window opens once the requests in flight finished"),
    ("vllm", "keep", True): ("retract", "requests stay scheduled; their KV is cleared and recomputed after the resume"),
    ("vllm", "keep", False): ("keep", "requests stay scheduled with their KV; they go on after the resume"),
    ("sglang", "abort", None): ("abort", "in-flight requests end at once, aborted"),
    ("sglang", "retract", None): ("retract", "requests go back to the waiting queue; their KV is freed"),
    ("sglang", "in_place", None): ("keep", "requests stay in the running batch with their KV"),
}


NEEDS_LEASE = "a weight update needs the lease_id of a pause this server holds"


MAX_VERSION_CHARS = 256  # a version names a policy: a step number, a hash, a run name


class BadRequest(ValueError):
    """Input the server refuses (a 400)."""


def compat_mode(engine: str, mode: Any, clear_cache: Any = None) -> str:
    """The cbpause mode of an engine's pause (:data:`COMPAT`); ``BadRequest`` for a mode that engine lacks."""
    cache = clear_cache if mode == "keep" and engine == "vllm" else None
    if not isinstance(mode, str) or (engine, mode, cache) not in COMPAT:
        known = sorted({m for (e, m, _) in COMPAT if e == engine})
        raise BadRequest(f"unknown {engine} pause mode {mode!r}: one of {known}")
    return COMPAT[(engine, mode, cache)][0]


async def _body(request: Request) -> dict | None:
    """The request's JSON object; ``None`` when it has no body (a vLLM-style call), which ``{}`` is not."""
    try:
        return parse_json_object(await request.body())
    except BadJSON as error:
        raise BadRequest(str(error)) from None


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def _flag(value: str | None) -> bool | None:
    if value is None:
        return None
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise BadRequest(f"clear_cache must be true or false, not {value!r}")


def add_control_routes(app: FastAPI, manager: Any, leases: LeaseTable, *, weights_dir: Path | None,
                       metrics: Any, served: Any = None, tensor_parallel: Any = None) -> None:  # fmt: skip
    """Add the control routes to ``app`` (transformers' own ``/health`` is replaced by one that says more).
    ``served`` (:class:`cbpause.serve.openai.Served`) and ``tensor_parallel`` are what ``/server_info`` and
    ``/get_world_size`` report."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]

    @app.exception_handler(BadRequest)
    async def _bad(_request: Request, error: BadRequest) -> JSONResponse:
        return _error(400, str(error))

    _pause_routes(app, manager, leases, metrics)
    _weight_routes(app, manager, leases, weights_dir, metrics)
    world = 1 if tensor_parallel is None else tensor_parallel.size

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> JSONResponse:
        if config_format not in ("json", "text"):
            return _error(400, f"config_format must be 'json' or 'text', not {config_format!r}")
        config = server_config(manager, served, world)
        return JSONResponse({"vllm_config": config if config_format == "json" else json.dumps(config)})

    @app.get("/get_world_size")
    async def get_world_size() -> JSONResponse:
        return JSONResponse({"world_size": world})

    @app.api_route("/health", methods=["GET", "HEAD"])  # a load balancer may probe with HEAD
    async def health() -> JSONResponse:
        status = manager.background_thread_status
        if not manager.is_running():
            return JSONResponse({"status": "unhealthy", "reason": str(status.fatal_error or "the loop is not running")},
                                status_code=503)  # fmt: skip
        # A torn server is alive and must stay pausable (a trainer mends it with a complete update): it says so here,
        # and its generation routes answer 503.
        return JSONResponse({"status": "ok", "phase": status.state.phase, "paused": status.state.paused,
                             "torn": leases.torn is not None})  # fmt: skip

    @app.get("/metrics")
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics.exposition(), media_type="text/plain; version=0.0.4")


def server_info_dtype(model: Any) -> str:
    """The served weights' dtype as vLLM's ``/server_info`` writes it (``"torch.bfloat16"``)."""
    return str(getattr(model, "dtype", "unknown"))


def server_config(manager: Any, served: Any, world: int) -> dict:
    """What ``/server_info`` says, in the shape of vLLM's resolved ``vllm_config`` where TRL reads it
    (``model_config.dtype``, ``model_config.max_model_len``, ``parallel_config``, ``lora_config``: none is served)."""
    return {
        "model_config": {"model": getattr(served, "name", None), "dtype": server_info_dtype(manager.model),
                         "max_model_len": getattr(served, "max_model_len", None)},
        "parallel_config": {"tensor_parallel_size": world, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                            "world_size": world},
        "lora_config": None,
        "cbpause": {"weight_version": _jsonable(manager.weight_version)},
    }  # fmt: skip


def _pause_routes(app: FastAPI, manager: Any, leases: LeaseTable, metrics: Any) -> None:
    async def pause(request: Request, body: dict, *, legacy: bool) -> JSONResponse:
        return await _pause(request, body, legacy, manager, leases, metrics)

    @app.post("/pause")
    async def pause_route(request: Request) -> JSONResponse:
        body = await _body(request)
        if body is not None:  # {} too: every default (a keep pause)
            return await pause(request, body, legacy=False)
        query = request.query_params  # vLLM's: no body, the mode in the query
        mode = compat_mode("vllm", query.get("mode", "abort"), _flag(query.get("clear_cache", "true")))
        return await pause(request, {"mode": mode, "holder": "vllm-client"}, legacy=True)

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        mode = compat_mode("sglang", body.get("mode", "abort"))
        return await pause(request, {"mode": mode, "holder": "sglang-client"}, legacy=True)

    @app.post("/pause/{lease_id}/renew")
    async def renew_lease(lease_id: str, request: Request) -> JSONResponse:
        body = await _body(request) or {}
        try:
            lease = leases.renew_lease(lease_id, body.get("ttl"))
        except ValueError as error:
            return _error(400, str(error))
        except UnknownLease as error:
            return _error(404, error.args[0])
        except LeaseGone as error:
            return _error(410, str(error))
        return JSONResponse({"lease_id": lease.id, "expires_at": leases.wall(lease.deadline), "ttl": lease.ttl})

    @app.post("/resume")
    async def resume(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        if "lease_id" not in body:  # vLLM's /resume: the pauses taken without a lease
            return JSONResponse({"resumed": await run_in_threadpool(leases.resume_legacy)})
        try:
            resumed = await run_in_threadpool(leases.resume_lease, body["lease_id"])
        except UnknownLease as error:
            return _error(404, error.args[0])
        except LeaseGone as error:
            return _error(410, str(error))
        return JSONResponse({"lease_id": body["lease_id"], "resumed": resumed})

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        return JSONResponse({"resumed": await run_in_threadpool(leases.resume_legacy)})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        held = leases.held()
        return JSONResponse({"is_paused": manager.background_thread_status.state.paused, "leases": len(held),
                             "holders": [lease.holder for lease in held], "torn": leases.torn is not None})  # fmt: skip


async def _pause(request: Request, body: dict, legacy: bool, manager: Any, leases: LeaseTable,
                 metrics: Any) -> JSONResponse:  # fmt: skip
    """``PauseLease`` for a route: a lease asked, its window awaited (not a worker thread), withdrawn if the client
    leaves first."""
    mode = body.get("mode", "keep")
    if mode not in MODES:
        return _error(400, f"unknown mode {mode!r}: one of {list(MODES)}")
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    try:
        # The wait for the window is an await, not a worker thread: however many pauses wait, the routes that
        # end a pause (resume, renew, writes) always find a thread.
        lease = leases.start_lease(mode=mode, timeout=body.get("timeout"), ttl=body.get("ttl"),
                                   holder=body.get("holder", "anonymous"), legacy=legacy,
                                   on_entered=lambda: loop.call_soon_threadsafe(entered.set))  # fmt: skip
    except ValueError as error:
        return _error(400, str(error))
    except TooManyLeases as error:
        return _error(429, str(error), **{"Retry-After": "1"})
    try:
        waited = await _unless_disconnected(entered, request)
    except asyncio.CancelledError:
        # The route itself cancelled: the client left and transformers 5.25's app (CancelOnDisconnect, in front of
        # every route) cancels its handler, or the server stops.  Nobody will ever know this lease's id either.
        leases.abandon(lease)
        raise
    if not waited:
        leases.abandon(lease)  # nobody will ever know this lease's id: it must not hold the server
        return _error(499, "the client disconnected before the window opened; its pause was withdrawn")
    if lease.error is not None:
        error = lease.error
        if isinstance(error, ValueError):
            return _error(400, str(error))
        if isinstance(error, TimeoutError):
            return _error(504, f"the generation loop did not pause in time: {error}")
        return _error(503, f"cannot pause: {error}")
    metrics.pause_latency.observe(time.monotonic() - started)
    return JSONResponse({"lease_id": lease.id, "expires_at": leases.wall(lease.deadline), "ttl": lease.ttl,
                         "mode": mode, "weight_version": _jsonable(manager.weight_version)})  # fmt: skip


def _weight_routes(app: FastAPI, manager: Any, leases: LeaseTable, weights_dir: Path | None, metrics: Any) -> None:
    def under_lease(body: dict) -> JSONResponse | None:
        if "lease_id" not in body:
            return _error(409, NEEDS_LEASE)
        try:
            leases.check_held(body["lease_id"])
        except UnknownLease as error:
            return _error(404, error.args[0])
        except LeaseGone as error:
            return _error(410, str(error))
        return None

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        if (refused := under_lease(body)) is not None:
            return refused
        new = weight_version_of(body)
        started = time.monotonic()
        try:
            path = disk.check_inside(body.get("path"), weights_dir)
            source = await run_in_threadpool(disk.Disk, manager.model, path, weights_dir)  # every header checked
        except PermissionError as error:
            return _error(403, str(error))
        except ValueError as error:
            return _error(400, str(error))
        try:
            copied = await run_in_threadpool(_write, leases, body["lease_id"], manager, source, new,
                                             body.get("write_timeout"))  # fmt: skip
        except UnknownLease as error:
            return _error(404, error.args[0])
        except LeaseGone as error:  # it expired during the read, or the write passed its deadline and was cut
            return _error(410, str(error))
        except (Fenced, Superseded, StillTorn, WriteBusy) as error:
            return _error(409, str(error))
        except ValueError as error:  # a bad write_timeout
            return _error(400, str(error))
        except transfer.WriteFailed as error:
            return _error(500, str(error))
        finally:
            source.close()
        metrics.weight_update("disk", time.monotonic() - started)
        return JSONResponse({"updated": copied, "weight_version": _jsonable(new)})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request) or {}
        if (refused := under_lease(body)) is not None:
            return refused
        new = weight_version_of(body)
        try:
            await run_in_threadpool(_write, leases, body["lease_id"], manager, InProcess(manager.model, ()), new,
                                    body.get("write_timeout"))  # fmt: skip
        except ValueError as error:
            return _error(400, str(error))
        except UnknownLease as error:  # as the other routes answer it (found by issue 39's review: a 410)
            return _error(404, error.args[0])
        except LeaseGone as error:
            return _error(410, str(error))
        except (Fenced, Superseded, StillTorn, WriteBusy) as error:
            return _error(409, str(error))
        return JSONResponse({"weight_version": _jsonable(manager.weight_version)})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": _jsonable(manager.weight_version),
                             "parameters": disk.weight_info(manager.model)})  # fmt: skip


async def _unless_disconnected(event: asyncio.Event, request: Request) -> bool:
    """Wait for ``event``; False if the client disconnects first (its body has been read: the next message the
    server receives from it is the disconnect)."""
    waiter = asyncio.ensure_future(event.wait())
    listener = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({waiter, listener}, return_when=asyncio.FIRST_COMPLETED)
        return waiter in done
    finally:
        waiter.cancel()
        listener.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _write(leases: LeaseTable, lease_id: str, manager: Any, source: Any, new: Any,
           timeout: float | None = None) -> int:  # fmt: skip
    """``WriteBegin``, then :func:`.transfer.write` of ``source`` (a transport), which ends in ``WriteEnd`` or
    ``WriteFail`` (the weights labelled ``PartialSync(new)`` and torn if a tensor was copied: ``WriteFailed``).  A
    source that names tensors leaves the model untouched until its first (``Received``): cut before it, the weights
    keep their label, as a transfer's do."""
    names = frozenset(getattr(source, "names", ()))
    with leases.write_weights(lease_id, timeout, new, names=names, staged=bool(names)) as lease:
        return transfer.write(leases, lease, manager, source, new)


def weight_version_of(body: dict) -> Any:
    """The body's ``weight_version``: an integer of 64 bits, a string of at most :data:`MAX_VERSION_CHARS` characters,
    or ``None``; ``BadRequest`` (a 400) for anything else, before anything is set.  The bounds are what every answer
    and ``/metrics`` can carry: a version the server took must never make it unable to answer (a lone surrogate is the
    guard's 400)."""
    v = body.get("weight_version")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, str))):
        raise BadRequest(f"weight_version must be an integer, a string or null, not {v!r}"[:300])
    if isinstance(v, int) and not -(2**63) <= v < 2**63:
        raise BadRequest("weight_version must be an integer of 64 bits (as /metrics carries it)")
    if isinstance(v, str) and len(v) > MAX_VERSION_CHARS:
        raise BadRequest(f"weight_version must be a string of at most {MAX_VERSION_CHARS} characters")
    return v


def _jsonable(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)
