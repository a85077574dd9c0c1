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
import math
import time
import uuid
import weakref
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..integrations.sampling import MAX_TOP_LOGPROBS, SamplingParams
from .guard import BadJSON, parse_json_object

__all__ = ["Generation", "MAX_ANSWER_VALUES", "MAX_CHOICES", "OpenAIError", "Served", "add_openai_routes",
           "check_answer_size", "parse_chat", "parse_completion", "prompt_limits"]  # fmt: skip

# What one request may make the server hold (a stranger's request included): choices (prompts times n), stop strings
# and their length, stop token ids, and the length of a request id.
MAX_CHOICES = 64
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID = 256
# The most values an answer may carry: its choices' tokens, each with its top log-probabilities (64 choices of 4096
# tokens with 20 top log-probabilities each would be 5 million, some 100 MB of JSON).
MAX_ANSWER_VALUES = 2**21

# The arguments each route takes, by the value each must have when it is only accepted if neutral.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
COMMON_KEYS = {"model", "n", "stop", "stop_token_ids", "stream", "stream_options", "return_token_ids", "user",
               "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", *SAMPLING_KEYS}  # fmt: skip
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
                           "add_generation_prompt", "tools", "tool_choice", "response_format", "parallel_tool_calls"}
# Accepted only absent, null or with the value that asks for nothing (an argument this server cannot honour).
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "echo": (False,),
           "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
           "parallel_tool_calls": (True, False)}  # fmt: skip


