"""Per-request sampling on transformers' real loop (spec R-SAMPLING): ``init_continuous_batching(...,
per_request_sampling=True)`` and ``add_request(..., sampling=SamplingParams(...))``.

Each request is sampled with its own arguments in one batch, its log-probabilities are the model's log-softmax at its
temperature, and a seed names a stream of draws, one per token position: the same seed and prompt give the same
tokens whatever runs beside them, across keep and retract windows, and again after the staleness bound restarts the
request from its prompt.
"""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor  # noqa: E402

from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.integrations.sampling import (  # noqa: E402
    MAX_TOP_LOGPROBS,
    SamplingParams,
    TopLogprob,
    top_logprobs,
)
from cbpause.testing import StepGate, batching_config, greedy_config, greedy_reference  # noqa: E402

from .conftest import MAX_NEW, PROMPT, WAIT, results  # noqa: E402
from .test_versions import window_after_a_step  # noqa: E402

pytestmark = pytest.mark.layer("loop")


@pytest.fixture
def sampler_manager(cpu_model, request):
    """A started manager with per-request sampling (``request.param``: extra keywords of the manager)."""
    extra = getattr(request, "param", {}) or {}
    config = batching_config(**extra.pop("batching", {}))
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), config, per_request_sampling=True,
                                           **extra)  # fmt: skip
    manager.start()
    yield manager
    if manager.is_running():
        manager.stop(block=True, timeout=WAIT)


def run(manager, params: list[SamplingParams | None], prompt: list[int] = PROMPT, n: int = MAX_NEW) -> list:
    ids = [manager.add_request(list(prompt), max_new_tokens=n, sampling=p) for p in params]
    outs = results(manager, ids)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


def model_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """The model's own log-softmax at ``temperature`` of each of ``tokens`` after ``prompt``, and each position's."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def test_the_same_seed_and_prompt_give_the_same_tokens_whatever_runs_beside_them(sampler_manager):
    alone = run(sampler_manager, [SamplingParams(temperature=1.0, seed=11)])[0].generated_tokens
    beside = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.7, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=11), None,
              SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.3)]  # fmt: skip
    outs = run(sampler_manager, beside * 2)
    same = [o.generated_tokens for o, p in zip(outs, beside * 2, strict=True) if p == beside[0]]
    assert same == [alone, alone]
    others = {tuple(o.generated_tokens) for o in outs}
    assert len(others) > 3, "requests with other arguments sample otherwise"
    unseeded = run(sampler_manager, [SamplingParams(temperature=1.0)] * 4)
    assert len({tuple(o.generated_tokens) for o in unseeded}) > 1, "a request without a seed gets one of its own"


def test_greedy_requests_are_the_argmax_beside_sampled_ones(sampler_manager, cpu_model):
    outs = run(sampler_manager, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=1),
                                 SamplingParams(temperature=0.0, top_k=3, top_p=0.5)])  # fmt: skip
    expected = greedy_reference(cpu_model, PROMPT, MAX_NEW)
    assert outs[0].generated_tokens == expected and outs[2].generated_tokens == expected
    # A filter that leaves one token samples the argmax too (top-k 1, top-p near 0, min-p 1).
    narrow = run(sampler_manager, [SamplingParams(top_k=1, seed=5), SamplingParams(top_p=1e-6, seed=6),
                                   SamplingParams(min_p=1.0, seed=7)])  # fmt: skip
    assert [o.generated_tokens for o in narrow] == [expected] * 3


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0, 1.7])
def test_log_probabilities_are_the_model_s_at_the_temperature_before_penalty_and_filters(sampler_manager, cpu_model,
                                                                                         temperature):  # fmt: skip
    params = SamplingParams(temperature=temperature, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=4,
                            logprobs=5)  # fmt: skip
    (out,) = run(sampler_manager, [params])
    tokens = list(out.generated_tokens)
    full = model_logprobs(cpu_model, PROMPT, tokens, temperature or 1.0)
    chosen = full.gather(1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor([float(x) for x in out.logprobs]), chosen, atol=1e-4)
    tops = top_logprobs(out)
    assert len(tops) == len(tokens) and all(len(t) == 5 for t in tops)
    values, ids = full.topk(5, dim=-1)
    for k, top in enumerate(tops):
        assert [i for i, _ in top] == ids[k].tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values[k], atol=1e-4)


def test_a_token_is_drawn_from_what_the_filters_leave(sampler_manager, cpu_model):
    """Every sampled token is among the top-k of its step (the filters are per request: a request beside it with no
    filter draws outside them)."""
    outs = run(sampler_manager, [SamplingParams(temperature=2.0, top_k=2, seed=s) for s in range(4)]
               + [SamplingParams(temperature=2.0, seed=s) for s in range(4)])  # fmt: skip
    outside = 0
    for i, out in enumerate(outs):
        full = model_logprobs(cpu_model, PROMPT, list(out.generated_tokens), 1.0)
        ranks = [(full[k] > full[k, t]).sum().item() for k, t in enumerate(out.generated_tokens)]
        if i < 4:
            assert max(ranks) <= 1, ranks
        else:
            outside += sum(r > 1 for r in ranks)
    assert outside > 0, "at temperature 2 without top-k, some tokens come from beyond the top two"


def test_a_repetition_penalty_is_transformers_rule_on_the_prompt_and_the_tokens_so_far(sampler_manager, cpu_model):
    penalty = 1.8
    (out,) = run(sampler_manager, [SamplingParams(temperature=0.0, repetition_penalty=penalty)])
    processor, ids = RepetitionPenaltyLogitsProcessor(penalty), list(PROMPT)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            scores = processor(torch.tensor([ids]), cpu_model(torch.tensor([ids])).logits[:, -1].float())
            ids.append(int(scores.argmax()))
    assert out.generated_tokens == ids[len(PROMPT) :]
    assert out.generated_tokens != greedy_reference(cpu_model, PROMPT, MAX_NEW)


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_a_seeded_request_draws_the_same_tokens_across_a_window(sampler_manager, mode):
    """The weights unchanged, a window in keep (KV kept) or retract (KV recomputed) mode leaves the stream where it was:
    the request's tokens are those of a run without the window."""
    params = SamplingParams(temperature=1.0, seed=23)
    (expected,) = run(sampler_manager, [params])
    gate = StepGate(sampler_manager.background_thread_status, "end_step")
    rid = sampler_manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW, sampling=params)
    assert gate.reached.wait(WAIT)
    status = sampler_manager.background_thread_status
    hold = status.request_pause(mode=mode)
    gate.release()
    status.enter_pause(hold, timeout=WAIT)
    scheduler = sampler_manager.batch_processor.scheduler
    if mode == "retract":
        assert rid in scheduler.waiting_requests and scheduler.waiting_requests[rid]._true_initial_tokens
    status.leave_pause(hold)
    (out,) = results(sampler_manager, [rid])
    assert out.generated_tokens == expected.generated_tokens


