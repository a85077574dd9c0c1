"""A generation request of the OpenAI routes, parsed and checked (:mod:`.openai`; docs/serving.md, "OpenAI requests").

:func:`parse_completion` and :func:`parse_chat` are pure: a body and what the server serves (:class:`Served`) in, one
:class:`Generation` out, or an :class:`OpenAIError` naming every argument refused (decision: refused, never silently
ignored).  The limits of what one request may make the server hold are here, with the checks that need the prompts'
lengths (:func:`prompt_limits`, :func:`check_answer_size`).  Arguments and their shapes follow OpenAI's API, with
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``return_token_ids``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ..integrations.sampling import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["Generation", "MAX_ANSWER_VALUES", "MAX_CHOICES", "MAX_REQUEST_ID", "OpenAIError", "Served",
           "check_answer_size", "parse_chat", "parse_completion", "prompt_limits"]  # fmt: skip

MAX_CHOICES = 64
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID = 256
# The most values an answer may carry: its choices' tokens, each with its top log-probabilities (64 choices of 4096
# tokens, or 12,483 tokens with 20 top log-probabilities each; a chat answer of 2**21 values was 140 MB of JSON).
MAX_ANSWER_VALUES = 2**18

# The arguments each route takes, by the value each must have when it is only accepted if neutral.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
COMMON_KEYS = {"model", "n", "stop", "stop_token_ids", "stream", "stream_options", "return_token_ids", "user",
               "frequency_penalty", "presence_penalty", "logit_bias", "max_tokens", *SAMPLING_KEYS}  # fmt: skip
COMPLETION_KEYS = COMMON_KEYS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template_kwargs",
                           "add_generation_prompt", "tools", "tool_choice", "response_format", "parallel_tool_calls"}
# Accepted only absent, null or with the value that asks for nothing (an argument this server cannot honour).
NEUTRAL = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},), "echo": (False,),
           "tools": ([],), "tool_choice": ("none",), "response_format": ({"type": "text"},),
           "parallel_tool_calls": (True, False)}  # fmt: skip


# A chat request's chat_template_kwargs are its template's variables: apply_chat_template's own arguments are not
# (a stranger's chat_template ran its own Jinja with unbounded memory and CPU; tokenize, conversation... were 500s).
# The server adds the names of the installed release's signature to these (Served.template_arguments).
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})  # fmt: skip


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
    template_arguments: frozenset = TEMPLATE_ARGUMENTS  # the chat template's own arguments, which requests may not set

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
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int) or best_of != values["n"]):
        errors.append(f"best_of={best_of!r} (not served: only absent or the integer n)")
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
    elif template:
        reserved = sorted(set(template) & served.template_arguments)
        if reserved:
            errors.append(f"chat_template_kwargs {reserved} (the template's variables only: not the arguments of "
                          "apply_chat_template; add_generation_prompt is a field of the request)")  # fmt: skip
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
