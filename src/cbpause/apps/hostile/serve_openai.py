"""The hostile user of ``cbpause serve``'s OpenAI routes (R-SERVE-OPENAI): the conventions an OpenAI client relies on,
and the rollout clients' surface misused (per-request sampling, ``n``, stops, token ids, log-probabilities).  Two
cases of :data:`.serve_cases.CASES`, on the same guarded server."""

from __future__ import annotations

import json

from .serve_support import AUTH, KEY, NAME, VOCAB, Guarded, call, check, in_thread, message, wait_in_flight
from .support import WAIT, Silent

__all__ = ["openai_conventions", "rollout_clients_misuse"]


def openai_conventions(server: Guarded) -> None:
    """Point 10: /v1/models was a 500 without a Hugging Face cache; nonsense sampling arguments were accepted; chat
    without a template was a 500; streamed answers had no labels and were not counted."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=WAIT)
    check([m.id for m in client.models.list().data] == [NAME], "/v1/models does not list the served model")
    options = call("OPTIONS", server.url + "/v1/models")
    check(options.status_code == 200 and options.json()["data"][0]["id"] == NAME, f"OPTIONS: {options.status_code}")
    for route in ("/v1/systemone", "/v1/audio/transcriptions"):  # found by review: outside the pausable loop; a 500
        gone = call("POST", server.url + route, json={})
        check(gone.status_code in (404, 405), f"{route} is served: {gone.status_code}")
    check(client.completions.create(model=NAME, prompt="t3 t4", max_tokens=3, temperature=0).choices[0].text, "empty")
    try:
        client.completions.create(model="some/other-model", prompt="t3 t4", max_tokens=3)
        raise Silent("another model's name was served")
    except openai.BadRequestError as error:
        check("serves" in str(error), f"the refusal says {error}")
    for argument, value in [("best_of", 3), ("temperature", -1), ("top_p", 7), ("max_tokens", "5"), ("max_tokens", 0),
                            ("max_tokens", True), ("logit_bias", {"1": 5}), ("n", 65), ("logprobs", 21),
                            ("frequency_penalty", 0.3), ("seed", 1.5), ("no_such_argument", 1)]:  # fmt: skip
        body = {"model": NAME, "prompt": "t3 t4", "max_tokens": 3, argument: value}
        answer = call("POST", server.url + "/v1/completions", json=body)
        check(answer.status_code == 400 and argument in message(answer), f"{argument}={value!r}: {answer.text[:200]}")
    chat = call("POST", server.url + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": "t3 t4"}], "max_tokens": 2})  # fmt: skip
    check(chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant",
          f"chat: {chat.text[:200]}")  # fmt: skip
    no_messages = call("POST", server.url + "/v1/chat/completions", json={"model": NAME})
    check(no_messages.status_code == 400 and "messages" in message(no_messages), f"no messages: {no_messages.text}")
    responses = call("POST", server.url + "/v1/responses", json={"input": "t3 t4", "max_output_tokens": 3})
    check(responses.status_code in (200, 400) and responses.status_code != 500, f"responses: {responses.text[:200]}")

    def finished() -> float:
        return float(next(line.split()[-1] for line in call("GET", server.url + "/metrics").text.splitlines()
                          if line.startswith('cbpause_requests_total{outcome="finished"}')))  # fmt: skip

    before = finished()
    body = {"model": NAME, "prompt": "t3 t4", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=WAIT) as answer:
        check(answer.status_code == 200, f"a stream: {answer.status_code}")
        lines = [line[len("data: "):] for line in answer.iter_lines() if line.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", f"a stream that does not end with [DONE]: {lines[-1:]}")
    chunks = [json.loads(line) for line in lines[:-1]]
    check(chunks and all("weight_versions" not in c for c in chunks[:-1]), "labels before the last chunk")
    last = chunks[-1]
    check(last["choices"][0]["finish_reason"] and last["choices"][0].get("weight_versions") and "kv_versions" in last,
          f"the last chunk has no labels: {last}", Silent)  # fmt: skip
    check(finished() == before + 1, "a streamed request was not counted", Silent)


def rollout_clients_misuse(server: Guarded) -> None:
    """The rollout clients' surface, misused: what a request may make the server hold is bounded (choices, stop
    strings, the answer's size, a request id); prompts of token ids outside the vocabulary, booleans for integers, a
    temperature so small that its logits would overflow; and clients that leave a request of several choices, streamed
    or not, leave none of them running."""
    import httpx

    def refused(body: dict, named: str, route: str = "/v1/completions") -> None:
        raw = json.dumps({"model": NAME, **body})  # (ASCII: a lone surrogate travels escaped, as a client sends it)
        answer = call("POST", server.url + route, content=raw, headers={"content-type": "application/json"})
        check(answer.status_code == 400 and named in message(answer), f"{body}: {answer.status_code} {answer.text}")

    refused({"prompt": [[3]] * 33, "n": 2}, "choices")
    refused({"prompt": [3], "stop": ["t4"] * 17}, "stop")
    refused({"prompt": [3], "stop": ["x" * 257]}, "stop")
    refused({"prompt": [3], "n": 64, "logprobs": 20, "max_tokens": 4000}, "values")
    refused({"prompt": [3, True]}, "prompt")
    refused({"prompt": [3, -1]}, "prompt")
    refused({"prompt": [[3], [VOCAB]]}, "prompt")
    refused({"prompt": [3], "n": True}, "n")
    refused({"prompt": [3], "seed": 2**64}, "seed")
    refused({"prompt": [3], "stop_token_ids": [True]}, "stop_token_ids")
    refused({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0]", "/v1/chat/completions")  # fmt: skip
    # A stranger's own chat template (unbounded memory and CPU in the tokenizer's threads), a lone surrogate, a
    # penalty that overflows float32 (5.5 GB, 500s, and token 0 sampled silently, before these were refused).
    refused({"messages": [{"role": "user", "content": "t3"}],
             "chat_template_kwargs": {"chat_template": "{{ 't3 ' * 100000000 }}"}}, "chat_template",
            "/v1/chat/completions")  # fmt: skip
    refused({"prompt": "\ud800"}, "prompt")
    refused({"prompt": [3], "repetition_penalty": 1e-40}, "repetition_penalty")
    long_id = call("POST", server.url + "/v1/completions", json={"model": NAME, "prompt": [3], "max_tokens": 1},
                   headers={"x-request-id": "i" * 300})  # fmt: skip
    check(long_id.status_code == 400, f"a request id of 300 characters: {long_id.status_code}")
    tiny = call("POST", server.url + "/v1/completions", json={"model": NAME, "prompt": [3, 4], "max_tokens": 4,
                                                              "temperature": 1e-30, "logprobs": 2})  # fmt: skip
    check(tiny.status_code == 200 and all(x > -1e4 for x in tiny.json()["choices"][0]["logprobs"]["token_logprobs"]),
          f"a temperature of 1e-30: {tiny.status_code} {tiny.text[:300]}")  # fmt: skip
    # A client that leaves a streamed request of four choices, after the first token: none of them runs on.
    body = {"model": NAME, "prompt": [3, 4], "max_tokens": 3000, "n": 4, "stream": True, "seed": 3}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=WAIT) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                break
    wait_in_flight(server.url, 0)
    # And one that leaves a non-streamed one while it runs.
    thread, out = in_thread(call, "POST", server.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    thread.join(WAIT)
    check(not thread.is_alive() and "error" in out, "the client's own timeout did not end its request")
    wait_in_flight(server.url, 0)
