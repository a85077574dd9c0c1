"""transformers' own OpenAI-compatible server (``transformers serve``) on a cbpause manager (issues 29, 41).

transformers serve's app, its model loading and its ``/v1/responses`` handler are transformers' own
(:func:`openai_app`); what changes is the generation engine behind them.  transformers rebuilt its server in 5.25, so
the engine has two forms, one module each, and these three modules are the only ones of cbpause that know
``transformers.cli.serving``'s internals:

* transformers 5.23 and 5.24 (:mod:`.serving_manager`): the handlers call an in-process ``CBGenerateManager``, which
  ``transformers serve`` builds lazily, on the first request, with that request's sampling settings; here it is a
  :class:`~.serving_manager.PausableCBGenerateManager` on the cbpause manager built at start-up;
* transformers 5.25 (:mod:`.serving_engine`): the handlers call an ``EngineClient``, which runs the model in a worker
  process of its own; here it is a :class:`~.serving_engine.PausableEngine`, which runs it in this process, on the
  cbpause manager built at start-up (decision, ``docs/serving.md``: a pause, a weight write and the lease table must
  reach the loop that steps the model, which a worker process would put out of reach).

The manager samples per request (``per_request_sampling=True``, R-SAMPLING): ``/v1/completions``,
``/v1/chat/completions`` and ``/v1/models`` are :mod:`cbpause.serve.openai`'s routes (transformers' are removed:
:data:`~cbpause.integrations.upstream.REMOVED_ROUTES`), which run each choice through :class:`ServedRequests`; a
``/v1/responses`` request is sampled with the checkpoint's configuration, and its arguments must agree with it
(:func:`check_generation_body`).  Every change made to transformers' server (the subclasses' overrides, the private
attributes set, the routes removed, the wiring restated) is in :mod:`cbpause.integrations.upstream`'s table, with a
fingerprint of each upstream function it touches, per release.  Per request, on every release:

* ``while_paused="reject"``: a request during a pause gets ``503`` with ``Retry-After`` and is not enqueued;
* a non-streamed request ended by an ``abort`` pause or by the staleness bound gets ``503`` with ``Retry-After``
  (decision: the client sends it again; its partial tokens are not delivered);
* a client that disconnects while its request waits (queued during a pause, or running) has it cancelled, so no
  request runs for a client that left;
* an ``x-request-id`` still in flight is a ``409``, and a refused request leaves nothing registered under its id.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import upstream

if upstream.release() not in upstream.SERVED:
    raise ImportError(
        f"cbpause serve runs on the server of transformers {', '.join(upstream.SERVED)}, not {upstream.release()}; "
        "install one with `pip install 'cbpause[serve]'`"
    )

from ..core.errors import LoopPausedError  # noqa: E402
from ..core.state import DONT_STOP  # noqa: E402
from .admission import TOO_LONG  # noqa: E402
from .modes import ABORTED_BY_PAUSE  # noqa: E402
from .transformers import PausableContinuousBatchingManager  # noqa: E402
from .weights import STALE  # noqa: E402

__all__ = ["GENERATION_ROUTES", "JoinFailed", "NEUTRAL", "RETRY_AFTER_S", "RestartWatch", "ServedRequests",
           "TensorParallel", "check_generation_body", "load_sharded", "openai_app", "openai_error", "sampling_of"]

RETRY_AFTER_S = 1  # what a rejected request's Retry-After says: pauses for weight updates last about that long


def _server() -> Any:
    """The module that builds the engine of the installed release's server."""
    if upstream.release() in upstream.SERVER_WITH_MANAGER:
        from . import serving_manager as server
    else:
        from . import serving_engine as server
    return server


