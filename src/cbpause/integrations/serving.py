"""transformers' own OpenAI-compatible server (``transformers serve``) on a cbpause manager (issue 29).

The only module of cbpause that knows ``transformers.cli.serving``'s internals: the OpenAI routes, their
handlers and their model loading are transformers' own (:func:`openai_app`); what changes is the generation
manager behind them.  Every change it makes there (the subclass's overrides, the handlers' wrapped
``_non_streaming``, the generation state's private attributes it sets, the routes it removes, the wiring it
restates) is in :mod:`cbpause.integrations.upstream`'s table, with a fingerprint of each upstream function it
touches.  ``transformers serve`` builds its continuous-batching manager lazily, on the first request, with that
request's sampling settings; here the manager is a :class:`PausableContinuousBatchingManager` built at
start-up, with the checkpoint's generation config (decision: one sampling configuration per server, the
checkpoint's, so that a pause never waits for a manager that does not exist yet).  Per request:

* ``while_paused="reject"``: a request during a pause gets ``503`` with ``Retry-After`` and is not enqueued;
* a non-streamed request ended by an ``abort`` pause or by the staleness bound gets ``503`` with ``Retry-After``
  (decision: the client sends it again; its partial tokens are not delivered);
* a client that disconnects while its request waits (queued during a pause, or running) has it cancelled, so no
  request runs for a client that left;
* an answer carries ``weight_versions`` and ``kv_versions``: ``[first_token_index, version]`` spans over the
  generated tokens (R-VERSIONS, R-KV-VERSIONS), a streamed one in its last chunk; a streamed request is counted by
  outcome in ``/metrics`` as a non-streamed one is.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter
from typing import Any

from . import upstream

if upstream.release() not in upstream.SERVED:
    raise ImportError(
        f"cbpause serve runs on the server of transformers {', '.join(upstream.SERVED)}, not "
        f"{upstream.release()}: transformers 5.25 rebuilt `transformers serve` (a worker process per model), and the "
        f"port is not done (issue 41); install one with `pip install 'cbpause[serve]'` (the continuous-batching "
        "integration itself runs on 5.25)"
    )

from transformers.cli.serving import utils as _serving  # noqa: E402
from transformers.cli.serving.server import build_server  # noqa: E402

from ..core.errors import LoopPausedError  # noqa: E402
from .admission import TOO_LONG  # noqa: E402
from .modes import ABORTED_BY_PAUSE  # noqa: E402
from .transformers import PausableContinuousBatchingManager, init_continuous_batching  # noqa: E402
from .weights import STALE  # noqa: E402

__all__ = ["GENERATION_ROUTES", "NEUTRAL", "PausableCBGenerateManager", "RETRY_AFTER_S", "check_generation_body",
           "openai_app", "openai_error", "sampling_of"]

RETRY_AFTER_S = 1  # what a rejected request's Retry-After says: pauses for weight updates last about that long

# The ASGI receive channel of the HTTP request being handled: generate_non_streaming listens on it for the client's
# disconnect (transformers' handlers do not pass the request down).  Set by _DisconnectWatch, per request.
_RECEIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("cbpause_receive", default=None)


class _DisconnectWatch:
    """Pure ASGI middleware: remembers each HTTP request's receive channel in :data:`_RECEIVE`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        token = _RECEIVE.set(receive) if scope["type"] == "http" else None
        try:
            await self.app(scope, receive, send)
        finally:
            if token is not None:
                _RECEIVE.reset(token)


