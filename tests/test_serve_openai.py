"""The OpenAI requests RL rollout clients send, against a real ``cbpause serve`` (spec R-SERVE-OPENAI, R-SAMPLING):
the ``openai`` package's completions and chat calls with per-request sampling, seeds, ``n``, ``stop``, log-
probabilities and token ids, streamed and not; TRL's ``VLLMClient`` unchanged (introspection, pause, resume); a
seeded request across keep, retract and abort pauses; the metrics; and what a bad request gets."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.servers import serve_process  # noqa: E402

pytestmark = [pytest.mark.layer("system"), pytest.mark.xdist_group("serve_openai")]
VOCAB = 32
DEFAULT_MAX = 6  # the checkpoint's generation config's max_new_tokens: the length of an answer that names none


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import GenerationConfig

    from cbpause.testing.trl_cpu import save_tiny_policy

    path = save_tiny_policy(tmp_path_factory.mktemp("ckpt") / "tiny", vocab_size=VOCAB)
    GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=DEFAULT_MAX, eos_token_id=-1,
                     pad_token_id=0).save_pretrained(path)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with serve_process(checkpoint, "--default-ttl", str(HANG_S), "--served-model-name", "tiny", log=log) as (url, _):
        yield url, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def post(url: str, **kwargs):
    return httpx.post(url, timeout=HANG_S, **kwargs)


def events_of(lines) -> Iterator[dict]:
    """The data events of a server-sent stream, read lazily: a test stops reading where it acts on the server."""
    return (json.loads(line[6:]) for line in lines if line.startswith("data: {"))


def token_ids(events) -> list[int]:
    return [t for e in events if e.get("choices") for t in e["choices"][0].get("token_ids") or []]


def until_first_tokens(events) -> list[int]:
    """Reads a stream until it has sent a token: the request is in flight, with a position to keep."""
    for event in events:
        if tokens := token_ids([event]):
            return tokens
    raise AssertionError("the stream ended before its first token")


def text_of(tokens: list[int]) -> str:
    from cbpause.testing.trl_cpu import tiny_tokenizer

    return tiny_tokenizer(VOCAB).decode(tokens, skip_special_tokens=True)


def model_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def test_completions_sample_each_request_with_its_own_arguments_and_seed(client, model):
    prompt = [3, 4, 5]
    extra = {"top_k": 8, "min_p": 0.01, "repetition_penalty": 1.1, "return_token_ids": True}
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=10, temperature=0.8, top_p=0.95, seed=7, logprobs=3,
                  extra_body=extra)  # fmt: skip
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    choice = first.choices[0]
    tokens = choice.model_extra["token_ids"]
    assert len(tokens) == 10 and choice.finish_reason == "length" and choice.model_extra["prompt_token_ids"] == prompt
    assert again.choices[0].model_extra["token_ids"] == tokens  # the same seed and prompt: the same tokens
    assert first.usage.completion_tokens == 10 and first.usage.prompt_tokens == 3
    # the log-probabilities are the model's at the request's temperature, the top ones the most likely of it
    full = model_logprobs(model, prompt, tokens, 0.8)
    chosen = full.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), chosen, atol=1e-4)
    assert all(len(top) == 3 for top in choice.logprobs.top_logprobs)
    assert len(choice.logprobs.tokens) == 10 and choice.text == text_of(tokens)
    assert choice.model_extra["weight_versions"] == [[0, None]]
    # n choices, each with a seed of its own (seed + i), each labelled; choice 0 is the request's with n=1
    many = client.completions.create(**{**kwargs, "n": 3})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].model_extra["token_ids"] == tokens
    assert len({tuple(c.model_extra["token_ids"]) for c in many.choices}) == 3
    assert all(c.model_extra["weight_versions"] == [[0, None]] for c in many.choices)
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    argmax = model_logprobs(model, prompt, greedy.choices[0].model_extra["token_ids"], 1.0).argmax(-1).tolist()
    assert greedy.choices[0].model_extra["token_ids"] == argmax


def test_token_id_prompts_batches_and_the_default_length(client):
    batch = client.completions.create(model="tiny", prompt=[[3, 4], [5, 6, 7]], temperature=0, n=2,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.model_extra["prompt_token_ids"] for c in batch.choices] == [[3, 4], [3, 4], [5, 6, 7], [5, 6, 7]]
    assert all(len(c.model_extra["token_ids"]) == DEFAULT_MAX for c in batch.choices)  # the checkpoint's length
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 4 * DEFAULT_MAX
    text = client.completions.create(model="tiny", prompt=["t3 t4", "t5"], max_tokens=2, temperature=0)
    assert len(text.choices) == 2 and all(c.text for c in text.choices)


def test_stop_strings_and_stop_token_ids_end_a_choice_with_finish_reason_stop(client):
    def ask(**extra):
        return client.completions.create(model="tiny", prompt=[3, 4, 5], max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True, **extra.pop("body", {})},
                                         **extra).choices[0]  # fmt: skip

    base = ask()
    tokens = base.model_extra["token_ids"]
    word = text_of(tokens[3:4]) or "t3"
    at = base.text.find(word)
    stopped = ask(stop=[word])
    # the answer is the text before the stop string, and the tokens up to the one that completed it
    covering = next(k for k in range(1, len(tokens) + 1) if len(text_of(tokens[:k])) >= at + len(word))
    assert stopped.finish_reason == "stop" and stopped.text == base.text[:at], (stopped.text, base.text, word)
    assert stopped.model_extra["token_ids"] == tokens[:covering]
    by_id = ask(body={"stop_token_ids": [tokens[2]]})
    assert by_id.finish_reason == "stop" and by_id.model_extra["token_ids"] == tokens[: tokens.index(tokens[2]) + 1]
    assert base.finish_reason == "length"


def test_a_streamed_completion_carries_its_log_probabilities_and_labels_and_ends_with_usage(client):
    chunks = list(client.completions.create(model="tiny", prompt=[3, 4], max_tokens=5, temperature=0.9, seed=3,
                                            logprobs=2, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))  # fmt: skip
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    logprobs = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == len(logprobs) == 5
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].model_extra["weight_versions"] == [[0, None]]
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    whole = client.completions.create(model="tiny", prompt=[3, 4], max_tokens=5, temperature=0.9, seed=3,
                                      extra_body={"return_token_ids": True}).choices[0]  # fmt: skip
    assert whole.model_extra["token_ids"] == tokens  # streamed or not, a seed's tokens


def test_chat_completions_with_log_probabilities_streamed_and_not(client, model):
    messages = [{"role": "system", "content": "t3"}, {"role": "user", "content": "t4 t5"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.7, seed=5,
                                            logprobs=True, top_logprobs=2, n=2,
                                            extra_body={"return_token_ids": True})  # fmt: skip
    assert len(answer.choices) == 2 and answer.model_extra["prompt_token_ids"] == [3, 4, 5, 0]  # the template's
    choice = answer.choices[0]
    tokens = choice.model_extra["token_ids"]
    assert choice.message.role == "assistant" and choice.message.content == text_of(tokens)
    full = model_logprobs(model, [3, 4, 5, 0], tokens, 0.7)
    chosen = full.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([e.logprob for e in choice.logprobs.content]), chosen, atol=1e-4)
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in choice.logprobs.content)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0.7,
                                                 seed=5, logprobs=True, stream=True))  # fmt: skip
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content  # choice 0's seed
    assert sum(len(c.choices[0].logprobs.content) for c in stream if c.choices and c.choices[0].logprobs) == 4


def test_what_a_request_cannot_have_is_a_400_that_names_it(server, client):
    url = server[0]
    bad = [
        ("/v1/completions", {"prompt": [3], "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": [3], "frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": [3], "no_such_argument": 1}, "no_such_argument"),
        ("/v1/completions", {"prompt": [3], "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": [3], "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": [3], "top_k": -2}, "top_k"),
        ("/v1/completions", {"prompt": [3], "seed": "x"}, "seed"),
        ("/v1/completions", {"prompt": [3], "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": [3], "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": [3], "n": 65}, "65"),
        ("/v1/completions", {"prompt": [3, VOCAB]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [3], "max_tokens": 5000}, "max_model_len"),
        ("/v1/completions", {"prompt": [3], "stop": [""]}, "stop"),
        ("/v1/completions", {"prompt": [3], "stop_token_ids": [-1]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [3], "model": "other"}, "other"),
        ("/v1/completions", {"prompt": [3], "echo": True}, "echo"),
        ("/v1/chat/completions", {}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3"}], "tools": [{"type": "function"}]},
         "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t3"}], "top_logprobs": 2},
         "top_logprobs"),
    ]  # fmt: skip
    for route, body, named in bad:
        answer = post(url + route, json=body)
        assert answer.status_code == 400 and named in answer.json()["error"]["message"], (body, answer.text)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="t3", temperature=-0.5)
    assert httpx.get(url + "/metrics", timeout=HANG_S).status_code == 200  # nothing of it is left to break a scrape


def test_trl_s_vllm_client_reads_the_server_and_pauses_and_resumes_it_unchanged(server):
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # the trainer's process has one: the client logs through accelerate
    url, log = server
    vllm = VLLMClient(url, server_timeout=HANG_S)
    vllm.wait_for_server_ready(poll_interval_s=0.1)
    from cbpause.serve.capacity import CPU_SEQUENCES

    assert vllm.get_max_model_len() == 4096 and vllm.get_dtype() == "torch.float32" and vllm.get_world_size() == 1
    assert vllm.get_server_info()["lora_config"] is None
    vllm.pause()  # /pause?mode=keep: vLLM's keep with its default clear_cache, cbpause's retract
    try:
        assert httpx.get(url + "/is_paused", timeout=HANG_S).json() == {"is_paused": True, "leases": 1,
                                                                         "holders": ["vllm-client"], "torn": False}
    finally:  # (a failure here must not leave the module's server paused for the next test)
        vllm.resume()
    assert httpx.get(url + "/is_paused", timeout=HANG_S).json()["is_paused"] is False
    # the start-up line says how much memory the cache takes: on the CPU, sized from the model (max_model_len 4096)
    line = next(x for x in log.read_text().splitlines() if "KV cache:" in x)
    blocks, page = (int(x) for x in re.search(r"(\d+) blocks of (\d+) tokens", line).groups())
    assert blocks * page >= CPU_SEQUENCES * 4096 and "MiB on cpu" in line and "max_model_len 4096" in line


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_a_seeded_request_keeps_its_place_and_its_stream_across_a_pause(server, mode):
    url = server[0]
    body = {"prompt": [3, 4], "max_tokens": 400, "temperature": 1.0, "seed": 99, "stream": True,
            "return_token_ids": True}  # fmt: skip
    expected = post(url + "/v1/completions", json={**body, "stream": False}).json()["choices"][0]["token_ids"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as answer:
        events = events_of(answer.iter_lines())
        tokens = until_first_tokens(events)
        lease = post(url + "/pause", json={"mode": mode}).json()
        assert "lease_id" in lease, lease
        post(url + "/resume", json={"lease_id": lease["lease_id"]})
        tokens += token_ids(events)
    assert tokens == expected


def test_an_abort_pause_ends_a_request_with_a_retryable_503(server):
    url = server[0]
    box = {}

    def request():
        box["answer"] = post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 3000, "seed": 1})

    thread = threading.Thread(target=request)
    thread.start()
    deadline = time.monotonic() + HANG_S
    while "cbpause_requests_in_flight 1.0" not in httpx.get(url + "/metrics", timeout=HANG_S).text:
        assert time.monotonic() < deadline, "the request never got in flight"
        time.sleep(0.02)  # polling: the server is another process
    lease = post(url + "/pause", json={"mode": "abort"}).json()
    post(url + "/resume", json={"lease_id": lease["lease_id"]})
    thread.join(HANG_S)
    assert not thread.is_alive()
    answer = box["answer"]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text


def test_metrics_count_with_counters_and_time_updates_by_source(server, checkpoint, tmp_path):
    url = server[0]
    text = httpx.get(url + "/metrics", timeout=HANG_S).text
    assert re.search(r'^cbpause_requests_total\{outcome="finished"\} [1-9]', text, re.M)
    assert re.search(r"^cbpause_generation_tokens_total [1-9]", text, re.M)
    assert re.search(r"^cbpause_prompt_tokens_total [1-9]", text, re.M)
    assert re.search(r"^# TYPE cbpause_requests(_total)? counter", text, re.M)
    assert re.search(r"^# TYPE cbpause_pause_entries(_total)? counter", text, re.M)
    assert re.search(r'^cbpause_weight_update_seconds_count\{source="disk"\} 0', text, re.M)
    assert re.search(r'^cbpause_weight_update_seconds_count\{source="broadcast"\} 0', text, re.M)


def test_the_metrics_table_of_the_docs_is_the_exposition_s():
    """One home per fact: docs/serving.md's table of metrics (name and kind) is what a server exposes."""
    from types import SimpleNamespace

    from cbpause.serve.metrics import ServerMetrics

    from .conftest import ROOT

    snapshot = SimpleNamespace(pauses_taken=2, open_window_s=None, holders_inside=0, holders_waiting=0)
    status = SimpleNamespace(metrics=lambda: snapshot, state=SimpleNamespace(paused=False))
    manager = SimpleNamespace(background_thread_status=status, _live_ids=set(), weight_version=3)
    leases = SimpleNamespace(expired=1, held=lambda: [])
    generate = SimpleNamespace(outcomes={"finished": 4, "failed": 0, "cancelled": 0, "rejected": 0, "aborted": 0})
    text = ServerMetrics(manager, leases, generate).exposition().decode()
    exposed = dict(re.findall(r"^# TYPE (\w+) (\w+)$", text, re.M))
    exposed = {name: kind for name, kind in exposed.items() if not name.endswith("_created")}
    page = (ROOT / "docs" / "serving.md").read_text()
    documented = {name: kind for name, kind in re.findall(r"^\| `(cbpause_\w+)(?:\{\w+\})?` \| (\w+) \|", page, re.M)}
    assert documented == exposed
    assert re.search(r"^cbpause_pause_entries_total 2\.0$", text, re.M) and "cbpause_weight_version 3.0" in text


