"""The OpenAI routes of ``cbpause serve`` that RL rollout clients call: ``/v1/completions``, ``/v1/chat/completions``
and ``/v1/models`` (spec R-SERVE-OPENAI, docs/serving.md "OpenAI requests").

Decision: these routes are cbpause's, not transformers serve's.  transformers' handlers take one prompt as text, give
one choice, and no log-probabilities, and its loop samples every request alike; TRL's rollout worker (and SkyRL's,
prime-rl's, AReaL's) sends a token-id prompt with its own sampling, a seed, ``logprobs`` and ``return_token_ids`` on
every request.  Here a request is parsed into one :class:`Generation` (:func:`parse_completion`,
:func:`parse_chat`: pure functions, every argument checked, a ``400`` naming each one refused, nothing silently
ignored), each of its choices is one request of the manager's loop, sampled with its own
:class:`~cbpause.integrations.sampling.SamplingParams` (R-SAMPLING), and the answer follows OpenAI's shapes with
vLLM's extensions (``return_token_ids``: ``prompt_token_ids`` and ``token_ids`` in each choice; ``stop_token_ids``;
``top_k``, ``min_p``, ``repetition_penalty``) and cbpause's version labels (``weight_versions``, ``kv_versions`` in
each choice).  ``/v1/responses`` stays transformers serve's.

What a pause does to these requests is the manager's (R-MODES, R-ADMISSION, R-STALENESS): a request queued during a
pause waits (or is a ``503`` with ``Retry-After`` when the server rejects); one an ``abort`` pause or the staleness
bound ends is a ``503`` with ``Retry-After`` (streamed: an error event), its partial tokens not delivered; a stream
the staleness bound restarts after it sent tokens ends with an error event (tokens sent cannot be taken back).  A
stop string is found in the text as it is decoded; the request is then cancelled in the loop, and its answer is the
text before the stop string, with the tokens up to the one that completed it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..integrations.serving import GENERATION_ROUTES
from .decoding import ChoiceState, Decoding, Detokenizer, chat_logprobs, completion_logprobs, cut_spans
from .generation import (
    MAX_REQUEST_ID,
    Generation,
    OpenAIError,
    Served,
    check_answer_size,
    parse_chat,
    parse_completion,
    prompt_limits,
)
from .guard import BadJSON, parse_json_object

__all__ = ["CHOICE_MARK", "GENERATING", "Run", "TornRefusal", "add_openai_routes", "torn_refusal"]

# The loop's id of choice i of a request of several is "<x-request-id>#<i>"; a client's x-request-id may not hold the
# mark, so that its id never names another request's choice (nor a child transformers forks, "<parent>__child#<i>").
CHOICE_MARK = "#"
# The generation routes whose handler is transformers serve's (refused while torn by TornRefusal).
GENERATING = frozenset(GENERATION_ROUTES)


def torn_refusal(torn: Any) -> str | None:
    """Why a generation request is refused while the weights are torn (``torn``, the lease table's), or ``None``."""
    if torn is None:
        return None
    return (f"this server's weights are torn (an update stopped half-way: labelled {torn.version!r} partial); "
            "generation is refused until a complete update arrives")  # fmt: skip


class TornRefusal:
    """transformers serve's own generation routes (``/v1/responses``: :data:`GENERATING`) answer ``503`` with
    ``Retry-After`` while the weights are torn (``torn()``: R-TORN-HOLD), counted ``rejected`` by ``count()``,
    before the request reaches their handler (a request queued while the loop is held would wait for a mend).  This
    module's routes refuse in their handler, where a request's choices are known (each is counted)."""

    def __init__(self, app: Any, torn: Any, count: Any) -> None:
        self.app, self.torn, self.count = app, torn, count

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path") in GENERATING and (why := torn_refusal(self.torn())):
            self.count("rejected")
            response = JSONResponse({"error": {"message": why, "type": "server_error", "code": 503}},
                                    status_code=503, headers={"Retry-After": "1"})  # fmt: skip
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def add_openai_routes(app: Any, manager: Any, generate: Any, tokenizer: Any, served: Served, *,
                      follower: Any = None, metrics: Any = None, torn: Any = None) -> None:  # fmt: skip
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` on ``app``: requests run on ``manager``
    through ``generate`` (the server's :class:`~cbpause.integrations.serving.ServedRequests`), text through
    ``tokenizer``.  ``follower``: this server is a TP rank other than the driver (generation requests are a
    ``409``).  ``torn()``: the lease table's torn weights, or ``None``: while there are, a generation request is a
    ``503``, each of its choices counted ``rejected`` (R-TORN-HOLD)."""
    @app.api_route("/v1/models", methods=["GET", "HEAD", "OPTIONS"])  # OPTIONS: as transformers serve answered it
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [served.model_card()]})

    async def handle(request: Request, chat: bool) -> Any:
        if follower is not None:
            raise HTTPException(status_code=409, detail=f"this server is rank {follower.rank} of a tensor-parallel "
                                f"engine of {follower.size} ranks: generation requests go to rank 0, its driver")
        try:
            body = parse_json_object(await request.body()) or {}
        except BadJSON as error:
            raise HTTPException(status_code=400, detail=str(error)) from None
        # (5.25's app names every request: its RequestIdMiddleware, which also answers with the id)
        request_id = getattr(request.state, "request_id", None) or request.headers.get("x-request-id") \
            or uuid.uuid4().hex
        if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable() or CHOICE_MARK in request_id:
            raise HTTPException(status_code=400, detail=f"x-request-id: at most {MAX_REQUEST_ID} printable characters, "
                                f"without {CHOICE_MARK!r} (it names a request's choices)")  # fmt: skip
        try:
            generation = parse_chat(body, served) if chat else parse_completion(body, served)
            prompts = await asyncio.get_running_loop().run_in_executor(None, _tokenize, tokenizer, generation)
            budgets = [prompt_limits(generation, p, served) for p in prompts]
            check_answer_size(generation, budgets)
        except OpenAIError as error:
            raise HTTPException(status_code=error.status, detail=str(error)) from None
        run = Run(manager, generate, tokenizer, served, generation, request_id, prompts, budgets, metrics)
        if torn is not None and (why := torn_refusal(torn())):
            for _ in run.choices:
                generate.count("rejected")
            raise HTTPException(status_code=503, detail=why, headers={"Retry-After": "1"})
        run.start()
        if generation.stream:
            return _Stream(run)
        await run.answer(request)
        # Built and serialised in a worker thread: an answer of many choices with log-probabilities is megabytes of
        # JSON, which on the event loop held every route (a lease's renewal too) for seconds.
        content = await asyncio.get_running_loop().run_in_executor(None, run.serialised)
        return Response(content, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)


def _tokenize(tokenizer: Any, generation: Generation) -> list[list[int]]:
    """Each prompt's token ids (a chat's through the template), in a worker thread; ``OpenAIError`` for a prompt the
    tokenizer or the template refuses (a template that raises on these messages, or on a variable's value)."""
    try:
        return _token_ids(tokenizer, generation)
    except OpenAIError:
        raise
    except Exception as error:  # noqa: BLE001 -- the request's fault: its prompt, its template variables
        raise OpenAIError(f"the prompt could not be tokenized: {type(error).__name__}: {error}"[:1000]) from None


def _token_ids(tokenizer: Any, generation: Generation) -> list[list[int]]:
    if generation.chat:
        ids = tokenizer.apply_chat_template(
            [_plain(m) for m in generation.prompts[0]], add_generation_prompt=generation.add_generation_prompt,
            tokenize=True, **generation.template_kwargs,
        )  # fmt: skip
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding on some releases
            ids = ids["input_ids"]
        ids = list(ids)
        if not ids:
            raise OpenAIError("the chat template made an empty prompt")
        return [ids]
    out = []
    for prompt in generation.prompts:
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            if not ids:
                raise OpenAIError(f"the prompt {prompt[:40]!r} has no tokens")
            out.append(list(ids))
        else:
            out.append(list(prompt))
    return out


def _plain(message: dict) -> dict:
    """A chat message as a template reads it: text parts joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    return {**message, "content": content if content is not None else ""}


class Run:
    """One request's choices on the loop, and its answer (JSON, or a stream of events)."""

    def __init__(self, manager: Any, generate: Any, tokenizer: Any, served: Served, generation: Generation,
                 request_id: str, prompts: list[list[int]], budgets: list[int], metrics: Any) -> None:  # fmt: skip
        self.manager, self.generate, self.tokenizer, self.served = manager, generate, tokenizer, served
        self.generation, self.request_id, self.prompts, self.metrics = generation, request_id, prompts, metrics
        self.created = int(time.time())
        self.stop_ids = set(generation.stop_token_ids)
        eos = list(served.eos_token_ids) + [t for t in generation.stop_token_ids if t not in served.eos_token_ids]
        self.eos = eos if eos else -1
        self.decoding = Decoding(generation, served, self.stop_ids | set(served.eos_token_ids))
        n, many = generation.n, len(prompts) * generation.n > 1
        self.choices = [
            ChoiceState(index=j * n + i, request_id=f"{request_id}{CHOICE_MARK}{j * n + i}" if many else request_id,
                        prompt=prompt, max_tokens=budgets[j], sampling=generation.choice_sampling(i),
                        detokenizer=Detokenizer(tokenizer))
            for j, prompt in enumerate(prompts) for i in range(n)
        ]  # fmt: skip
        self.events: asyncio.Queue = asyncio.Queue()
        self.stream_in_loop = generation.stream or bool(generation.stop)

    # -------------------------------------------------------------------------------------------- submitting

    def start(self) -> None:
        """Every choice's loop request, or none: a refusal cancels those added before it, and is the answer.  Each
        choice is counted once by outcome whatever happens (``/metrics``): those never submitted as the refusal."""
        added: list[ChoiceState] = []
        try:
            if self.request_id in self.generate.client_ids:  # its choices run under other ids: the loop cannot tell
                self.generate.count("failed")
                raise HTTPException(status_code=409, detail=f"x-request-id {self.request_id!r} is in use by a request "
                                    "in flight: wait for its answer, or send another id")  # fmt: skip
            for choice in self.choices:
                self.generate._refuse_duplicate(choice.request_id)
            for choice in self.choices:
                self.generate._enqueue(choice.request_id, choice.prompt, choice.max_tokens, self.eos,
                                       self.stream_in_loop, self._on_output(choice), sampling=choice.sampling)
                added.append(choice)
        except BaseException as error:
            for choice in added:
                choice.done = True
                self._cancel(choice, "cancelled")
            counted = 1 if isinstance(error, HTTPException) else 0  # the refused choice, counted where it was refused
            retry = isinstance(error, HTTPException) and "Retry-After" in (error.headers or {})
            for _ in range(len(self.choices) - len(added) - counted):
                self.generate.count("rejected" if retry else "failed")
            raise
        self.generate.client_ids.add(self.request_id)
        if self.metrics is not None:
            self.metrics.prompt_tokens += sum(len(p) for p in self.prompts)

    def _on_output(self, choice: ChoiceState) -> Any:
        def on_output(result: Any) -> None:
            if not choice.done:
                self.events.put_nowait((choice, result))

        return on_output

    def _cancel(self, choice: ChoiceState, outcome: str | None) -> None:
        self.manager.cancel_request(choice.request_id)
        if outcome:
            self.generate.count(outcome)

    def cancel_all(self) -> None:
        """The client left, or the server stops: every choice still running is cancelled in the loop."""
        for choice in self.choices:
            if not choice.done:
                choice.done = True
                self._cancel(choice, "cancelled")

    def release(self) -> None:
        """The request's answer is out (or it ended): its x-request-id is free again (its choices' ids once the loop
        delivered their last output).  Idempotent."""
        self.generate.client_ids.discard(self.request_id)

    # --------------------------------------------------------------------------------------------- outputs

    def _restarted(self, choice: ChoiceState) -> bool:
        """Whether the staleness bound restarted ``choice`` since its last output (its tokens were discarded)."""
        now = self.manager.versions.restarts.get(choice.request_id, 0)
        if now <= choice.restarts:
            return False
        choice.restarts = now
        return True

    def _settle(self, choice: ChoiceState, result: Any) -> None:
        """A choice's terminal output, or a stop: counted; an error becomes the choice's HTTP error."""
        choice.done = True
        if result.error is None:  # its end, or a stop string or token that ended it before the loop did
            self.generate.count("finished")
            if self.metrics is not None:
                self.metrics.generation_tokens += len(choice.tokens)
            return
        # The labels of what was delivered before the end (a stream's tokens sent): its error event carries them.
        sent = choice.sent_tokens
        choice.weight_versions = cut_spans(getattr(result, "weight_versions", []) or [], sent)
        choice.kv_versions = cut_spans(getattr(result, "kv_versions", []) or [], sent)
        try:
            self.generate._settle(choice.request_id, result)
        except Exception as error:  # noqa: BLE001 -- the HTTP error the choice ends with
            choice.error = error

    def process(self, choice: ChoiceState, result: Any) -> list:
        """One output of a choice: its new pieces; a stop string or token that ends it cancels its loop request."""
        if choice.done:
            return []
        if self._restarted(choice):
            if choice.sent_tokens:  # tokens sent cannot be taken back: the stream ends (docs/serving.md)
                choice.done = True
                choice.error = _Restarted(self.generate._stream_restarted(choice.request_id, choice.sent_tokens))
                # the labels of the tokens sent: the last output before the restart had them (its spans are dropped)
                choice.weight_versions = cut_spans(choice.seen_labels[0], choice.sent_tokens)
                choice.kv_versions = cut_spans(choice.seen_labels[1], choice.sent_tokens)
                return []
            choice.tokens, choice.logprobs, choice.offsets, choice.text, choice.held = [], [], [], "", ""
            choice.detokenizer = Detokenizer(self.tokenizer)
        if result.error is not None:
            self._settle(choice, result)
            return []
        choice.seen_labels = (list(getattr(result, "weight_versions", []) or []),
                              list(getattr(result, "kv_versions", []) or []))  # fmt: skip
        pieces = self.decoding.feed(choice, result)
        if choice.finish_reason is not None:
            if not result.is_finished():  # a stop string: the loop request is cancelled, its output ignored
                self.manager.cancel_request(choice.request_id)
            self._settle(choice, result)
        return pieces

    async def _next(self) -> tuple[ChoiceState, Any]:
        return await self.events.get()

    # ------------------------------------------------------------------------------------------- non-streamed

    async def answer(self, request: Any) -> None:
        """Until every choice ended (then :meth:`serialised` is the answer); the client leaving first cancels them
        (``CancelledError``), and a choice that failed is the answer's HTTP error."""
        left = asyncio.ensure_future(_disconnected(request))
        try:
            while not all(c.done for c in self.choices):
                get = asyncio.ensure_future(self._next())
                done, _ = await asyncio.wait({get, left}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise asyncio.CancelledError(f"the client left; request {self.request_id} cancelled")
                choice, result = get.result()
                self.process(choice, result)
                if choice.error is not None:  # the answer is this error: the other choices need not run on
                    break
        except BaseException:
            self.cancel_all()
            self.release()
            raise
        finally:
            left.cancel()
        self.release()
        failed = [c for c in self.choices if c.error is not None]
        if failed:
            self.cancel_all()
            raise failed[0].error

    def serialised(self) -> bytes:
        """The JSON answer of a request whose every choice ended (:meth:`answer`), as bytes."""
        return json.dumps(self._body(), ensure_ascii=False).encode()

    def _body(self) -> dict:
        g = self.generation
        choices = []
        for c in self.choices:
            text = self._final_text(c)
            entry: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                     "weight_versions": _jsonable(c.weight_versions),
                                     "kv_versions": _jsonable(c.kv_versions)}  # fmt: skip
            if g.chat:
                entry["message"] = {"role": "assistant", "content": text}
                entry["logprobs"] = None if g.logprobs is None else {
                    "content": chat_logprobs(self.tokenizer, c.tokens, c.logprobs, g.logprobs)}
            else:
                entry["text"] = text + (g.suffix or "")
                entry["logprobs"] = None if g.logprobs is None else completion_logprobs(
                    self.tokenizer, c.tokens, c.logprobs, c.offsets, g.logprobs)
            if g.return_token_ids:
                entry["token_ids"] = list(c.tokens)
                if not g.chat:
                    entry["prompt_token_ids"] = list(c.prompt)
            choices.append(entry)
        body = {"id": self.request_id, "object": "chat.completion" if g.chat else "text_completion",
                "created": self.created, "model": self.served.name, "choices": choices, "usage": self._usage()}
        if g.chat and g.return_token_ids:
            body["prompt_token_ids"] = list(self.prompts[0])
        if len(choices) == 1:  # the labels of the only choice, where answers of one choice carried them before
            body["weight_versions"], body["kv_versions"] = choices[0]["weight_versions"], choices[0]["kv_versions"]
        return body

    def _final_text(self, c: ChoiceState) -> str:
        """The answer's text: all of its tokens decoded at once, unless a stop string or token cut it."""
        if self.generation.stop or (c.tokens and c.tokens[-1] in self.stop_ids):
            return c.text
        return self.tokenizer.decode(c.tokens, skip_special_tokens=True)

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # --------------------------------------------------------------------------------------------- streamed

    async def stream(self) -> Any:
        """The SSE events of the answer: a chunk per piece of each choice, its ``finish_reason`` chunk (with its
        labels), the usage (``stream_options.include_usage``), ``[DONE]``; an error event (OpenAI's shape) ends a
        stream whose choice failed.  A client that leaves cancels every choice."""
        g = self.generation
        try:
            if g.chat:
                prompt = {"prompt_token_ids": list(self.prompts[0])} if g.return_token_ids else {}
                for c in self.choices:
                    yield self._event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}, **prompt)  # fmt: skip
            while not all(c.done for c in self.choices):
                choice, result = await self._next()
                for text, tokens, logprobs, offsets in self.process(choice, result):
                    choice.sent_tokens += len(tokens)
                    yield self._event(self._delta(choice, text, tokens, logprobs, offsets))
                if choice.error is not None:
                    self.cancel_all()
                    yield _error_event(choice)
                    return
                if choice.done:
                    yield self._event(self._finish_chunk(choice))
            self.release()
            if g.include_usage:
                yield self._event(None, usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            self.cancel_all()
            self.release()

    def _delta(self, c: ChoiceState, text: str, tokens: list[int], logprobs: list[float], offsets: list[int]) -> dict:
        g = self.generation
        entry: dict[str, Any] = {"index": c.index, "finish_reason": None}
        if g.chat:
            entry["delta"] = {"content": text}
            entry["logprobs"] = None if g.logprobs is None else {
                "content": chat_logprobs(self.tokenizer, tokens, logprobs, g.logprobs)}
        else:
            entry["text"] = text
            entry["logprobs"] = None if g.logprobs is None else completion_logprobs(
                self.tokenizer, tokens, logprobs, offsets, g.logprobs)
        if g.return_token_ids:
            entry["token_ids"] = list(tokens)
        return entry

    def _finish_chunk(self, c: ChoiceState) -> dict:
        g = self.generation
        entry: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": None,
                                 "weight_versions": _jsonable(c.weight_versions),
                                 "kv_versions": _jsonable(c.kv_versions)}  # fmt: skip
        if g.chat:
            entry["delta"] = {}
        else:
            entry["text"] = g.suffix or ""
            if g.return_token_ids:
                entry["prompt_token_ids"] = list(c.prompt)
        return entry

    def _event(self, choice: dict | None, **top: Any) -> str:
        """An SSE event of one choice's chunk (or none: the usage's), with ``top``'s fields at the chunk's top."""
        g = self.generation
        chunk = {"id": self.request_id, "object": "chat.completion.chunk" if g.chat else "text_completion",
                 "created": self.created, "model": self.served.name, "choices": [] if choice is None else [choice],
                 **top}  # fmt: skip
        if choice is not None and len(self.choices) == 1 and "weight_versions" in choice:
            chunk["weight_versions"], chunk["kv_versions"] = choice["weight_versions"], choice["kv_versions"]
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


class _Stream(StreamingResponse):
    """A run's events as a response; however the response ends (the stream's end, the client gone, the server
    stopping, a send that failed), every choice still running is cancelled in the loop.  (The events' generator
    also does it as it closes; a response cancelled while it waits in a send may not close it until it is
    collected.)"""

    def __init__(self, run: Run) -> None:
        super().__init__(run.stream(), media_type="text/event-stream")
        self.run = run

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.cancel_all()


class _Restarted(Exception):
    """A streamed choice the staleness bound restarted after its tokens were sent: to retry, as a ``503``."""

    status_code = 503


def _error_event(choice: ChoiceState) -> str:
    """The event that ends a stream whose choice failed: OpenAI's error shape (its ``code`` the HTTP status the
    request would have had: 503 for an abort or the staleness bound, to retry), with the choice's index and the
    labels of the tokens it had sent (an ``abort`` ends a stream labelled)."""
    error = choice.error
    detail = getattr(error, "detail", None) or str(error)
    event = {"error": {"message": str(detail), "type": "server_error", "code": getattr(error, "status_code", 500)},
             "index": choice.index, "weight_versions": _jsonable(choice.weight_versions),
             "kv_versions": _jsonable(choice.kv_versions)}  # fmt: skip
    return f"data: {json.dumps(event)}\n\n"


def _jsonable(spans: list) -> list:
    """``(first_token_index, version)`` spans as JSON pairs (a version JSON cannot hold, ``PartialSync``, as text)."""
    return [[i, v if v is None or isinstance(v, (int, float, str, bool)) else str(v)] for i, v in spans]


async def _disconnected(request: Any) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