class PausableCBGenerateManager(_serving.CBGenerateManager):
    """transformers serve's continuous-batching generation manager on a running cbpause manager.

    ``outcomes`` counts the requests by how they ended (``finished``, ``failed``, ``cancelled``, ``rejected``,
    ``aborted``), for the server's metrics; ``versions`` holds each finished non-streamed request's labels until its
    answer is built.
    """

    def __init__(self, manager: PausableContinuousBatchingManager) -> None:
        super().__init__(cb_config=manager.continuous_batching_config)
        self._cb = manager
        self.outcomes: Counter[str] = Counter()
        self.versions: dict[str, tuple[list, list]] = {}
        self._lock = threading.Lock()

    def count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] += 1

    def init_cb(self, model: Any, gen_config: Any) -> None:
        """The manager was built at start-up: nothing to do (upstream builds one here, on the first request)."""

    def _check_alive(self, request_id: str) -> None:
        if not self._cb.is_running():
            raise _serving.CBWorkerDeadError(f"the generation loop is not running; request {request_id} refused")
        super()._check_alive(request_id)

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

    def generate_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any, request_id: str,
                           *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        self._refuse_duplicate(request_id)
        try:
            streamed = super().generate_streaming(model, processor, inputs, gen_config, request_id, *args, **kwargs)
        except LoopPausedError as error:
            raise _rejected(self, error) from error
        self._record_stream(request_id)
        return streamed

    def _record_stream(self, request_id: str) -> None:
        """Wrap the handler upstream registered for a streamed request, so that its last output is counted by outcome
        (``/metrics``) and its version labels kept for the last chunk (:func:`_with_stream_versions`).  No ``await``
        since upstream registered it: no output of this request can have been dispatched to it yet."""
        router = self._cb.output_router
        with router._lock:
            entry = router.result_handlers.get(request_id)
            if entry is None:
                return
            callback, loop = entry

            def recording(result: Any) -> None:
                if result.is_finished():
                    self._note_end(request_id, result)
                callback(result)

            router.result_handlers[request_id] = (recording, loop)

    def _note_end(self, request_id: str, result: Any) -> None:
        """A streamed request's terminal output: its outcome counted, its labels kept until its last chunk."""
        if result.error is None:
            self.count("finished")
            with self._lock:
                self.versions[request_id] = (list(result.weight_versions), list(getattr(result, "kv_versions", [])))
        elif str(result.error).startswith((ABORTED_BY_PAUSE, STALE)):
            self.count("aborted")
        else:
            self.count("failed")

    async def generate_non_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any,
                                     request_id: str) -> tuple[str, int, list[int]]:  # fmt: skip
        """Upstream's, plus: a refusal while paused is a 503, the client's disconnect cancels the request, and the
        output's version labels are kept for the answer (:func:`_with_versions`)."""
        cb = self._cb
        self._check_alive(request_id)
        self._refuse_duplicate(request_id)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        cb.register_result_handler(request_id, lambda result: future.done() or future.set_result(result))
        try:
            added = cb.add_request(inputs["input_ids"], request_id=request_id, max_new_tokens=gen_config.max_new_tokens,
                                   streaming=False, eos_token_id=gen_config.eos_token_id)  # fmt: skip
        except LoopPausedError as error:
            raise _rejected(self, error) from error
        except (TypeError, ValueError) as error:  # refused at the door (a duplicate x-request-id, a prompt too long)
            from fastapi import HTTPException

            self.count("failed")
            raise HTTPException(status_code=400, detail=str(error)) from error
        if added is None:  # the loop stopped since the check: nothing would ever answer this request
            self.count("failed")
            raise _serving.CBWorkerDeadError(f"the generation loop no longer takes requests; {request_id} refused")
        result = await _unless_disconnected(future, cb, request_id, self)
        if result.error is not None and str(result.error).startswith((ABORTED_BY_PAUSE, STALE)):
            raise _refused(self, "aborted", f"request {request_id} was aborted: {result.error}; retry it")
        if result.error is not None:
            self.count("failed")
            if str(result.error).startswith(TOO_LONG):  # the request's own fault, found once the loop built its cache
                from fastapi import HTTPException

                raise HTTPException(status_code=400, detail=str(result.error))
            if cb.background_thread_status.fatal_error is not None:
                raise _serving.CBWorkerDeadError(f"the loop died during request {request_id}: {result.error}")
            raise RuntimeError(f"generation failed for {request_id}: {result.error}")
        self.count("finished")
        with self._lock:
            self.versions[request_id] = (list(result.weight_versions), list(getattr(result, "kv_versions", [])))
        text = processor.decode(result.generated_tokens, skip_special_tokens=True)
        return text, len(inputs["input_ids"]), result.generated_tokens

    def stop(self) -> None:
        self._cb.stop(block=True, timeout=10)


def _rejected(generate: PausableCBGenerateManager, error: LoopPausedError) -> Exception:
    return _refused(generate, "rejected", str(error))


def _refused(generate: PausableCBGenerateManager, outcome: str, message: str) -> Exception:
    """A 503 with Retry-After: refused during a pause (``rejected``), or ended by an abort pause or the staleness
    bound (``aborted``): nothing of it is delivered, and the client may send it again."""
    from fastapi import HTTPException

    generate.count(outcome)
    return HTTPException(status_code=503, detail=message, headers={"Retry-After": str(RETRY_AFTER_S)})


