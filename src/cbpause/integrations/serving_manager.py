"""The engine of transformers serve 5.23 and 5.24 on a cbpause manager (:mod:`.serving` wires it).

In these releases ``transformers serve`` runs the model in its own process: the handlers call a ``CBGenerateManager``
(held by the ``GenerationState``), which builds a continuous-batching manager lazily, on the first request.
:class:`PausableCBGenerateManager` is one on the cbpause manager built at start-up, set where upstream keeps its own
(``GenerationState._cb_manager``: :data:`~cbpause.integrations.upstream.SETS`).  The client's disconnect is seen
through the request's receive channel (:class:`_DisconnectWatch`): these releases' handlers do not pass the request
down, and their server does not cancel a handler whose client left.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

from transformers.cli.serving import utils as _serving
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler

from ..core.errors import LoopPausedError
from .serving import Built, RestartWatch, ServedRequests, _refused, load_sharded
from .transformers import PausableContinuousBatchingManager, init_continuous_batching

__all__ = ["PausableCBGenerateManager", "build"]

# The ASGI receive channel of the HTTP request being handled: generate_non_streaming listens on it for the client's
# disconnect.  Set by _DisconnectWatch, per request.
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


class PausableCBGenerateManager(ServedRequests, _serving.CBGenerateManager):
    """transformers serve's continuous-batching generation manager on a running cbpause manager
    (:class:`~cbpause.integrations.serving.ServedRequests` says what it keeps)."""

    def __init__(self, manager: PausableContinuousBatchingManager) -> None:
        super().__init__(cb_config=manager.continuous_batching_config)
        self._serve(manager)

    def init_cb(self, model: Any, gen_config: Any) -> None:
        """The manager was built at start-up: nothing to do (upstream builds one here, on the first request)."""

    def _check_alive(self, request_id: str) -> None:
        if not self._cb.is_running():
            raise self._dead(f"the generation loop is not running; request {request_id} refused")
        super()._check_alive(request_id)

    def generate_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any, request_id: str,
                           *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        self._refuse_duplicate(request_id)
        try:
            streamed = super().generate_streaming(model, processor, inputs, gen_config, request_id, *args, **kwargs)
        except LoopPausedError as error:  # upstream adds before it registers: nothing is left under the id
            raise _refused(self, "rejected", str(error)) from error
        self._record_stream(request_id)
        return streamed

    def _record_stream(self, request_id: str) -> None:
        """Wrap the handler upstream registered for a streamed request, so that its last output is counted by outcome
        (``/metrics``).  No ``await`` since upstream registered it: no output of this request can have been
        dispatched to it yet."""
        router = self._cb.output_router
        with router._lock:
            entry = router.result_handlers.get(request_id)
            if entry is None:
                return
            callback, loop = entry
            watch, sent, ended = RestartWatch(self._cb, request_id), 0, False

            def recording(result: Any) -> None:
                nonlocal sent, ended
                if ended:  # the stream ended at a restart: only the cancellation's terminal output, for the cleanup
                    if result.is_finished():
                        callback(result)
                    return
                if watch.restarted(sent):  # tokens sent cannot be taken back: upstream's streamer ends on an error
                    ended = True
                    result.error = self._stream_restarted(request_id, sent)
                    callback(result)
                    return
                sent = max(sent, len(result.generated_tokens))
                if result.is_finished():
                    self._note_end(result)
                callback(result)

            router.result_handlers[request_id] = (recording, loop)

    async def generate_non_streaming(self, model: Any, processor: Any, inputs: dict, gen_config: Any,
                                     request_id: str) -> tuple[str, int, list[int]]:  # fmt: skip
        """Upstream's, plus: a refusal while paused is a 503, and the client's disconnect cancels the request."""
        self._check_alive(request_id)
        self._refuse_duplicate(request_id)
        future = asyncio.get_running_loop().create_future()
        self._enqueue(request_id, inputs["input_ids"], gen_config.max_new_tokens, gen_config.eos_token_id, False,
                      lambda result: future.done() or future.set_result(result))  # fmt: skip
        result = await _unless_disconnected(future, self._cb, request_id, self)
        self._settle(request_id, result)
        text = processor.decode(result.generated_tokens, skip_special_tokens=True)
        return text, len(inputs["input_ids"]), result.generated_tokens

    def stop(self) -> None:
        self._cb.stop(block=True, timeout=10)


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


def build(checkpoint: str, *, device: str, dtype: str, continuous_batching_config: Any,
          tensor_parallel: Any = None, **manager_kwargs: Any) -> Built:  # fmt: skip
    """The model loaded by transformers serve's model manager, a started cbpause manager on it, and the handlers on
    a :class:`PausableCBGenerateManager` (the wiring of upstream's ``Serve.__init__``, restated)."""
    models = ModelManager.__new__(ModelManager)
    if tensor_parallel is not None:  # one rank of a TP engine: the model sharded (serving.load_sharded), in place
        load_sharded(models, checkpoint, tensor_parallel)  # before __init__, which loads force_model
    models.__init__(device=device, dtype=dtype, continuous_batching=True, force_model=checkpoint)
    model_id = models.process_model_name(checkpoint)
    model, processor = models.load_model_and_processor(model_id)
    manager = init_continuous_batching(model, model.generation_config, continuous_batching_config, **manager_kwargs)
    manager.start()
    try:
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
    except BaseException:
        manager.stop(block=True, timeout=10)
        raise
    return Built(model=model, processor=processor, manager=manager, generate=generate, model_manager=models,
                 handlers=handlers, server_kwargs={"generation_state": state},
                 middleware=(_DisconnectWatch,))  # fmt: skip