@pytest.mark.parametrize("sampler_manager", [{"max_staleness": 0}], indirect=True)
def test_a_request_the_staleness_bound_restarts_replays_its_seed_s_stream(sampler_manager):
    params = SamplingParams(temperature=1.0, seed=31)
    (expected,) = run(sampler_manager, [params])
    gate = StepGate(sampler_manager.background_thread_status, "end_step")
    rid = sampler_manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW, sampling=params)
    assert gate.reached.wait(WAIT)
    gate.release()
    with sampler_manager.pause():  # a version first, then a newer one: the request is a version behind, restarted
        sampler_manager.set_weight_version(1)
    counts = window_after_a_step(sampler_manager, 2)
    assert 0 < counts.get(rid, 0) < MAX_NEW
    (out,) = results(sampler_manager, [rid])
    assert sampler_manager.versions.stale >= 1
    assert out.generated_tokens == expected.generated_tokens and out.weight_versions == [(0, 2)]


class _State:
    """What the sampler reads of a request's state."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id, self.logit_processor_kwargs = request_id, {"sampling": params}
        self.initial_tokens, self.generated_tokens, self._true_initial_tokens = list(PROMPT), [], 0


class _Future:
    def __init__(self, state: _State) -> None:
        self.state, self.has_new_token = state, True


def _draw(sampler, futures: list, logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """One step of the sampler as a batch processor makes it: the batch's arguments, the list's call, the sample."""
    args = torch.zeros((1, 8), dtype=torch.int32)
    sampler.prepare_tensor_args(futures, args)
    sampler(None, logits.unsqueeze(0), args)
    out = torch.zeros((2, 8), dtype=torch.int32)
    sampler.sample(logits.unsqueeze(0), out)
    n = len(futures)
    return out[0, :n].tolist(), out[1, :n].view(dtype=torch.float32).tolist()


def _read_back(sampler, futures: list, tokens: list[int], logprobs: list[float]) -> None:
    """A read-back as upstream's update_batch makes it: the wrapped prepare_batch_update, then each token appended."""
    _, _, lps = sampler.read_back(lambda: (futures, tokens, list(logprobs)))()
    for future, token, lp in zip(futures, tokens, lps, strict=True):
        future.state.generated_tokens.append(token)
        future.state.logprobs = [*getattr(future.state, "logprobs", []), lp]