def test_an_abort_pause_ends_a_stream_with_a_retryable_error_event_labelled_with_what_it_sent(server):
    url = server[0]
    body = {"prompt": [3, 4], "max_tokens": 3000, "seed": 2, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as answer:
        stream = events_of(answer.iter_lines())
        sent = until_first_tokens(stream)
        lease = post(url + "/pause", json={"mode": "abort"}).json()
        post(url + "/resume", json={"lease_id": lease["lease_id"]})
        events = list(stream)
    sent += token_ids(events)
    last = events[-1]
    assert last["error"]["code"] == 503 and "abort" in last["error"]["message"], last
    assert last["weight_versions"] == [[0, None]] and len(sent) < 3000, (last, len(sent))
    assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)


def test_what_the_hostile_review_found_is_a_400_or_served_never_a_500(server):
    """Issue 56's hostile review: a lone surrogate in a prompt, chat_template_kwargs that are apply_chat_template's
    own arguments (a stranger's chat template among them: unbounded memory and CPU), a template that raises, were 500s
    or worse; a float 0.0 penalty (what clients send) was refused; best_of true was taken for 1."""
    url = server[0]
    user = [{"role": "user", "content": "t3"}]
    refused = [
        ("/v1/completions", '{"prompt":"\\ud800","max_tokens":2}', "prompt"),
        ("/v1/completions", '{"prompt":["t3","\\udfff"],"max_tokens":2}', "prompt[1]"),
        ("/v1/chat/completions", '{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}',
         "messages[0].content"),
        *[("/v1/chat/completions", json.dumps({"messages": user, "max_tokens": 2, "chat_template_kwargs": kwargs}),
           next(iter(kwargs))) for kwargs in (  # fmt: skip
            {"add_generation_prompt": False}, {"tokenize": False}, {"conversation": []}, {"documents": 5},
            {"tokenizer_kwargs": {"add_special_tokens": 5}}, {"chat_template": "{{ 'x' * 10000000 }}"},
            {"chat_template": "{{ 1/0 }}"})],
        ("/v1/completions", '{"prompt":[3],"max_tokens":2,"best_of":true}', "best_of"),
        ("/v1/completions", '{"prompt":[3],"max_tokens":2,"best_of":1.0}', "best_of"),
        ("/v1/completions", '{"prompt":[3],"max_tokens":2,"repetition_penalty":1e-40}', "repetition_penalty"),
    ]
    for route, raw, named in refused:
        answer = post(url + route, content=raw, headers={"content-type": "application/json"})
        assert answer.status_code == 400 and named in answer.json()["error"]["message"], (raw, answer.text[:300])
    for key in ("frequency_penalty", "presence_penalty"):
        assert post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 2, key: 0.0}).status_code == 200
    assert post(url + "/v1/chat/completions", json={"messages": user, "max_tokens": 2,
                                                    "chat_template_kwargs": {"unused_variable": 1}}).status_code == 200


