"""What the outputs of a choice's loop request become (:mod:`.openai`): text decoded a token at a time, stop strings
found in it, a stop token or the end of the request, and the log-probabilities in OpenAI's two shapes.

Decision (docs/serving.md): a stop string is found in the text as it is decoded; the text that may be the start of one
is held back from a stream until it is not; the answer is the text before the stop string, with the tokens up to the
one that completed it.  A stop token's own text is not the answer's (its id is in the tokens).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

from ..integrations.sampling import SamplingParams
from .generation import Generation, Served

__all__ = ["ChoiceState", "Decoding", "Detokenizer", "chat_logprobs", "completion_logprobs", "cut_spans"]


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
    seen_labels: tuple = ([], [])  # the weight and KV spans of its last output
    sent_tokens: int = 0  # tokens already streamed to the client
    done: bool = False


def cut_spans(spans: list, n: int) -> list:
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
            choice.weight_versions = cut_spans(getattr(result, "weight_versions", []), n)
            choice.kv_versions = cut_spans(getattr(result, "kv_versions", []), n)
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