class ServedRequests:
    """What the generation engine of either server (:mod:`.serving_manager`, :mod:`.serving_engine`) keeps about the
    requests it serves, on the running cbpause manager ``_cb``.

    ``outcomes`` counts the requests by how they ended (``finished``, ``failed``, ``cancelled``, ``rejected``,
    ``aborted``), for the server's metrics.
    """

    _cb: PausableContinuousBatchingManager

    def _serve(self, manager: PausableContinuousBatchingManager) -> None:
        self._cb = manager
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        # The x-request-ids of cbpause.serve.openai's requests in flight, whose choices run under ids of their own.
        self.client_ids: set[str] = set()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def _refuse_duplicate(self, request_id: str) -> None:
        """A 409 for an ``x-request-id`` still in flight (its result not delivered, or its handler not yet gone),
        before anything is registered under it: the first request's answer is untouched.  Atomic against another
        request with that id: both run on the event loop, with no ``await`` between this check and the enqueue."""
        router = self._cb.output_router
        if request_id in self._cb._live_ids or request_id in router.result_handlers:
            from fastapi import HTTPException

            self.count("failed")
            raise HTTPException(status_code=409, detail=f"x-request-id {request_id!r} is in use by a request in "
                                "flight: wait for its answer, or send another id")  # fmt: skip

    def _enqueue(self, request_id: str, prompt: list[int], max_new_tokens: int, eos_token_id: Any, streaming: bool,
                 on_output: Any, sampling: Any = None) -> None:  # fmt: skip
        """``on_output`` registered for ``request_id``'s outputs (on the running event loop), then the request added
        (sampled with ``sampling``, a :class:`~cbpause.integrations.sampling.SamplingParams`, or the checkpoint's
        configuration); a refusal (a pause in reject mode: 503; the request's own fault: 400; a stopped loop: the
        engine's dead error) takes the handler back, so that nothing is left registered under the id and a retry
        with it is served."""
        cb = self._cb
        cb.register_result_handler(request_id, on_output)
        added = None
        try:
            added = cb.add_request(prompt, request_id=request_id, max_new_tokens=max_new_tokens, streaming=streaming,
                                   eos_token_id=eos_token_id, sampling=sampling)  # fmt: skip
        except LoopPausedError as error:
            raise _refused(self, "rejected", str(error)) from error
        except (TypeError, ValueError) as error:  # refused at the door (a prompt too long for the cache...)
            from fastapi import HTTPException

            self.count("failed")
            raise HTTPException(status_code=400, detail=str(error)) from error
        finally:
            if added is None:
                router = cb.output_router
                with router._lock:
                    router.result_handlers.pop(request_id, None)
        if added is None:  # the loop stopped since the check: nothing would ever answer this request
            self.count("failed")
            raise self._dead(f"the generation loop no longer takes requests; {request_id} refused")

    def _dead(self, message: str) -> Exception:
        """A 503 for a loop that is not running, has died or is stopping (OpenAI's shape on ``/v1/``)."""
        from fastapi import HTTPException

        return HTTPException(status_code=503, detail=message)

    def _stopping(self) -> bool:
        """Whether the loop died, stopped, or was asked to stop: a request it failed then is the server's end, not
        the request's fault."""
        status = self._cb.background_thread_status
        return status.fatal_error is not None or status.state.local_status != DONT_STOP or not self._cb.is_running()

    def _stream_restarted(self, request_id: str, streamed: int) -> str:
        """The error a stream ends with when the staleness bound restarted its request after ``streamed`` tokens
        were sent (decision, ``docs/serving.md``: tokens sent cannot be taken back, so the stream ends, the request
        is cancelled in the loop, and the client retries; found by issue 41's hostile review: the client got the old
        tokens, then the restarted answer, more than ``max_tokens`` and labels of the new version only)."""
        self._cb.cancel_request(request_id)
        self.count("aborted")
        return (f"{STALE}: request {request_id} was restarted by the staleness bound after {streamed} tokens were "
                "streamed; retry it")  # fmt: skip

    def _note_end(self, result: Any) -> None:
        """A streamed request's terminal output: its outcome counted."""
        if result.error is None:
            self.count("finished")
        elif str(result.error).startswith((ABORTED_BY_PAUSE, STALE)):
            self.count("aborted")
        elif str(result.error) == upstream.CANCELLED:  # its client left (5.23-5.24: the stream's cancellation)
            self.count("cancelled")
        else:
            self.count("failed")

    def _settle(self, request_id: str, result: Any) -> None:
        """A non-streamed request's terminal output: counted, and an error raised as its HTTP answer (503 with
        Retry-After for an abort or the staleness bound; 400 for a request too long for the cache, found once the
        loop built it; the engine's dead error if the loop died; 500 otherwise)."""
        if result.error is not None and str(result.error).startswith((ABORTED_BY_PAUSE, STALE)):
            raise _refused(self, "aborted", f"request {request_id} was aborted: {result.error}; retry it")
        if result.error is not None:
            from fastapi import HTTPException

            self.count("failed")
            if str(result.error).startswith(TOO_LONG):
                raise HTTPException(status_code=400, detail=str(result.error))
            if self._stopping():  # a stop's flush ran out, or the loop died (a plain 500 before issue 41's review)
                raise self._dead(f"the generation loop stopped during request {request_id}: {result.error}")
            raise HTTPException(status_code=500, detail=f"generation failed for {request_id}: {result.error}")
        self.count("finished")