def test_client_ids_and_choice_ids_never_collide_and_an_id_in_flight_is_a_409(server):
    """The review: a request of two choices ran as abc-0 and abc-1, so another client's abc-1 was a 409 and a second
    abc was served beside the first; and an id naming transformers' forks (__child#K) changed the seed's stream."""
    url = server[0]
    body = {"prompt": [3, 4], "max_tokens": 3000, "n": 2, "seed": 1}
    box = {}
    thread = threading.Thread(target=lambda: box.update(answer=post(url + "/v1/completions", json=body,
                                                                       headers={"x-request-id": "abc"})))  # fmt: skip
    thread.start()
    deadline = time.monotonic() + HANG_S
    while "cbpause_requests_in_flight 2.0" not in httpx.get(url + "/metrics", timeout=HANG_S).text:
        assert time.monotonic() < deadline, "the request never got in flight"
        time.sleep(0.02)  # polling: the server is another process
    other = post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 2}, headers={"x-request-id": "abc-1"})
    again = post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 2}, headers={"x-request-id": "abc"})
    lease = post(url + "/pause", json={"mode": "abort"}).json()
    post(url + "/resume", json={"lease_id": lease["lease_id"]})
    thread.join(HANG_S)
    assert other.status_code == 200, other.text
    assert again.status_code == 409, again.text
    assert box["answer"].status_code == 503
    for bad in ("x__child#0", "a#b"):
        answer = post(url + "/v1/completions", json={"prompt": [3], "max_tokens": 2}, headers={"x-request-id": bad})
        assert answer.status_code == 400 and "x-request-id" in answer.json()["error"]["message"], answer.text