async def _unless_disconnected(future: asyncio.Future, cb: Any, request_id: str, generate: Any) -> Any:
    """The request's result, or, if the client disconnects first, ``cancel_request`` and ``CancelledError``."""
    receive = _RECEIVE.get()
    if receive is None:
        return await future
    listener = asyncio.ensure_future(_disconnect(receive))
    try:
        done, _ = await asyncio.wait({future, listener}, return_when=asyncio.FIRST_COMPLETED)
        if future in done:
            return future.result()
        cb.cancel_request(request_id)
        generate.count("cancelled")
        raise asyncio.CancelledError(f"client disconnected; request {request_id} cancelled")
    finally:
        listener.cancel()


async def _disconnect(receive: Any) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


# The generation routes, and the key of each one's token budget.
GENERATION_ROUTES = {"/v1/completions": "max_tokens", "/v1/chat/completions": "max_completion_tokens",
                     "/v1/responses": "max_output_tokens"}  # fmt: skip
# Arguments the loop cannot honour (it samples every request with the server's one configuration, the checkpoint's,
# and passes only the token budget and the end-of-sequence ids down): each is refused unless absent or its neutral
# value, so that no client believes it got what it asked.
NEUTRAL = {"n": (1,), "best_of": (1,), "seed": (), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
           "logit_bias": ({},), "stop": ([],), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
           "generation_config": (), "top_k": ()}  # fmt: skip


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
    if route in ("/v1/chat/completions", "/v1/responses") and not chat:
        raise ValueError("this checkpoint has no chat template: use /v1/completions with a prompt")
    if refused:
        raise ValueError(f"this server cannot honour: {', '.join(refused)}")
    model = body.get("model")
    if model is not None and model not in (served, checkpoint):
        raise ValueError(f"this server serves {served!r}, not {model!r}")
    return {**body, "model": checkpoint}


class _GenerationChecks:
    """Pure ASGI middleware: each generation request's body through :func:`check_generation_body` (a 400 naming
    what is refused), and ``GET /v1/models`` answered with the served model (transformers serve's lists the Hugging
    Face cache, and fails without one)."""

    def __init__(self, app: Any, **checks: Any) -> None:
        self.app, self.checks = app, checks

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or (path not in GENERATION_ROUTES and path != "/v1/models"):
            await self.app(scope, receive, send)
            return
        import json

        if path == "/v1/models":
            if scope.get("method") not in ("GET", "HEAD", "OPTIONS"):
                await self.app(scope, receive, send)
                return
            served = self.checks["served"]
            await _send_json(send, 200, {"object": "list", "data": [{"id": served, "object": "model", "created": 0,
                                                                      "owned_by": "cbpause"}]})  # fmt: skip
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
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


def _with_versions(handle: Any, generate: PausableCBGenerateManager) -> Any:
    """Wrap a handler's ``_non_streaming`` so that the JSON answer carries the request's version labels."""
    import json

    from fastapi.responses import JSONResponse

    async def non_streaming(request_id: str, *args: Any, **kwargs: Any) -> Any:
        response = await handle(request_id, *args, **kwargs)
        with generate._lock:
            labels = generate.versions.pop(request_id, None)
        if labels is None or not isinstance(response, JSONResponse):
            return response
        body = json.loads(response.body)
        body["weight_versions"], body["kv_versions"] = (_jsonable(labels[0]), _jsonable(labels[1]))
        return JSONResponse(body, status_code=response.status_code)

    return non_streaming


def _with_stream_versions(handle: Any, generate: PausableCBGenerateManager) -> Any:
    """Wrap a handler's ``_streaming`` so that the last chunk of a streamed answer (the one with ``finish_reason``)
    carries the request's ``weight_versions`` and ``kv_versions``, as a non-streamed answer does."""

    def streaming(request_id: str, *args: Any, **kwargs: Any) -> Any:
        response = handle(request_id, *args, **kwargs)
        inner = getattr(response, "body_iterator", None)
        if inner is None:
            return response

        async def labelled() -> Any:
            last = None
            try:
                async for chunk in inner:
                    if last is not None:
                        yield last
                    last = chunk
                if last is not None:
                    with generate._lock:
                        labels = generate.versions.pop(request_id, None)
                    yield last if labels is None else _labelled_chunk(last, labels)
            finally:
                with generate._lock:
                    generate.versions.pop(request_id, None)

        response.body_iterator = labelled()
        return response

    return streaming