class RestartWatch:
    """Whether the staleness bound restarted a streamed request after tokens of it were sent (read on the event loop
    from the manager's restart counts, which the loop's thread raises at each restart and drops at the request's
    terminal output).  A restart before any token was sent is harmless: the stream starts from the restarted
    answer."""

    def __init__(self, manager: PausableContinuousBatchingManager, request_id: str) -> None:
        self._restarts, self._id = manager.versions.restarts, request_id
        self._seen = self._restarts.get(request_id, 0)

    def restarted(self, sent: int) -> bool:
        now = self._restarts.get(self._id, 0)
        if now <= self._seen:  # none since (or the terminal output dropped the count)
            return False
        if sent == 0:
            self._seen = now
            return False
        return True


@dataclass
class Built:
    """What a server module's ``build`` made, for :func:`openai_app` to wire: the model and its processor, the started
    cbpause manager, the engine on it, transformers' model manager and handlers (by ``build_server``'s argument
    names), ``build_server``'s other arguments, and the ASGI middleware that engine needs."""

    model: Any
    processor: Any
    manager: PausableContinuousBatchingManager
    generate: ServedRequests
    model_manager: Any
    handlers: dict[str, Any]
    server_kwargs: dict[str, Any] = field(default_factory=dict)
    middleware: tuple[Any, ...] = ()


class JoinFailed(RuntimeError):
    """A rank of a tensor-parallel engine could not join the others (:meth:`TensorParallel.join`)."""