def test_async_order_draws_and_reads_back_what_the_synchronous_order_does():
    """With async batching, step k+1 is sampled before step k is read back (upstream's ContinuousBatchingAsyncIOs,
    CUDA only): each request's position, its penalty's tokens and its top log-probabilities must still be those of
    the synchronous order (sample, read back, sample, ...), with the same logits."""
    from cbpause.integrations.sampling import Sampler

    torch.manual_seed(0)
    logits = [torch.randn(2, 32) for _ in range(6)]
    params = [SamplingParams(temperature=1.0, seed=41, logprobs=3),
              SamplingParams(temperature=0.0, repetition_penalty=4.0, logprobs=2)]  # fmt: skip

    def order(asynchronous: bool) -> list:
        sampler = Sampler(SamplingParams())
        futures = [_Future(_State(f"r{i}", p)) for i, p in enumerate(params)]
        pending = None
        for step in logits:
            drawn = _draw(sampler, futures, step)
            if not asynchronous:
                _read_back(sampler, futures, *drawn)
                continue
            if pending is not None:
                _read_back(sampler, futures, *pending)
            pending = drawn
        if pending is not None:
            _read_back(sampler, futures, *pending)
        return [(f.state.generated_tokens, [lp.top for lp in f.state.logprobs]) for f in futures]

    sync, async_ = order(False), order(True)
    assert sync == async_
    assert len(set(sync[1][0])) == len(sync[1][0]), "the penalty (4.0 on a random row) keeps greedy from repeating"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (async batching needs one)")
def test_on_cuda_async_batching_samples_as_the_synchronous_loop_does():
    from cbpause.testing import tiny_llama

    model = tiny_llama("cuda")
    params = [SamplingParams(temperature=1.0, seed=41, logprobs=3),
              SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=2)]  # fmt: skip
    got = {}
    for asynchronous in (True, False):
        manager = cbt.init_continuous_batching(model, greedy_config(MAX_NEW),
                                               batching_config(use_async_batching=asynchronous),
                                               per_request_sampling=True)  # fmt: skip
        manager.start()
        try:
            got[asynchronous] = [(o.generated_tokens, top_logprobs(o)) for o in run(manager, params)]
        finally:
            manager.stop(block=True, timeout=WAIT)
    assert [t for t, _ in got[True]] == [t for t, _ in got[False]]
    assert [[i for i, _ in top] for _, tops in got[True] for top in tops] == \
        [[i for i, _ in top] for _, tops in got[False] for top in tops]


def test_bad_sampling_arguments_raise_naming_the_argument_and_enqueue_nothing(sampler_manager, plain_manager):
    for bad, error in [({"temperature": -1}, ValueError), ({"temperature": "hot"}, TypeError),
                       ({"temperature": float("nan")}, ValueError), ({"top_p": 0}, ValueError),
                       ({"top_p": 1.5}, ValueError), ({"top_k": -2}, ValueError), ({"top_k": 2.5}, TypeError),
                       ({"min_p": 2}, ValueError), ({"repetition_penalty": 0}, ValueError),
                       ({"seed": 2**64}, ValueError), ({"seed": "1"}, TypeError), ({"seed": True}, TypeError),
                       ({"logprobs": MAX_TOP_LOGPROBS + 1}, ValueError), ({"logprobs": -1}, ValueError)]:  # fmt: skip
        with pytest.raises(error, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    with pytest.raises(TypeError, match="SamplingParams"):
        sampler_manager.add_request(list(PROMPT), max_new_tokens=2, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="unknown arguments"):
        sampler_manager.add_request(list(PROMPT), max_new_tokens=2, temperature=0.5)
    assert sampler_manager._live_ids == set()
    sampler_manager.stop(block=True, timeout=WAIT)  # one running manager per model
    plain_manager.start()
    with pytest.raises(ValueError, match="per_request_sampling=True"):
        plain_manager.add_request(list(PROMPT), max_new_tokens=2, sampling=SamplingParams())
    assert plain_manager._live_ids == set()


def test_a_manager_with_per_request_sampling_refuses_cuda_graphs_and_compiled_steps(cpu_model):
    for config in (ContinuousBatchingConfig(use_cuda_graph=True), ContinuousBatchingConfig(default_compile_level=1)):
        with pytest.raises(ValueError, match="per-request sampling"):
            cbt.init_continuous_batching(cpu_model, greedy_config(4), config, per_request_sampling=True)
    auto = ContinuousBatchingConfig()
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(4), auto, per_request_sampling=True)
    assert auto.use_cuda_graph is False and auto.return_logprobs is True and manager.sampler is not None
    with pytest.raises(TypeError, match="per_request_sampling"):
        cbt.init_continuous_batching(cpu_model, greedy_config(4), batching_config(), per_request_sampling="yes")


def test_a_top_logprob_is_a_float_that_keeps_its_top_through_pickling_and_copies():
    value = TopLogprob(-0.5, ((3, -0.5), (9, -1.25)))
    back = pickle.loads(pickle.dumps([value]))[0]
    assert back == -0.5 and back.top == ((3, -0.5), (9, -1.25)) and isinstance(back, float)
    assert float(value) + 1 == 0.5 and list([value])[0].top == value.top