def test_a_stream_the_staleness_bound_restarts_ends_with_a_retryable_error_labelled_with_what_it_sent(checkpoint):
    """The review: the error event after a staleness restart said 500, with no labels."""
    with serve_process(checkpoint, "--max-staleness", "0", "--default-ttl", str(HANG_S)) as (url, _):
        lease = post(url + "/pause", json={"mode": "keep"}).json()["lease_id"]
        post(url + "/update_weight_version", json={"lease_id": lease, "weight_version": 0})
        post(url + "/resume", json={"lease_id": lease})
        body = {"prompt": [3, 4], "max_tokens": 3000, "stream": True, "return_token_ids": True, "seed": 5}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as answer:
            stream = events_of(answer.iter_lines())
            until_first_tokens(stream)
            lease = post(url + "/pause", json={"mode": "keep"}).json()["lease_id"]
            post(url + "/update_weight_version", json={"lease_id": lease, "weight_version": 1})
            post(url + "/resume", json={"lease_id": lease})
            events = list(stream)
        last = events[-1]
        assert last["error"]["code"] == 503 and "staleness" in last["error"]["message"], last
        assert last["weight_versions"] == [[0, 0]], last


def test_a_streamed_chat_with_token_ids_gives_its_prompt_s(client):
    stream = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t3"}],
                                                 max_tokens=2, stream=True, extra_body={"return_token_ids": True}))
    assert stream[0].model_extra["prompt_token_ids"] == [3, 0]