def _labelled_chunk(chunk: Any, labels: tuple[list, list]) -> Any:
    """The SSE chunk ``data: {...}`` with the version labels added (any other chunk as it is)."""
    import json

    text = chunk.decode() if isinstance(chunk, bytes) else chunk
    if not text.startswith("data: ") or text.count("data: ") != 1:
        return chunk
    try:
        body = json.loads(text[len("data: "):])
    except ValueError:
        return chunk
    if not isinstance(body, dict) or "error" in body:
        return chunk
    body["weight_versions"], body["kv_versions"] = _jsonable(labels[0]), _jsonable(labels[1])
    out = f"data: {json.dumps(body)}\n\n"
    return out.encode() if isinstance(chunk, bytes) else out


def _jsonable(spans: list) -> list:
    """``(first_token_index, version)`` spans as JSON pairs (a version JSON cannot hold, ``PartialSync``, as text)."""
    return [[i, v if v is None or isinstance(v, (int, float, str, bool)) else str(v)] for i, v in spans]


def openai_app(
    checkpoint: str, *, device: str = "cpu", dtype: str = "auto", continuous_batching_config: Any = None,
    served_model_name: str | None = None, **manager_kwargs: Any,
) -> tuple[Any, PausableContinuousBatchingManager, PausableCBGenerateManager]:
    """transformers serve's FastAPI app for ``checkpoint`` (a local directory), on a started cbpause manager.

    ``served_model_name``: the model's name in ``/v1/models`` and in requests (default: ``checkpoint`` as given);
    requests naming it or ``checkpoint`` are served, others refused.  Generation requests pass
    :func:`check_generation_body` first.

    Returns ``(app, manager, generate)``: the app (``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
    ``/v1/models`` and ``/health`` are transformers'), the :class:`PausableContinuousBatchingManager` (built with
    ``manager_kwargs``: ``while_paused``, ``max_staleness``...) and the generation manager in between.
    """
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    models = ModelManager(device=device, dtype=dtype, continuous_batching=True, force_model=checkpoint)
    model_id = models.process_model_name(checkpoint)
    model, _processor = models.load_model_and_processor(model_id)
    manager = init_continuous_batching(model, model.generation_config, continuous_batching_config, **manager_kwargs)
    manager.start()
    state = _serving.GenerationState(continuous_batching=True, cb_config=manager.continuous_batching_config)
    generate = PausableCBGenerateManager(manager)
    state._cb_manager, state._cb_model_id = generate, model_id
    handlers = {
        "chat_handler": ChatCompletionHandler(model_manager=models, generation_state=state),
        "completion_handler": CompletionHandler(model_manager=models, generation_state=state),
        "response_handler": ResponseHandler(model_manager=models, generation_state=state),
        "transcription_handler": TranscriptionHandler(models, state),
        "systemone_handler": SystemOneHandler(model_manager=models, generation_state=state),
    }
    for name in ("chat_handler", "completion_handler"):
        handlers[name]._non_streaming = _with_versions(handlers[name]._non_streaming, generate)
        handlers[name]._streaming = _with_stream_versions(handlers[name]._streaming, generate)
    app = build_server(models, generation_state=state, **handlers)
    # Not transformers serve's /reset and /load_model: they would unload the model the manager steps.
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in upstream.REMOVED_ROUTES]
    app.add_middleware(_DisconnectWatch)
    served = served_model_name if served_model_name is not None else checkpoint
    if not isinstance(served, str) or not served.strip():
        raise ValueError(f"served_model_name must be a non-empty string, not {served!r}")
    chat = getattr(_processor, "chat_template", None) is not None or getattr(
        getattr(_processor, "tokenizer", None), "chat_template", None) is not None  # fmt: skip
    app.add_middleware(_GenerationChecks, served=served, checkpoint=checkpoint,
                       sampling=sampling_of(model.generation_config), chat=chat)  # fmt: skip
    _openai_errors(app)
    return app, manager, generate


def _openai_errors(app: Any) -> None:
    """An ``HTTPException`` raised on a ``/v1/`` route (transformers' handlers' and this module's: a duplicate id, an
    empty prompt) answers in OpenAI's shape, ``{"error": {"message", ...}}``, which OpenAI's clients read; elsewhere
    FastAPI's own ``{"detail": ...}``."""
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def openai_shaped(request: Any, error: HTTPException) -> Any:
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, error)
        detail = error.detail if isinstance(error.detail, str) else json_text(error.detail)
        return JSONResponse(openai_error(detail), status_code=error.status_code, headers=error.headers)


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, default=str)
