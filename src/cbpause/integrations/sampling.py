"""Per-request sampling in transformers' continuous-batching loop (spec R-SAMPLING): each request sampled with its own
temperature, top-k, top-p, min-p, repetition penalty and seed, in one batch, with the log-probabilities an RL trainer
compares against.

transformers 5.23-5.25 sample a whole batch with one configuration (``ModelRunner._sample``: one ``do_sample`` flag,
``torch.multinomial`` on the global generator); its per-request processors cover temperature, top-k and top-p only,
and only when the generation config turned them on.  A manager built with ``per_request_sampling=True``
(:func:`cbpause.integrations.transformers.init_continuous_batching`) replaces both pieces with one :class:`Sampler`:

* the batch processor's logits-processor list (the object upstream hands its IO buffers and model runner): its
  ``prepare_tensor_args`` writes the batch's serial number into the batch's argument tensor, so that the sampling
  step of that batch, later (one step later with async batching), finds the requests of its rows;
* the model runner's ``_sample`` (replaced on the instance, :data:`~cbpause.integrations.upstream.REPLACED`), which
  writes each row's token and log-probability where upstream's writes them, so that everything downstream (the
  read-back, the outputs, a retract's copy) is upstream's.

Decisions (docs/serving.md says them to the server's users):

* **The log-probability** of a token is the model's log-softmax at the request's temperature (temperature 1 for a
  greedy request), taken *before* the repetition penalty and the top-k, top-p and min-p filters: what an RL trainer
  computes from the same weights (``log_softmax(logits / T)``), so its importance ratio is 1 when nothing changed.
  vLLM's equivalent setting is ``logprobs_mode``; its ``processed_logprobs`` is taken after every processor.
* **A seed names a stream of draws, one per token position**: token ``t`` of a request is drawn with a generator seeded
  from ``(seed, t)`` (the exponential race: the token is the argmax of ``p / E`` with ``E ~ Exp(1)`` per vocabulary
  entry).  So the same seed and prompt give the same tokens under the same weights whatever runs beside them (a
  row's draw reads only its own logits and its own generator), on every rank of a TP group alike, across a ``keep``
  or ``retract`` window (the position goes on: a retracted request draws its next token from the position it
  would have drawn it from without the window), and a request the staleness bound restarts from its prompt replays
  its seed's stream from position 0.  A request without a seed gets one drawn at ``add_request`` (on the driver, so
  that every rank of a TP group samples it alike).
* **Top log-probabilities** (``SamplingParams.logprobs = k``): the ``k`` most likely tokens of the same distribution,
  carried with the token's log-probability (:class:`TopLogprob`, a ``float`` with ``.top``), through upstream's own
  read-back; :func:`top_logprobs` reads them off an output.
* Python runs for every row of every step (a generator per sampled row): CUDA graphs and ``torch.compile`` of the
  forward step cannot capture it, so such a manager refuses them.
"""

from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass, replace
from typing import Any

import torch

from .weights import FORK_MARK, generated_count

__all__ = ["GREEDY_BELOW", "MAX_TOP_LOGPROBS", "PENALTY_RANGE", "SamplingParams", "Sampler", "TopLogprob",
           "check_no_graphs", "draw_seed", "top_logprobs"]  # fmt: skip

MAX_TOP_LOGPROBS = 20  # the most top log-probabilities a token carries (vLLM's default max_logprobs)
# A temperature below this is greedy (as vLLM's _SAMPLING_EPS): logits divided by it overflow float32 to inf, and the
# softmax of infinities is NaN.
GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what a seed may be: a signed or unsigned 64-bit integer
# What a repetition penalty may be: logits divided or multiplied by more overflow float32 (a penalty of 1e-40 made
# every logit of the history infinite, and the softmax of infinities NaN: token 0, silently).
PENALTY_RANGE = (1e-3, 1e3)
# The value a log-probability of exactly 0 probability takes in an answer (JSON has no -inf; vLLM's choice).
NEG_INF_LOGPROB = -9999.0
_SEEDS = random.Random()  # seeded from the OS: the seeds of requests that name none