class OpenAIError(ValueError):
    """A request this server refuses: ``status`` (400 by default) and a message naming what is refused."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Served:
    """What the routes need to know of the server: the model's names, its vocabulary, how long a request may be, the
    default length of an answer, the default sampling (the checkpoint's generation config), its end-of-sequence ids,
    and whether it has a chat template."""

    name: str
    checkpoint: str
    vocab_size: int
    max_model_len: int
    default_max_tokens: int | None
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    chat: bool

    def model_card(self) -> dict:
        """The model as ``GET /v1/models`` lists it (vLLM's card: ``max_model_len`` and ``root`` too)."""
        return {"id": self.name, "object": "model", "created": 0, "owned_by": "cbpause", "root": self.checkpoint,
                "parent": None, "max_model_len": self.max_model_len}  # fmt: skip


@dataclass(frozen=True)
class Generation:
    """A parsed generation request: its prompts (token ids, or text to tokenize, or chat messages), ``n`` choices per
    prompt, ``max_tokens`` (None: the default), the sampling of its first choice (choice ``i`` of a prompt with a seed
    ``s`` samples with ``s + i``), its stops, ``logprobs`` (None: none; ``k``: the sampled token's and the ``k`` most
    likely), and how to answer."""

    chat: bool
    prompts: tuple[Any, ...]
    n: int
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    suffix: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True

    def choice_sampling(self, i: int) -> SamplingParams:
        """The sampling of choice ``i`` of a prompt."""
        seed = self.sampling.seed
        return self.sampling if seed is None or i == 0 else replace(self.sampling, seed=_wrap_seed(seed + i))


def _wrap_seed(seed: int) -> int:
    return seed if seed < 2**64 else seed - 2**64


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _positive_int(errors: list[str], name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        errors.append(f"{name}={value!r} (a positive integer)")
        return None
    return value


def _common(body: dict, served: Served, keys: set[str], errors: list[str]) -> dict:
    """The checks both routes share; the values they give (a failed check adds to ``errors`` and gives a default)."""
    unknown = sorted(set(body) - keys)
    if unknown:
        errors.append(f"unknown argument(s) {unknown}")
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if key in keys and value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            errors.append(f"{key}={value!r} (not served: only {' or '.join(json.dumps(v) for v in neutral)})")
    model = body.get("model")
    if model is not None and model not in (served.name, served.checkpoint):
        errors.append(f"model={model!r} (this server serves {served.name!r})")
    n = _positive_int(errors, "n", body.get("n")) or 1
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        errors.append(f"stop={stop!r} (a string or a list of strings)")
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        errors.append(f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
        stops = ()
    stop_ids = body.get("stop_token_ids")
    ids: tuple[int, ...] = ()
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_token(t, served.vocab_size) for t in stop_ids):
            errors.append(f"stop_token_ids={stop_ids!r} (a list of token ids in [0, {served.vocab_size}))")
        elif len(stop_ids) > MAX_STOP_TOKEN_IDS:
            errors.append(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
        else:
            ids = tuple(stop_ids)
    flags = {}
    for key in ("stream", "return_token_ids"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            errors.append(f"{key}={value!r} (true or false)")
        flags[key] = bool(value)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} or not all(
                isinstance(v, bool) for v in options.values()):  # fmt: skip
            errors.append(f"stream_options={options!r} (an object with include_usage: true or false)")
        elif options.get("continuous_usage_stats"):
            errors.append("stream_options.continuous_usage_stats (not served)")
        else:
            include_usage = bool(options.get("include_usage"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        errors.append(f"user={user!r} (a string)")
    given = {k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None}
    sampling = served.sampling
    try:
        sampling = replace(served.sampling, **given)
    except (TypeError, ValueError) as error:
        errors.append(str(error))
    return {"n": n, "stop": stops, "stop_token_ids": ids, "stream": flags["stream"], "include_usage": include_usage,
            "return_token_ids": flags["return_token_ids"], "sampling": sampling}  # fmt: skip


def _token(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _logprobs_count(errors: list[str], name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        errors.append(f"{name}={value!r} (an integer in 0..{MAX_TOP_LOGPROBS})")
        return None
    return value


def _finish(errors: list[str], values: dict) -> None:
    if errors:
        raise OpenAIError(f"this server cannot honour: {'; '.join(errors)}")
    if values["n"] * values["prompts"] > MAX_CHOICES:
        raise OpenAIError(f"n={values['n']} for {values['prompts']} prompt(s) asks for more than {MAX_CHOICES} "
                          "choices in one request")  # fmt: skip


def parse_completion(body: dict, served: Served) -> Generation:
    """A ``/v1/completions`` body (OpenAI's legacy completions, with vLLM's extensions), checked: ``OpenAIError``
    naming every argument refused.  ``prompt`` is a string, a list of strings, a list of token ids or a list of such
    lists."""
    errors: list[str] = []
    values = _common(body, served, COMPLETION_KEYS, errors)
    prompt = body.get("prompt")
    prompts: tuple[Any, ...] = ()
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(_token(t, served.vocab_size) for t in prompt):
        prompts = (tuple(prompt),)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and p and all(
            _token(t, served.vocab_size) for t in p) for p in prompt):  # fmt: skip
        prompts = tuple(tuple(p) for p in prompt)
    else:
        errors.append(f"prompt of type {_kind(prompt)} (a string, a list of strings, a non-empty list of token ids in "
                      f"[0, {served.vocab_size}), or a list of such lists)")  # fmt: skip
    if any(isinstance(p, str) and not p for p in prompts):
        errors.append("prompt: an empty string")
    max_tokens = _positive_int(errors, "max_tokens", body.get("max_tokens"))
    logprobs = _logprobs_count(errors, "logprobs", body.get("logprobs"))
    best_of = body.get("best_of")
    if best_of is not None and best_of != values["n"]:
        errors.append(f"best_of={best_of!r} (not served: only absent or equal to n)")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        errors.append(f"suffix={suffix!r} (a string)")
    _finish(errors, {**values, "prompts": len(prompts)})
    sampling = replace(values.pop("sampling"), logprobs=logprobs or 0)
    return Generation(chat=False, prompts=prompts, max_tokens=max_tokens, sampling=sampling, logprobs=logprobs,
                      suffix=suffix, **values)  # fmt: skip


def parse_chat(body: dict, served: Served) -> Generation:
    """A ``/v1/chat/completions`` body, checked: ``OpenAIError`` naming every argument refused (``messages`` a
    non-empty list of ``{role, content}`` with text content; tools are not served)."""
    errors: list[str] = []
    if not served.chat:
        raise OpenAIError("this checkpoint has no chat template: use /v1/completions with a prompt")
    values = _common(body, served, CHAT_KEYS, errors)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        errors.append(f"messages of type {_kind(messages)} (a non-empty list of messages)")
    else:
        for i, message in enumerate(messages):
            problem = _message_problem(message)
            if problem:
                errors.append(f"messages[{i}]: {problem}")
    max_tokens = _positive_int(errors, "max_tokens", body.get("max_tokens"))
    completion_tokens = _positive_int(errors, "max_completion_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and completion_tokens is not None and max_tokens != completion_tokens:
        errors.append("max_tokens and max_completion_tokens differ")
    wants = body.get("logprobs")
    if wants is not None and not isinstance(wants, bool):
        errors.append(f"logprobs={wants!r} (true or false)")
    top = _logprobs_count(errors, "top_logprobs", body.get("top_logprobs"))
    if top and not wants:
        errors.append("top_logprobs needs logprobs: true")
    template = body.get("chat_template_kwargs")
    if template is not None and not isinstance(template, dict):
        errors.append(f"chat_template_kwargs={template!r} (an object)")
    generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(generation_prompt, bool):
        errors.append(f"add_generation_prompt={generation_prompt!r} (true or false)")
    _finish(errors, {**values, "prompts": 1})
    logprobs = (top or 0) if wants else None
    sampling = replace(values.pop("sampling"), logprobs=logprobs or 0)
    return Generation(chat=True, prompts=(tuple(messages),), max_tokens=completion_tokens or max_tokens,
                      sampling=sampling, logprobs=logprobs, template_kwargs=dict(template or {}),
                      add_generation_prompt=generation_prompt, **values)  # fmt: skip


def _message_problem(message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"a {_kind(message)} (an object with role and content)"
    if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        return f"role {message.get('role')!r}"
    content = message.get("content")
    if isinstance(content, str) or (content is None and message.get("role") == "assistant"):
        return None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):  # fmt: skip
        return None
    return "content must be a string or a list of text parts (no other modality is served)"


def prompt_limits(generation: Generation, prompt: list[int], served: Served) -> int:
    """The token budget of a choice of ``prompt``: the request's ``max_tokens``, else the server's default, clipped to
    what ``max_model_len`` leaves (a default never makes a request too long); ``OpenAIError`` for a prompt that
    leaves no room, or a ``max_tokens`` that does not fit."""
    room = served.max_model_len - len(prompt)
    if room < 1:
        raise OpenAIError(f"the prompt has {len(prompt)} tokens, and this server's max_model_len is "
                          f"{served.max_model_len}: no room for an answer")  # fmt: skip
    if generation.max_tokens is None:
        default = served.default_max_tokens
        return room if default is None else min(default, room)
    if generation.max_tokens > room:
        raise OpenAIError(f"this server's max_model_len is {served.max_model_len} tokens, but {len(prompt)} prompt "
                          f"tokens and max_tokens={generation.max_tokens} make {len(prompt) + generation.max_tokens}")
    return generation.max_tokens


def check_answer_size(generation: Generation, budgets: list[int]) -> None:
    """``OpenAIError`` for a request whose answer could carry more than :data:`MAX_ANSWER_VALUES` values (every
    choice's tokens, each with its top log-probabilities): what one request may make the server hold."""
    values = generation.n * sum(budgets) * (1 + (generation.logprobs or 0))
    if values > MAX_ANSWER_VALUES:
        raise OpenAIError(f"n={generation.n}, {len(budgets)} prompt(s), up to {max(budgets)} tokens each with "
                          f"logprobs={generation.logprobs or 0}: an answer of up to {values} values, more than "
                          f"{MAX_ANSWER_VALUES} (lower max_tokens, n or logprobs)")  # fmt: skip


# ------------------------------------------------------------------------------------------------- decoding


class Detokenizer:
    """Text of a growing list of tokens, a piece per token (the text it adds, once it is whole: a token that ends in
    the middle of a character's bytes adds nothing until the next completes it).  Each piece is decoded with the
    few tokens before it, so that a tokenizer's spacing rules see their context."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # the first token of the context decoded with the new ones
        self._read = 0  # the tokens whose text has been given out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """What the last tokens left unfinished (an incomplete character, as the tokenizer shows it)."""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :] if len(now) > len(before) else ""


@dataclass
class ChoiceState:
    """One choice: its loop request, and what of it has been decoded (``text`` given out, ``held`` back while it may
    be the start of a stop string), its tokens and log-probabilities up to where it ended."""

    index: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    detokenizer: Detokenizer
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # the text offset of each token
    text: str = ""
    held: str = ""
    finish_reason: str | None = None
    weight_versions: list = field(default_factory=list)
    kv_versions: list = field(default_factory=list)
    error: Any = None  # an HTTP error, set when the choice failed
    restarts: int = 0  # the staleness bound's restarts seen
    sent_tokens: int = 0  # tokens already streamed to the client
    done: bool = False


def _cut(spans: list, n: int) -> list:
    """Version spans ``[[first_index, version], ...]`` of the first ``n`` tokens."""
    return [list(s) for s in spans if s[0] < n] if n else []


class Decoding:
    """What the outputs of a choice's loop request become: text pieces with their tokens, a stop string found, the
    end.  ``feed`` runs on the event loop for each output the loop delivers, in order."""

    def __init__(self, generation: Generation, served: Served, stop_ids: set[int]) -> None:
        self.generation, self.served, self.stop_ids = generation, served, stop_ids
        self.longest_stop = max((len(s) for s in generation.stop), default=0)

    def feed(self, choice: ChoiceState, result: Any) -> list[tuple[str, list[int], list[float], list[int]]]:
        """The pieces ``result`` adds to ``choice``: ``(text, tokens, logprobs, offsets)`` each; sets
        ``finish_reason`` when the choice ends (a stop string, a stop token, the end of the request)."""
        pieces = []
        tokens, logprobs = list(result.generated_tokens), list(getattr(result, "logprobs", None) or [])
        for k in range(len(choice.tokens), len(tokens)):
            token = tokens[k]
            piece = choice.detokenizer.push(token)
            offset = len(choice.text) + len(choice.held)
            choice.tokens.append(token)
            choice.logprobs.append(logprobs[k] if k < len(logprobs) else math.nan)
            choice.offsets.append(offset)
            if token in self.stop_ids and token not in self.served.eos_token_ids:
                piece = ""  # a stop token's text is not the answer's (its id is in the tokens)
            text = self._take(choice, piece)
            pieces.append((text, [token], [choice.logprobs[-1]], [offset]))
            if choice.finish_reason is not None:
                break
            if token in self.stop_ids:
                choice.finish_reason = "stop"
                break
        if choice.finish_reason is None and result.is_finished() and result.error is None:
            choice.finish_reason = "length" if len(choice.tokens) >= choice.max_tokens else "stop"
        if choice.finish_reason is not None:
            tail = choice.held + (choice.detokenizer.flush() if choice.finish_reason != "stop" or
                                  not self.generation.stop else "")  # fmt: skip
            if tail and not self._stopped_in(choice, tail):
                choice.text += tail
                pieces.append((tail, [], [], []))
            choice.held = ""
            n = len(choice.tokens)
            choice.weight_versions = _cut(getattr(result, "weight_versions", []), n)
            choice.kv_versions = _cut(getattr(result, "kv_versions", []), n)
        return [p for p in pieces if p[0] or p[1]]

    def _take(self, choice: ChoiceState, piece: str) -> str:
        """``piece`` added to the text given out, less what may start a stop string (held back); a stop string found
        ends the choice (its text, and what follows, is not given out)."""
        if not self.generation.stop:
            choice.text += piece
            return piece
        pending = choice.held + piece
        found = [pending.find(s) for s in self.generation.stop]
        hits = [i for i in found if i >= 0]
        if hits:
            out = pending[: min(hits)]
            choice.text += out
            choice.held = ""
            choice.finish_reason = "stop"
            return out
        keep = 0
        for size in range(min(self.longest_stop - 1, len(pending)), 0, -1):
            if any(s.startswith(pending[-size:]) for s in self.generation.stop):
                keep = size
                break
        out = pending[: len(pending) - keep]
        choice.text += out
        choice.held = pending[len(pending) - keep :]
        return out

    def _stopped_in(self, choice: ChoiceState, tail: str) -> bool:
        if not self.generation.stop:
            return False
        hits = [tail.find(s) for s in self.generation.stop if tail.find(s) >= 0]
        if hits:
            choice.text += tail[: min(hits)]
            choice.finish_reason = "stop"
            return True
        return False


# ----------------------------------------------------------------------------------------------- log-probs


_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per tokenizer: each token's text, once decoded


def _piece(tokenizer: Any, token: int) -> str:
    """A token's own text (special tokens as they are written), as log-probabilities name it; decoded once per
    tokenizer (a vocabulary's worth at most)."""
    texts = _TEXTS.setdefault(tokenizer, {})
    text = texts.get(token)
    if text is None:
        text = texts[token] = tokenizer.decode([token], skip_special_tokens=False)
    return text


def completion_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float], offsets: list[int],
                        k: int) -> dict:  # fmt: skip
    """OpenAI's legacy ``logprobs`` object of ``tokens``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (``k`` >= 1:
    a ``{token: logprob}`` of the ``k`` most likely, else null) and ``text_offset``."""
    tops = None
    if k:
        tops = []
        for lp in logprobs:
            entry: dict[str, float] = {}
            for token, value in getattr(lp, "top", ())[:k]:
                entry.setdefault(_piece(tokenizer, token), _json_float(value))
            tops.append(entry)
    return {"tokens": [_piece(tokenizer, t) for t in tokens], "token_logprobs": [_json_float(x) for x in logprobs],
            "top_logprobs": tops, "text_offset": list(offsets)}  # fmt: skip


def chat_logprobs(tokenizer: Any, tokens: list[int], logprobs: list[float], k: int) -> list[dict]:
    """The ``content`` of a chat choice's ``logprobs``: ``{token, logprob, bytes, top_logprobs}`` per token."""

    def entry(token: int, value: float) -> dict:
        text = _piece(tokenizer, token)
        return {"token": text, "logprob": _json_float(value), "bytes": list(text.encode())}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in getattr(lp, "top", ())[:k]]}
            for t, lp in zip(tokens, logprobs, strict=True)]  # fmt: skip


def _json_float(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) else -9999.0


# -------------------------------------------------------------------------------------------------- routes


def add_openai_routes(app: Any, manager: Any, generate: Any, tokenizer: Any, served: Served, *,
                      follower: Any = None, metrics: Any = None) -> None:  # fmt: skip
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` on ``app``: requests run on ``manager``
    through ``generate`` (the server's :class:`~cbpause.integrations.serving.ServedRequests`), text through
    ``tokenizer``.  ``follower``: this server is a TP rank other than the driver (generation requests are a
    ``409``)."""
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
        if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
            raise HTTPException(status_code=400, detail=f"x-request-id: at most {MAX_REQUEST_ID} printable characters")
        try:
            generation = parse_chat(body, served) if chat else parse_completion(body, served)
            prompts = await asyncio.get_running_loop().run_in_executor(None, _tokenize, tokenizer, generation)
            budgets = [prompt_limits(generation, p, served) for p in prompts]
            check_answer_size(generation, budgets)
        except OpenAIError as error:
            raise HTTPException(status_code=error.status, detail=str(error)) from None
        run = Run(manager, generate, tokenizer, served, generation, request_id, prompts, budgets, metrics)
        run.start()
        if generation.stream:
            return _Stream(run)
        answer = await run.answer(request)
        return JSONResponse(answer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)


def _tokenize(tokenizer: Any, generation: Generation) -> list[list[int]]:
    """Each prompt's token ids (a chat's through the template), in a worker thread."""
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
            ChoiceState(index=j * n + i, request_id=f"{request_id}-{j * n + i}" if many else request_id,
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
        if choice.finish_reason is not None and result.error is None or result.error is None:
            self.generate.count("finished")
            if self.metrics is not None:
                self.metrics.generation_tokens += len(choice.tokens)
            return
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
                return []
            choice.tokens, choice.logprobs, choice.offsets, choice.text, choice.held = [], [], [], "", ""
            choice.detokenizer = Detokenizer(self.tokenizer)
        if result.error is not None:
            self._settle(choice, result)
            return []
        pieces = self.decoding.feed(choice, result)
        if choice.finish_reason is not None:
            if not result.is_finished():  # a stop string: the loop request is cancelled, its output ignored
                self.manager.cancel_request(choice.request_id)
            self._settle(choice, result)
        return pieces

    async def _next(self) -> tuple[ChoiceState, Any]:
        return await self.events.get()

    # ------------------------------------------------------------------------------------------- non-streamed

    async def answer(self, request: Any) -> dict:
        """The JSON answer once every choice ended; the client leaving first cancels them (``CancelledError``)."""
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
        except BaseException:
            self.cancel_all()
            raise
        finally:
            left.cancel()
        failed = [c for c in self.choices if c.error is not None]
        if failed:
            self.cancel_all()
            raise failed[0].error
        return self._body()

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
                for c in self.choices:
                    yield self._event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None})  # fmt: skip
            while not all(c.done for c in self.choices):
                choice, result = await self._next()
                for text, tokens, logprobs, offsets in self.process(choice, result):
                    choice.sent_tokens += len(tokens)
                    yield self._event(self._delta(choice, text, tokens, logprobs, offsets))
                if choice.error is not None:
                    self.cancel_all()
                    yield _error_event(choice.error)
                    return
                if choice.done:
                    yield self._event(self._finish_chunk(choice))
            if g.include_usage:
                yield self._event(None, usage=self._usage())
            yield "data: [DONE]\n\n"
        finally:
            self.cancel_all()

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

    def _event(self, choice: dict | None, usage: dict | None = None) -> str:
        g = self.generation
        chunk = {"id": self.request_id, "object": "chat.completion.chunk" if g.chat else "text_completion",
                 "created": self.created, "model": self.served.name, "choices": [] if choice is None else [choice]}
        if usage is not None:
            chunk["usage"] = usage
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
    """A streamed choice the staleness bound restarted after its tokens were sent."""


def _error_event(error: BaseException) -> str:
    detail = getattr(error, "detail", None) or str(error)
    status = getattr(error, "status_code", 500)
    return f"data: {json.dumps({'error': {'message': str(detail), 'type': 'server_error', 'code': status}})}\n\n"


def _jsonable(spans: list) -> list:
    """``(first_token_index, version)`` spans as JSON pairs (a version JSON cannot hold, ``PartialSync``, as text)."""
    return [[i, v if v is None or isinstance(v, (int, float, str, bool)) else str(v)] for i, v in spans]


async def _disconnected(request: Any) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
