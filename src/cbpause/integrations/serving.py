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
* a non-streamed answer carries ``weight_versions`` and ``kv_versions``: ``[first_token_index, version]`` spans over
  the generated tokens (R-VERSIONS, R-KV-VERSIONS).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections import Counter
from typing import Any

from transformers.cli.serving import utils as _serving
from transformers.cli.serving.server import build_server

from ..core.errors import LoopPausedError
from . import upstream
from .admission import TOO_LONG
from .modes import ABORTED_BY_PAUSE
from .transformers import PausableContinuousBatchingManager, init_continuous_batching
from .weights import STALE

__all__ = ["PausableCBGenerateManager", "RETRY_AFTER_S", "openai_app"]

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

    def generate_streaming(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().generate_streaming(*args, **kwargs)
        except LoopPausedError as error:
            raise _rejected(self, error) from error

    async def generate_non_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any,
                                     request_id: str) -> tuple[str, int, list[int]]:  # fmt: skip
        """Upstream's, plus: a refusal while paused is a 503, the client's disconnect cancels the request, and the
        output's version labels are kept for the answer (:func:`_with_versions`)."""
        cb = self._cb
        self._check_alive(request_id)
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


def _jsonable(spans: list) -> list:
    """``(first_token_index, version)`` spans as JSON pairs (a version JSON cannot hold, ``PartialSync``, as text)."""
    return [[i, v if v is None or isinstance(v, (int, float, str, bool)) else str(v)] for i, v in spans]


def openai_app(
    checkpoint: str, *, device: str = "cpu", dtype: str = "auto", continuous_batching_config: Any = None,
    **manager_kwargs: Any,
) -> tuple[Any, PausableContinuousBatchingManager, PausableCBGenerateManager]:
    """transformers serve's FastAPI app for ``checkpoint`` (a local directory), on a started cbpause manager.

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
    app = build_server(models, generation_state=state, **handlers)
    # Not transformers serve's /reset and /load_model: they would unload the model the manager steps.
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in upstream.REMOVED_ROUTES]
    app.add_middleware(_DisconnectWatch)
    return app, manager, generate