def draw_seed() -> int:
    """A seed for a request that names none."""
    return _SEEDS.getrandbits(63)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, not {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (R-SAMPLING).  Every field is checked at construction: ``TypeError`` for a value of
    the wrong type, ``ValueError`` for one out of its range, each naming the argument.

    ``temperature`` >= 0 (below :data:`GREEDY_BELOW`, 0 included: greedy, the argmax); ``top_p`` in (0, 1];
    ``top_k`` >= 1, or 0 or -1 for no top-k; ``min_p`` in [0, 1] (0: none); ``repetition_penalty`` in
    :data:`PENALTY_RANGE` (1: none; transformers' rule: a logit of a token of the prompt or of the tokens generated so
    far is divided by it when positive, multiplied when negative); ``seed`` an integer of 64 bits, or None (one is
    drawn when the request is added); ``logprobs`` the number of top log-probabilities each token carries, 0 to
    :data:`MAX_TOP_LOGPROBS` (the sampled token's own log-probability is always there).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", _number("temperature", self.temperature))
        if self.temperature < 0:
            raise ValueError(f"temperature must be 0 (greedy) or more, not {self.temperature!r}")
        set_(self, "top_p", _number("top_p", self.top_p))
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p!r}")
        top_k = _integer("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (none) or a positive integer, not {top_k!r}")
        set_(self, "top_k", max(top_k, 0))
        set_(self, "min_p", _number("min_p", self.min_p))
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], not {self.min_p!r}")
        set_(self, "repetition_penalty", _number("repetition_penalty", self.repetition_penalty))
        if not PENALTY_RANGE[0] <= self.repetition_penalty <= PENALTY_RANGE[1]:
            raise ValueError(f"repetition_penalty must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], not "
                             f"{self.repetition_penalty!r}")  # fmt: skip
        if self.seed is not None:
            seed = _integer("seed", self.seed)
            if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
                raise ValueError(f"seed must be an integer of 64 bits, not {seed!r}")
        logprobs = _integer("logprobs", self.logprobs)
        if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, not {logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_generation_config(cls, config: Any) -> SamplingParams:
        """The sampling a generation config describes (``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, ``repetition_penalty``): the default of a request that names none."""
        if not getattr(config, "do_sample", False):
            fields: dict[str, Any] = {"temperature": 0.0}
        else:
            fields = {"temperature": float(getattr(config, "temperature", None) or 1.0),
                      "top_p": float(getattr(config, "top_p", None) or 1.0),
                      "top_k": int(getattr(config, "top_k", None) or 0),
                      "min_p": float(getattr(config, "min_p", None) or 0.0)}  # fmt: skip
        fields["repetition_penalty"] = float(getattr(config, "repetition_penalty", None) or 1.0)
        return cls(**fields)

    def seeded(self) -> SamplingParams:
        """These parameters with a seed (drawn now if they name none)."""
        return self if self.seed is not None else replace(self, seed=draw_seed())


class TopLogprob(float):
    """A token's log-probability (the ``float``) with its ``top``: the ``k`` most likely tokens of the same
    distribution, ``((token_id, logprob), ...)`` from the most likely."""

    __slots__ = ("top",)
    top: tuple[tuple[int, float], ...]

    def __new__(cls, value: float, top: tuple[tuple[int, float], ...]) -> TopLogprob:
        self = super().__new__(cls, value)
        self.top = top
        return self

    def __reduce__(self) -> tuple:  # pickled as itself (a TP broadcast, a process boundary)
        return (TopLogprob, (float(self), self.top))


def top_logprobs(output: Any) -> list[tuple[tuple[int, float], ...]]:
    """The top log-probabilities of each token of ``output`` (a generation output): ``()`` for a token sampled
    without any (``logprobs=0``)."""
    return [getattr(x, "top", ()) for x in (getattr(output, "logprobs", None) or [])]


def check_no_graphs(config: Any) -> None:
    """``ValueError`` for a batching config that captures or compiles the forward step (per-request sampling runs
    Python per row); an automatic choice of CUDA graphs (``None``) is turned off."""
    graphs = getattr(config, "use_cuda_graph", None)
    if graphs is None:
        config.use_cuda_graph = False
    elif graphs is True or (isinstance(graphs, tuple) and any(graphs)):
        raise ValueError("per-request sampling runs Python for each row of each step, which a CUDA graph cannot "
                         "capture: use use_cuda_graph=False")  # fmt: skip
    compiled = [n for n in ("varlen_compile_config", "decode_compile_config") if getattr(config, n, None) is not None]
    if compiled or getattr(config, "default_compile_level", 0):
        unset = compiled or ["default_compile_level"]
        raise ValueError(f"per-request sampling cannot run in a compiled forward step: leave {unset} unset")


_MASK = (1 << 64) - 1


def _stream_seed(seed: int, position: int) -> int:
    """The generator seed of draw ``position`` of the stream ``seed`` (splitmix64 of the pair): independent streams
    for neighbouring seeds and positions."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _position(state: Any) -> int:
    """The position of the next token ``state`` draws: one past the last draw (``_cbpause_draws``, which runs ahead of
    the read-back with async batching), else the tokens it holds (a new request, one the staleness bound restarted,
    a retracted copy: :func:`cbpause.integrations.modes.soft_reset` sets it to the tokens kept)."""
    drawn = getattr(state, "_cbpause_draws", None)
    return drawn if drawn is not None else generated_count(state)


def _history(state: Any) -> list[int]:
    """The tokens a repetition penalty reads: the prompt, the tokens generated so far, and those drawn but not yet
    read back (async batching runs a step ahead of the read-back)."""
    tokens = list(state.initial_tokens) + list(state.generated_tokens)
    drawn = getattr(state, "_cbpause_drawn", None)
    if drawn:
        held = generated_count(state)
        tokens.extend(token for position, (token, _) in drawn.items() if position >= held and token is not None)
    return tokens


def _child_index(request_id: str) -> int:
    """A child forked for ``num_return_sequences`` (upstream names it ``<parent>__child#<i>``) draws a stream of its
    own: ``i + 1`` is mixed into its parent's seed."""
    _, sep, index = request_id.rpartition(FORK_MARK)
    return int(index) + 1 if sep and index.isdigit() else 0


class Sampler:
    """The logits-processor list and sampling step of one manager's batch processors (the module's docstring).

    ``default``: how a request that names no :class:`SamplingParams` is sampled (the generation config's, with a seed
    drawn per request).  ``prepare_tensor_args``, ``__call__``, ``check_kwargs``, ``fill_defaults`` and ``clear`` are
    what upstream's batch processor calls on its logits-processor list; :meth:`sample` replaces its model runner's
    ``_sample``, and :meth:`read_back` wraps its IO's ``prepare_batch_update``."""

    do_processing = True
    tensors_required = 1  # the row of the batch's serial number
    supported_keys = {"sampling": SamplingParams}
    ignored_keys: set[str] = set()
    KEPT_BATCHES = 4  # batches whose rows are kept for their sampling step (async batching runs one step behind)

    def __init__(self, default: SamplingParams) -> None:
        self.default = default
        self._batches: collections.OrderedDict[int, list] = collections.OrderedDict()
        self._serial = 0
        self._rows: list | None = None  # the rows of the batch being sampled, from __call__ to sample()
        self._generators: dict[torch.device, torch.Generator] = {}

    def __repr__(self) -> str:
        return f"Sampler(default={self.default})"

    # --------------------------------------------------------------- upstream's logits-processor list, restated

    def clear(self) -> None:
        """Upstream empties its list on a reset; the sampler keeps nothing between batches but their rows."""
        self._batches.clear()

    def check_kwargs(self, kwargs: dict) -> None:
        """A request's ``logit_processor_kwargs``: ``{"sampling": SamplingParams}`` or nothing (``ValueError``)."""
        unknown = set(kwargs) - set(self.supported_keys)
        if unknown:
            raise ValueError(f"unknown sampling arguments {sorted(unknown)}: pass sampling=SamplingParams(...)")
        if "sampling" in kwargs and not isinstance(kwargs["sampling"], SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(kwargs['sampling']).__name__}")

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.zero_()

    def prepare_tensor_args(self, requests_in_batch: list, arg_storage: torch.Tensor) -> torch.Tensor:
        """Number the batch and keep its rows (the states of the requests that get a new token, in the order of the
        logits' rows); the serial goes into the batch's argument tensor, which travels with the batch."""
        self._serial = self._serial % (2**31 - 1) + 1
        self._batches[self._serial] = [r.state for r in requests_in_batch if r.has_new_token]
        while len(self._batches) > self.KEPT_BATCHES:
            self._batches.popitem(last=False)
        arg_storage[0, 0] = self._serial
        return arg_storage

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, args: torch.Tensor) -> torch.Tensor:
        """Upstream calls its list on the logits just before it samples: the rows of this batch are found by the
        serial its arguments carry (None for a warm-up's dummy batch: sampled greedily)."""
        self._rows = self._batches.pop(int(args[0, 0]), None)
        return scores

    # ------------------------------------------------------------------------------------------------ sampling

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        return gen

    def sample(self, scores: torch.Tensor, output_ids: torch.Tensor) -> None:
        """Each row's token and log-probability into ``output_ids`` (row 0 the tokens, row 1, when the batch
        processor returns log-probabilities, their float32 bits), as upstream's ``_sample``."""
        rows, self._rows = self._rows, None
        logits = scores[0]  # [N, V], float32
        n, vocab = logits.shape
        states = (rows or [])[:n]
        params = [self._params(state) for state in states]
        params += [SamplingParams(temperature=0.0)] * (n - len(params))  # a warm-up's rows: greedy
        penalized = self._penalize(logits, states, params)
        temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        logprobs = torch.log_softmax(logits / temperatures.unsqueeze(-1), dim=-1)  # before penalty and filters
        tokens = penalized.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            tokens[sampled] = self._draw(penalized[sampled], [params[i] for i in sampled],
                                         [states[i] for i in sampled], vocab)  # fmt: skip
        chosen = logprobs.gather(1, tokens.unsqueeze(-1)).squeeze(-1)
        output_ids[0, :n].copy_(tokens)
        if output_ids.size(0) > 1:
            output_ids[1, :n].copy_(chosen.view(dtype=torch.int32))
        self._note_draws(states, params, tokens, logprobs)

    def _params(self, state: Any) -> SamplingParams:
        params = state.logit_processor_kwargs.get("sampling")
        return params if isinstance(params, SamplingParams) else self.default

    def _penalize(self, logits: torch.Tensor, states: list, params: list[SamplingParams]) -> torch.Tensor:
        """transformers' repetition penalty, each row with its own, on the tokens of its history (one masked
        operation for the batch)."""
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and i < len(states)]
        if not rows:
            return logits
        vocab = logits.size(1)
        picked_rows: list[int] = []
        picked_tokens: list[int] = []
        for i in rows:
            tokens = {t for t in _history(states[i]) if 0 <= t < vocab}
            picked_rows.extend([i] * len(tokens))
            picked_tokens.extend(tokens)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        index = torch.tensor([picked_rows, picked_tokens], dtype=torch.long, device=logits.device)
        seen[index[0], index[1]] = True
        penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device).unsqueeze(-1)
        return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], states: list, vocab: int) -> torch.Tensor:
        """The exponential race on each row's filtered distribution, with the generator of its (seed, position)."""
        device = logits.device
        scaled = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(-1)
        scaled = _filter(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        gen = self._generator(device)
        noise = torch.empty_like(probs)
        for i, (p, state) in enumerate(zip(params, states, strict=True)):
            seed = p.seed if p.seed is not None else 0
            gen.manual_seed(_stream_seed((seed + _child_index(state.request_id)) & _MASK, _position(state)))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    def _note_draws(self, states: list, params: list[SamplingParams], tokens: torch.Tensor,
                    logprobs: torch.Tensor) -> None:  # fmt: skip
        """Each request's stream moves one position on, and the draw is kept on its state until its read-back
        (``_cbpause_drawn``, in the order drawn: position -> the token, kept for a repetition penalty, and its top
        log-probabilities), where :meth:`read_back` takes it."""
        need_tokens = any(p.repetition_penalty != 1.0 for p in params[: len(states)])
        k = max((p.logprobs for p in params[: len(states)]), default=0)
        token_list = tokens.tolist() if need_tokens else None
        tops = None
        if k:
            values, ids = logprobs.topk(min(k, logprobs.size(1)), dim=-1)
            tops = (ids.tolist(), values.tolist())
        for i, (state, p) in enumerate(zip(states, params, strict=False)):
            position = _position(state)
            state._cbpause_draws = position + 1
            drawn = getattr(state, "_cbpause_drawn", None)
            if drawn is None:
                state._cbpause_drawn = drawn = {}
            top = None
            if tops and p.logprobs:
                top = tuple((t, _finite(v)) for t, v in zip(tops[0][i][: p.logprobs], tops[1][i][: p.logprobs],
                                                                strict=True))  # fmt: skip
            drawn[position] = (None if token_list is None else token_list[i], top)

    def read_back(self, prepare_batch_update: Any) -> Any:
        """Wrap an IO's ``prepare_batch_update``: each request's oldest draw not yet read back is the token read back
        now (draws and read-backs go in the same order): its position is kept on the state (``_cbpause_landed``,
        which a traced loop's label log records: ``TraceRequestVersions`` checks that it is the token's index), and
        its log-probability carries the top log-probabilities drawn with it (:class:`TopLogprob`), so that
        upstream's read-back appends them to the request's ``logprobs`` in its own order."""

        def wrapped() -> tuple:
            requests, tokens, logprobs = prepare_batch_update()
            row = 0
            for future in requests:
                if not future.has_new_token:
                    continue
                state = future.state
                drawn = getattr(state, "_cbpause_drawn", None)
                if drawn:
                    position = next(iter(drawn))
                    _, top = drawn.pop(position)
                    state._cbpause_landed = position
                    if top is not None and logprobs is not None and row < len(logprobs):
                        logprobs[row] = TopLogprob(logprobs[row], top)
                row += 1
            return requests, tokens, logprobs

        wrapped._cbpause_read_back = True  # type: ignore[attr-defined]
        return wrapped


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


def _filter(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p on what top-k left (renormalized), then min-p, each row with its own values, on
    temperature-scaled logits (masked to -inf), in the order transformers' and vLLM's samplers apply them; the most
    likely token always stays."""
    vocab = scaled.size(-1)
    device = scaled.device
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    ps = torch.tensor([p.top_p for p in params], device=device)
    mins = torch.tensor([p.min_p for p in params], device=device)
    if not ((ks < vocab).any() or (ps < 1).any() or (mins > 0).any()):
        return scaled
    ordered, order = scaled.sort(dim=-1, descending=True)
    remove = torch.arange(vocab, device=device).unsqueeze(0) >= ks.unsqueeze(-1)  # top-k
    probs = torch.softmax(ordered.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each, after top-k
    remove |= before >= ps.unsqueeze(-1)  # top-p: the smallest prefix whose mass reaches p
    remove |= probs < mins.unsqueeze(-1) * probs[:, :1]  # min-p, relative to the most likely token
    remove[:, 0] = False
    masked = ordered.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, masked)
