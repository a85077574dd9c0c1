"""The engine of transformers serve 5.25 on a cbpause manager, in this process (:mod:`.serving` wires it).

transformers 5.25 rebuilt its server: the handlers ask a model's ``EngineClient`` for generations, and the client
sends them to a worker process that loads the model and runs upstream's own continuous-batching manager
(``CBGenerateRunner``).  cbpause serve keeps transformers' handlers and routes, and replaces the engine:
:class:`PausableEngine` answers the same calls on the cbpause manager built at start-up, in this process.

Decision (``docs/serving.md``): no worker process.  The control routes (a leased pause, a weight write, the
versions) act on the loop that steps the model and on its weights; in a worker process they would need a protocol
of their own across the process boundary, and the weights a copy per write.  What the worker process gave upstream
(the model's memory freed when idle, several API servers sharing one model) cbpause serve does not offer: one model,
loaded at start-up, served until the server stops.

It serves ``/v1/responses`` (the other generation routes are :mod:`cbpause.serve.openai`'s); 5.25's handlers do not
pass the request's id down, so the engine names each request itself, and it sees the client's disconnect through
upstream's ``CancelOnDisconnect``, which cancels the handler's task: the request is then cancelled in the loop
(non-streamed: the awaited result is cancelled; streamed: the stream's ``task``, which the handler cancels once its
stream ends, for whatever reason).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import EngineClient, ModelLoader, ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import (
    Detokenizer,
    GenerationState,
    ModelNotServedError,
    _StreamError,
    canonical_model_id,
)

from .serving import Built, RestartWatch, ServedRequests, load_sharded
from .transformers import PausableContinuousBatchingManager, init_continuous_batching

__all__ = ["PausableEngine", "PausableModelManager", "build"]


def _request_id() -> str:
    """A request's id in the loop (5.25's handlers do not pass theirs down)."""
    return f"cbpause-{uuid.uuid4().hex}"


def _pending(future: asyncio.Future) -> bool:
    """Whether ``future`` has no result: not done, or cancelled with the task that awaited it (a task cancelled while
    it awaits a future cancels that future too)."""
    return not future.done() or future.cancelled()


class _Restarted:
    """The end of a stream whose request the staleness bound restarted after ``sent`` tokens were streamed."""

    def __init__(self, sent: int) -> None:
        self.sent = sent


class PausableEngine(ServedRequests, EngineClient):
    """A model's engine, as transformers 5.25's handlers use it, on a running cbpause manager in this process
    (:class:`~cbpause.integrations.serving.ServedRequests` says what it keeps).  Upstream's client reads the model's
    config and processor (``model_config``, ``generation_config``, ``processor``, ``modality``, ``use_cb``); the
    calls that would start, feed or stop a worker process are answered here."""

    def __init__(self, model_id: str, loader: Any, generation_state: Any,
                 manager: PausableContinuousBatchingManager) -> None:  # fmt: skip
        super().__init__(model_id, loader, generation_state)  # reads the config and processor; starts nothing
        self._serve(manager)

    def _check_alive(self, request_id: str) -> None:
        status = self._cb.background_thread_status
        if status.fatal_error is not None or not self._cb.is_running():
            raise self._dead(f"the generation loop is not running ({status.fatal_error or 'stopped'}); request "
                             f"{request_id} refused")  # fmt: skip

    @property
    def process_running(self) -> bool:
        """Whether the loop runs (there is no process: the model runs here)."""
        return self._cb.is_running()

    def start(self, on_progress: Any = None) -> None:
        """The manager was built and started with the server: nothing to start."""

    async def load(self, on_progress: Any = None) -> None:
        """The model was loaded with the server: nothing to load."""

    async def generate_non_streaming(self, inputs: dict, generation_kwargs: dict) -> tuple[str, int, list[int]]:
        """The answer to ``inputs``: its text, the prompt's length and the generated tokens, as upstream's; a refusal
        while paused is a 503, and a cancelled handler (the client left) cancels the request."""
        request_id = _request_id()
        self._check_alive(request_id)
        self._refuse_duplicate(request_id)
        prompt = list(inputs["input_ids"])
        future = asyncio.get_running_loop().create_future()
        self._enqueue(request_id, prompt, generation_kwargs["max_new_tokens"], generation_kwargs["eos_token_id"],
                      False, lambda result: future.done() or future.set_result(result))  # fmt: skip
        try:
            result = await future
        except asyncio.CancelledError:  # the client left (CancelOnDisconnect), or the server stops
            if _pending(future):  # not one already answered: its id may be a new request's by now
                self._cb.cancel_request(request_id)
                self.count("cancelled")
            raise
        self._settle(request_id, result)
        tokens = list(result.generated_tokens)
        return self.processor.decode(tokens, skip_special_tokens=True), len(prompt), tokens

    def generate_streaming(self, inputs: dict, generation_kwargs: dict,
                           response_parser: Any = None) -> tuple[asyncio.Queue, Any]:  # fmt: skip
        """The stream of ``inputs``'s answer: upstream's ``Detokenizer`` and its queue, fed from the loop's outputs on
        the event loop; the queue ends with ``None``, or a ``_StreamError`` for a request that failed or was
        aborted.  The streamer's ``task`` waits for the end: the handler cancels it when the stream ends, and a
        cancellation before the request's end (the client left) cancels the request."""
        request_id = _request_id()
        self._check_alive(request_id)
        self._refuse_duplicate(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        tokenizer = getattr(self.processor, "tokenizer", self.processor)._tokenizer
        streamer = Detokenizer(tokenizer, queue, response_parser=response_parser)
        ended = asyncio.get_running_loop().create_future()
        sent = 0
        watch = RestartWatch(self._cb, request_id)

        def on_output(result: Any) -> None:
            nonlocal sent
            if ended.done():
                return
            if watch.restarted(sent):  # tokens sent cannot be taken back: the stream ends (ServedRequests)
                ended.set_result(_Restarted(sent))
                return
            try:
                if result.error is None:
                    for token in result.generated_tokens[sent:]:
                        streamer.put_token(token)
                    sent = len(result.generated_tokens)
            except Exception as error:  # the tokens could not be decoded: this request fails, the others go on
                ended.set_result(error)
                return
            if result.is_finished():
                ended.set_result(result)

        self._enqueue(request_id, list(inputs["input_ids"]), generation_kwargs["max_new_tokens"],
                      generation_kwargs["eos_token_id"], True, on_output)  # fmt: skip

        async def wait_for_the_end() -> None:
            try:
                end = await ended
            except asyncio.CancelledError:  # the client left, or the server stops
                end = None if _pending(ended) else ended.result()
                if end is None or isinstance(end, (Exception, _Restarted)):  # still running in the loop
                    self._cb.cancel_request(request_id)
                    self.count("cancelled")
                else:  # it finished (its id may be a new request's by now): counted, not cancelled
                    self._note_end(end)
                return
            if isinstance(end, _Restarted):
                queue.put_nowait(_StreamError(self._stream_restarted(request_id, end.sent)))
                return
            if isinstance(end, Exception):
                self._cb.cancel_request(request_id)
                self.count("failed")
                queue.put_nowait(_StreamError(f"{type(end).__name__}: {end}"))
                return
            self._note_end(end)
            if end.error is not None:
                queue.put_nowait(_StreamError(str(end.error)))
            else:
                streamer.end()

        streamer.task = asyncio.ensure_future(wait_for_the_end())
        return queue, streamer

    async def submit(self, function: Any, *args: Any) -> Any:
        """Refused: it would run ``function`` on the model outside the pausable loop (its routes are removed)."""
        raise RuntimeError("cbpause serve runs the model only in its pausable loop")

    def submit_streaming(self, function: Any, *args: Any) -> Any:
        """Refused, as :meth:`submit`."""
        raise RuntimeError("cbpause serve runs the model only in its pausable loop")

    def shutdown(self, reason: str = "the server stops") -> None:
        """The server stops (upstream's lifespan): the loop stops, its requests in flight answered."""
        self._cb.stop(block=True, timeout=10)


class PausableModelManager(ModelManager):
    """transformers 5.25's model manager with one model, :class:`PausableEngine`'s, loaded at start-up: a request
    naming another gets upstream's ``ModelNotServedError`` (a 400)."""

    def __init__(self, engine: PausableEngine) -> None:
        super().__init__(loader=engine.loader, generation_state=engine.generation_state)  # no model: none preloaded
        self._engine = engine

    def get_engine(self, model: str | None) -> Any:
        if model is not None and canonical_model_id(model) != self._engine.model_id:
            raise ModelNotServedError(f"this server serves {self._engine.model_id!r}, not {model!r}")
        return self._engine

    def shutdown(self) -> None:
        self._engine.shutdown()

    @property
    def is_dead(self) -> bool:
        return self._engine._cb.background_thread_status.fatal_error is not None


def build(checkpoint: str, *, device: str, dtype: str, continuous_batching_config: Any,
          tensor_parallel: Any = None, **manager_kwargs: Any) -> Built:  # fmt: skip
    """The model loaded by transformers serve's loader, a started cbpause manager on it, and the handlers on a
    :class:`PausableEngine` (the wiring of upstream's ``Serve.__init__``, restated, with no worker process)."""
    loader = ModelLoader(device=device, dtype=dtype, continuous_batching=True)
    model_id = canonical_model_id(checkpoint)
    if tensor_parallel is not None:  # one rank of a TP engine: the model sharded (serving.load_sharded)
        load_sharded(loader, checkpoint, tensor_parallel)
    model, processor = loader.load_model_and_processor(model_id)
    manager = init_continuous_batching(model, model.generation_config, continuous_batching_config, **manager_kwargs)
    manager.start()
    try:
        state = GenerationState(continuous_batching=True, cb_config=manager.continuous_batching_config)
        engine = PausableEngine(model_id, loader, state, manager)
        models = PausableModelManager(engine)
        handlers = {
            "chat_handler": ChatCompletionHandler(model_manager=models, generation_state=state),
            "completion_handler": CompletionHandler(model_manager=models, generation_state=state),
            "response_handler": ResponseHandler(model_manager=models, generation_state=state),
            "transcription_handler": TranscriptionHandler(models),
            "systemone_handler": SystemOneHandler(model_manager=models, generation_state=state),
        }
    except BaseException:
        manager.stop(block=True, timeout=10)
        raise
    return Built(model=model, processor=processor, manager=manager, generate=engine, model_manager=models,
                 handlers=handlers)  # fmt: skip