@dataclass(frozen=True)
class TensorParallel:
    """This server is rank ``rank`` of an engine of ``size`` tensor-parallel ranks, one ``cbpause serve`` process
    each (``--tp-size``, ``--tp-rank``, ``--tp-init-method``, ``--tp-backend``; issue 42's relay, docs/serving.md).

    The ranks meet in torch.distributed's default process group at ``init_method`` (``tcp://HOST:PORT``, the same on
    every rank), before the model loads; the model loads sharded over them (transformers' TP:
    ``DistributedConfig(tp_size=size)``, each parameter a ``DTensor``).  Rank 0, the driver, takes the generation
    requests and the group shares them; the others refuse them (409).  Every rank serves the control routes: a
    trainer pauses every rank (R-SAME-WINDOW: a rank paused alone parks its peers for ``peer_park_timeout``, D3) and
    each rank receives the whole of each tensor of an update, and copies its shard of it
    (:class:`cbpause.integrations.transfer.ModelWriter`)."""

    size: int
    rank: int
    init_method: str
    backend: str = "gloo"
    timeout: float = 600.0  # the wait for every rank at start-up, and each collective's deadline on the ranks' groups

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and self.size >= 2):
            raise ValueError(f"a tensor-parallel engine has 2 ranks or more, not {self.size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"the rank must be in 0..{self.size - 1}, not {self.rank!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"the backend must be 'gloo' or 'nccl', not {self.backend!r}")
        # (not file://: torch waits for ever on a file whose folder is missing; review)
        if not (isinstance(self.init_method, str) and self.init_method.startswith("tcp://")):
            raise ValueError(f"init_method must be 'tcp://HOST:PORT', not {self.init_method!r}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not 0 < self.timeout < 1e6:
            raise ValueError(f"timeout must be a number of seconds above 0, not {self.timeout!r}")

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def join(self, device: str = "cpu") -> None:
        """Join the default process group of the ``size`` ranks: each waits there for the others, ``timeout`` seconds
        (:class:`JoinFailed` then: the server exits, naming the wait, instead of never answering; torch's own
        connection retries may make it take longer, not for ever).  On a CUDA
        ``device`` (``cuda:R``) that device becomes the process's current one first, where NCCL and the sharded
        model's loading look for it."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if str(device).startswith("cuda"):
            torch.cuda.set_device(torch.device(device))

        if dist.is_initialized():
            if (dist.get_world_size(), dist.get_rank()) != (self.size, self.rank):
                raise ValueError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, not "
                                 f"{self.rank} of {self.size}")  # fmt: skip
            return
        try:
            dist.init_process_group(self.backend, init_method=self.init_method, rank=self.rank, world_size=self.size,
                                    timeout=timedelta(seconds=self.timeout))  # fmt: skip
        except Exception as error:  # the store's timeout, a refused connection, an address in use...
            raise JoinFailed(f"rank {self.rank} of {self.size} could not join the other ranks at "
                               f"{self.init_method} (timeout {self.timeout} s): {error}") from error  # fmt: skip


def load_sharded(loader: Any, checkpoint: str, tp: TensorParallel) -> None:
    """Make transformers serve's model loader (5.23-5.24's ``ModelManager``, 5.25's ``ModelLoader``) load
    ``checkpoint`` sharded over the ranks of ``tp``: its ``_load_model`` replaced on the instance
    (:data:`~cbpause.integrations.upstream.REPLACED`), with the loader's dtype, attention and trust settings, as a
    causal LM (transformers serve has no tensor parallelism of its own)."""

    def _load_model(*_: Any, **__: Any) -> Any:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(
            checkpoint, dtype=loader.dtype, attn_implementation=loader.attn_implementation,
            trust_remote_code=loader.trust_remote_code, distributed_config=DistributedConfig(tp_size=tp.size),
        )  # fmt: skip

    loader._load_model = _load_model


def _refused(generate: ServedRequests, outcome: str, message: str) -> Exception:
    """A 503 with Retry-After: refused during a pause (``rejected``), or ended by an abort pause or the staleness
    bound (``aborted``): nothing of it is delivered, and the client may send it again."""
    from fastapi import HTTPException

    generate.count(outcome)
    return HTTPException(status_code=503, detail=message, headers={"Retry-After": str(RETRY_AFTER_S)})


# The generation route whose handler is transformers serve's (the others are cbpause.serve.openai's), and the key of
# its token budget.
GENERATION_ROUTES = {"/v1/responses": "max_output_tokens"}
# Arguments /v1/responses cannot honour (its requests are sampled with the server's default configuration, the
# checkpoint's, and only the token budget and the end-of-sequence ids go down): each is refused unless absent or its
# neutral value, so that no client believes it got what it asked.
NEUTRAL = {"n": (1,), "best_of": (1,), "seed": (), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
           "logit_bias": ({},), "stop": ([],), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
           "generation_config": (), "top_k": ()}  # fmt: skip


# Arguments transformers' handlers take as they come, and the type each must have (found by issue 41's hostile review:
# "stream_options": "x" was a 500 with nothing enqueued, a numeric "suffix" a 500 after the request had run).
SHAPES = (("stream_options", dict, "an object"), ("suffix", str, "a string"), ("stream", bool, "true or false"))


def sampling_of(generation_config: Any) -> dict[str, float]:
    """The temperature and top_p every request is sampled with (greedy: temperature 0, top_p 1)."""
    if not getattr(generation_config, "do_sample", False):
        return {"temperature": 0.0, "top_p": 1.0}
    return {"temperature": float(generation_config.temperature or 1.0), "top_p": float(generation_config.top_p or 1.0)}


def check_generation_body(route: str, body: dict, *, served: str, checkpoint: str, sampling: dict[str, float],
                          chat: bool) -> dict:  # fmt: skip
    """A generation request's body as transformers' handler must see it, or ``ValueError`` naming every argument the
    server cannot honour (decision, ``docs/serving.md``: refused, not ignored).  ``model`` may be the served name
    (``--served-model-name``, default the checkpoint as given), which becomes the checkpoint upstream is pinned to."""
    refused = []
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            refused.append(f"{key}={value!r}")
    for key, value in sampling.items():
        asked = body.get(key)
        if asked is None:
            continue
        if isinstance(asked, bool) or not isinstance(asked, (int, float)) or abs(float(asked) - value) > 1e-6:
            refused.append(f"{key}={asked!r} (this server samples with {key}={value})")
    budget = GENERATION_ROUTES[route]
    for key in {budget, "max_tokens"}:
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            refused.append(f"{key}={value!r} (a positive integer)")
    for key, kind, what in SHAPES:  # upstream's handlers read these without checking them: a 500 otherwise
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            refused.append(f"{key}={value!r} ({what})")
    if not chat:
        raise ValueError("this checkpoint has no chat template: use /v1/completions with a prompt")
    if refused:
        raise ValueError(f"this server cannot honour: {', '.join(refused)}")
    model = body.get("model")
    if model is not None and model not in (served, checkpoint):
        raise ValueError(f"this server serves {served!r}, not {model!r}")
    return {**body, "model": checkpoint}


class _GenerationChecks:
    """Pure ASGI middleware: each ``/v1/responses`` request's body through :func:`check_generation_body` (a 400 naming
    what is refused)."""

    def __init__(self, app: Any, follower: TensorParallel | None = None, **checks: Any) -> None:
        self.app, self.checks, self.follower = app, checks, follower

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or path not in GENERATION_ROUTES:
            await self.app(scope, receive, send)
            return
        import json

        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if self.follower is not None:  # its requests would not be in the batch the driver shares with the group
            tp = self.follower
            await _send_json(send, 409, openai_error(
                f"this server is rank {tp.rank} of a tensor-parallel engine of {tp.size} ranks: generation requests "
                "go to rank 0, its driver"))  # fmt: skip
            return
        chunks, more = [], True
        while more:  # the Guard in front has bounded the body's size and checked that it is a JSON object
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        try:
            body = json.loads(b"".join(chunks) or b"{}")  # whatever its Content-Type says
            if not isinstance(body, dict):
                raise ValueError(f"the body must be a JSON object, not {type(body).__name__}")
            body = check_generation_body(path, body, **self.checks)
        except (ValueError, RecursionError) as error:
            await _send_json(send, 400, openai_error(str(error)))
            return
        raw = json.dumps(body).encode()
        headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(raw)).encode())]}
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def openai_error(message: str, kind: str = "invalid_request_error") -> dict:
    """An error body as OpenAI's API gives one (its clients read ``error.message``)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


async def _send_json(send: Any, status: int, payload: dict) -> None:
    import json

    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def openai_app(
    checkpoint: str, *, device: str = "cpu", dtype: str = "auto", continuous_batching_config: Any = None,
    served_model_name: str | None = None, tensor_parallel: TensorParallel | None = None, **manager_kwargs: Any,
) -> tuple[Any, PausableContinuousBatchingManager, ServedRequests]:
    """transformers serve's FastAPI app for ``checkpoint`` (a local directory), on a started cbpause manager.

    ``served_model_name``: the model's name in ``/v1/models`` and in requests (default: ``checkpoint`` as given);
    requests naming it or ``checkpoint`` are served, others refused.  ``/v1/responses`` requests pass
    :func:`check_generation_body` first.  ``tensor_parallel``: this server is one rank of a tensor-parallel engine
    (:class:`TensorParallel`; its process group joined already): the model loads sharded, and a rank other than the
    driver refuses generation requests (409).

    Returns ``(app, manager, generate)``: the app (``/v1/responses`` and ``/health`` are transformers'; its
    ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` are removed, for :mod:`cbpause.serve.openai`'s,
    which read ``app.state.model``, ``processor``, ``follower``, ``served_name`` and ``chat``), the
    :class:`PausableContinuousBatchingManager` (built with ``per_request_sampling=True`` and ``manager_kwargs``:
    ``while_paused``, ``max_staleness``...) and the generation engine in between (the installed release's:
    :mod:`.serving_manager` or :mod:`.serving_engine`).
    """
    from transformers.cli.serving.server import build_server

    served = served_model_name if served_model_name is not None else checkpoint
    if not isinstance(served, str) or not served.strip():
        raise ValueError(f"served_model_name must be a non-empty string, not {served!r}")
    config = continuous_batching_config if continuous_batching_config is not None else _default_batching()
    built = _server().build(checkpoint, device=device, dtype=dtype, continuous_batching_config=config,
                            tensor_parallel=tensor_parallel, per_request_sampling=True, **manager_kwargs)  # fmt: skip
    generate, handlers = built.generate, built.handlers
    try:
        app = build_server(built.model_manager, **built.server_kwargs, **handlers)
        # Not transformers serve's /reset and /load_model (they would unload the model the manager steps), nor the
        # routes that run a model outside the pausable loop (upstream.REMOVED_ROUTES says which and why).
        app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in upstream.REMOVED_ROUTES]
        for middleware in built.middleware:
            app.add_middleware(middleware)
        processor = built.processor
        chat = getattr(processor, "chat_template", None) is not None or getattr(
            getattr(processor, "tokenizer", None), "chat_template", None) is not None  # fmt: skip
        follower = None if tensor_parallel is None or tensor_parallel.driver else tensor_parallel
        app.add_middleware(_GenerationChecks, served=served, checkpoint=checkpoint, follower=follower,
                           sampling=sampling_of(built.model.generation_config), chat=chat)  # fmt: skip
        # What cbpause.serve's own routes (/v1/completions, /v1/chat/completions, /v1/models) read.
        app.state.model, app.state.processor, app.state.follower = built.model, processor, follower
        app.state.served_name, app.state.checkpoint, app.state.chat = served, checkpoint, chat
        _openai_errors(app)
    except BaseException:
        built.manager.stop(block=True, timeout=10)
        raise
    return app, built.manager, generate


def _default_batching() -> Any:
    """A batching config of transformers' defaults (the server's manager changes it: per-request sampling)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig()


def _openai_errors(app: Any) -> None:
    """An ``HTTPException`` raised on a ``/v1/`` route (transformers' handlers' and this module's: a duplicate id, an
    empty prompt), or a ``ValueError`` (a request's fault, as transformers 5.25's handlers raise one: a prompt longer
    than the model's context, a model not served), answers in OpenAI's shape, ``{"error": {"message", ...}}``, which
    OpenAI's clients read; elsewhere FastAPI's own ``{"detail": ...}``."""
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def openai_shaped(request: Any, error: HTTPException) -> Any:
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, error)
        detail = error.detail if isinstance(error.detail, str) else json_text(error.detail)
        kind = "server_error" if error.status_code >= 500 else "invalid_request_error"
        return JSONResponse(openai_error(detail, kind), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ValueError)
    async def bad_request(request: Any, error: ValueError) -> Any:
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": str(error)}, status_code=400)
        return JSONResponse(openai_error(str(error)), status_code=400)


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, default=str)
