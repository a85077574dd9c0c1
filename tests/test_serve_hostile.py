"""``cbpause serve`` and ``Fleet`` against a hostile user (issue 39): each case of the issue's list, a test that failed
on the main of before the fix.  Real server processes on localhost; the cases that need a server of their own
(SIGTERM, the worker pool) start one."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from cbpause.client import MODES as CLIENT_MODES  # noqa: E402
from cbpause.client import Fleet, FleetError  # noqa: E402
from cbpause.serve.control import MODES  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.servers import serve_process  # noqa: E402

pytestmark = pytest.mark.layer("system")
VOCAB = 32
KEY = "test-key-39"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-served"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from cbpause.testing.trl_cpu import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("ckpt") / "tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(checkpoint, weights_dir):
    """A guarded server: an API key, a served name, 48 leases at most, bodies of 64 kB at most."""
    with serve_process(checkpoint, "--weights-dir", str(weights_dir), "--default-ttl", str(HANG_S), "--num-blocks",
                       "64", "--api-key", KEY, "--served-model-name", NAME, "--max-leases", "48",
                       "--max-body-bytes", "65536") as (url, _process):  # fmt: skip
        yield url


def call(method: str, url: str, **kwargs) -> httpx.Response:
    """A request with the key, bounded by ``HANG_S``."""
    return httpx.request(method, url, **{"timeout": HANG_S, **kwargs, "headers": {**AUTH, **kwargs.get("headers", {})}})


def lease(url: str, **body) -> str:
    answer = call("POST", url + "/pause", json={"ttl": HANG_S, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["lease_id"]


def resume(url: str, lease_id: str) -> None:
    assert call("POST", url + "/resume", json={"lease_id": lease_id}).json()["resumed"] is True


def paused(url: str) -> bool:
    return call("GET", url + "/is_paused").json()["is_paused"]


def completion(url: str, prompt: str = "t3 t4", n: int = 3, **kwargs) -> httpx.Response:
    return call("POST", url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": n}, **kwargs)


def message(answer: httpx.Response) -> str:
    """The error message of an answer: the control routes' ``{"error": text}`` or OpenAI's ``{"error": {message}}``."""
    error = answer.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def wait_in_flight(url: str, n: int, headers: dict | None = None) -> None:
    """Until the server counts ``n`` generation requests in flight (it is another process: nothing to wait on but
    its answers); ``HANG_S`` at most."""
    for _ in range(int(HANG_S * 20)):
        metrics = httpx.get(url + "/metrics", headers=AUTH if headers is None else headers, timeout=HANG_S).text
        if f"cbpause_requests_in_flight {float(n)}" in metrics.splitlines():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"{url} never had {n} requests in flight")


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 -- reported to the test
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# ------------------------------------------------------------------------------------------- 1, 2: bodies and ids


def test_an_empty_object_is_a_keep_pause_with_every_default(server):
    """Point 1: ``{}`` was falsy, so it took vLLM's branch: an abort pause, a legacy lease any resume ended."""
    held = call("POST", server + "/pause", json={})
    assert held.status_code == 200 and held.json()["mode"] == "keep", held.text
    assert call("POST", server + "/resume").json()["resumed"] == 0  # a body-less resume ends legacy pauses only
    assert paused(server)
    resume(server, held.json()["lease_id"])
    assert not paused(server)


def test_a_duplicate_request_id_is_a_409_and_the_first_answer_is_untouched(server):
    """Point 2: the duplicate's handler replaced the first request's, which then never got its answer."""
    held = lease(server)
    first, out = in_thread(completion, server, headers={"x-request-id": "twice"})
    try:
        wait_in_flight(server, 1)  # queued behind the pause
        duplicate = completion(server, headers={"x-request-id": "twice"})
        assert duplicate.status_code == 409 and "in flight" in duplicate.json()["detail"], duplicate.text
    finally:
        resume(server, held)
    first.join(timeout=HANG_S)
    assert not first.is_alive() and out["value"].status_code == 200, out
    assert out["value"].json()["choices"][0]["text"]


# ------------------------------------------------------------------------------------------- 3: the worker pool


def test_waiting_pauses_hold_no_worker_and_the_holder_resumes_at_once(server):
    """Point 3: 45 abort pauses waiting behind a keep lease held 40 worker threads; the holder's own resume then
    waited for its lease's expiry.  Now a waiting pause is an await: the resume answers, and the waiting ones get in."""
    held = lease(server)
    waiting = [in_thread(call, "POST", server + "/pause", json={"mode": "abort", "ttl": HANG_S, "holder": f"w{i}"})
               for i in range(45)]  # fmt: skip
    try:
        answer = call("POST", server + "/resume", json={"lease_id": held})
        assert answer.status_code == 200 and answer.json()["resumed"] is True, answer.text
    finally:
        for thread, out in waiting:
            thread.join(timeout=HANG_S)
            assert not thread.is_alive()
            if "value" in out and out["value"].status_code == 200:
                resume(server, out["value"].json()["lease_id"])
    assert all(out["value"].status_code == 200 for _, out in waiting), [out for _, out in waiting]
    assert not paused(server)


def test_leases_beyond_the_cap_are_a_429_and_nothing_is_held(server):
    taken = [lease(server, holder=f"h{i}") for i in range(48)]
    try:
        refused = call("POST", server + "/pause", json={"ttl": HANG_S})
        assert refused.status_code == 429 and refused.headers["retry-after"], refused.text
        assert call("GET", server + "/is_paused").json()["leases"] == 48
    finally:
        for lease_id in taken:
            resume(server, lease_id)
    assert not paused(server)


def test_a_client_that_leaves_while_its_pause_waits_leaves_no_lease(server):
    held = lease(server)
    with pytest.raises(httpx.ReadTimeout):  # an abort pause behind the keep lease; the client gives up
        call("POST", server + "/pause", json={"mode": "abort", "ttl": HANG_S, "holder": "leaver"}, timeout=1.0)
    resume(server, held)
    for _ in range(int(HANG_S * 10)):  # the withdrawn pause may open, then closes at once
        holders = call("GET", server + "/is_paused").json()["holders"]
        if "leaver" not in holders and not paused(server):
            break
        threading.Event().wait(0.1)  # the server is another process: nothing to wait on but its answers
    assert "leaver" not in call("GET", server + "/is_paused").json()["holders"]
    assert not paused(server)


# ------------------------------------------------------------------------------------------- 4, 5: files


def test_a_symlink_inside_a_directory_cannot_escape_the_weights_dir(server, weights_dir, tmp_path):
    """Point 4: only the top-level path was resolved; an outside file was loaded and the completions changed."""
    from safetensors.torch import save_file

    from cbpause.testing.llama import tiny_llama

    outside = tmp_path / "outside.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_llama(seed=99, vocab_size=VOCAB).state_dict().items()}, str(outside))
    sub = weights_dir / "linked"
    sub.mkdir()
    (sub / "model.safetensors").symlink_to(outside)
    before = completion(server).json()["choices"][0]["text"]
    held = lease(server)
    try:
        refused = call("POST", server + "/update_weights_from_disk", json={"lease_id": held, "path": "linked"})
        assert refused.status_code == 400 and "outside the weights directory" in refused.text, refused.text
    finally:
        resume(server, held)
    assert completion(server).json()["choices"][0]["text"] == before


def test_a_fifo_named_safetensors_is_refused_and_blocks_nothing(server, weights_dir):
    """Point 5: opening the FIFO froze the server until someone opened its other end."""
    fifo_dir = weights_dir / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "model.safetensors")
    held = lease(server)
    try:
        for path in ("fifo", "fifo/model.safetensors"):
            refused = call("POST", server + "/update_weights_from_disk", json={"lease_id": held, "path": path})
            assert refused.status_code == 400 and "not a regular file" in refused.text, refused.text
        assert call("GET", server + "/health").status_code == 200
    finally:
        resume(server, held)


# ------------------------------------------------------------------------------------------- 7: authentication


@pytest.mark.parametrize(("method", "route"), [
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/update_weight_version"),
    ("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/weight_info"),
])  # fmt: skip
def test_without_the_key_every_route_but_health_is_a_401_and_nothing_changes(server, method, route):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        answer = httpx.request(method, server + route, json={"mode": "abort", "ttl": 3600}, headers=headers,
                               timeout=HANG_S)  # fmt: skip
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", answer.text
    assert httpx.get(server + "/health", timeout=HANG_S).status_code == 200
    assert not paused(server)


# ------------------------------------------------------------------------------------------- 9: limits


@pytest.mark.parametrize("route", ["/pause", "/v1/completions", "/update_weight_version"])
def test_bad_json_and_big_bodies_are_4xx_never_500(server, route):
    cases = {
        "a 5,000-digit integer": (b'{"ttl": ' + b"1" * 5000 + b"}", 400),
        "nesting 100,000 deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 413),  # 200 kB: too big first
        "nesting 20,000 deep": (b'{"a": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400),
        "not an object": (b"[1, 2]", 400),
        "not JSON": (b"{not json", 400),
        "not UTF-8": (b'{"a": "\xff"}', 400),
        "a body over the limit": (b'{"a": "' + b"x" * 70_000 + b'"}', 413),
    }
    for what, (body, status) in cases.items():
        answer = call("POST", server + route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == status, (what, answer.status_code, answer.text[:300])
        assert message(answer), what
    assert not paused(server)


# ------------------------------------------------------------------------------------------- 10: OpenAI conventions


def test_models_lists_the_served_model_and_an_openai_client_uses_it(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=HANG_S)
    assert [m.id for m in client.models.list().data] == [NAME]
    answer = client.completions.create(model=NAME, prompt="t3 t4", max_tokens=3, temperature=0)
    assert answer.choices[0].text
    with pytest.raises(openai.BadRequestError, match="serves"):
        client.completions.create(model="some/other-model", prompt="t3 t4", max_tokens=3)


@pytest.mark.parametrize(("argument", "value"), [
    ("n", 5), ("best_of", 3), ("temperature", -1), ("temperature", 0.7), ("top_p", 7), ("max_tokens", "5"),
    ("max_tokens", 0), ("max_tokens", True), ("seed", 3), ("logprobs", 2), ("stop", ["t4"]), ("logit_bias", {"1": 5}),
])  # fmt: skip
def test_sampling_arguments_the_loop_cannot_honour_are_a_400_naming_them(server, argument, value):
    body = {"model": NAME, "prompt": "t3 t4", "max_tokens": 3, argument: value}
    answer = call("POST", server + "/v1/completions", json=body)
    assert answer.status_code == 400 and argument in message(answer), answer.text


def test_a_streamed_answer_carries_its_labels_in_its_last_chunk_and_is_counted(server):
    """Point 10: streamed answers carried no version labels and never appeared in /metrics."""
    def finished() -> float:
        metrics = call("GET", server + "/metrics").text
        return float(next(line.split()[-1] for line in metrics.splitlines()
                          if line.startswith('cbpause_requests{outcome="finished"}')))  # fmt: skip

    before = finished()
    body = {"model": NAME, "prompt": "t3 t4", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=HANG_S) as answer:
        assert answer.status_code == 200
        chunks = [json.loads(line[len("data: "):]) for line in answer.iter_lines() if line.startswith("data: ")]
    assert chunks and all("weight_versions" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] and last["weight_versions"][0][0] == 0, last
    assert "kv_versions" in last
    assert finished() == before + 1


def test_chat_on_a_checkpoint_without_a_chat_template_is_a_400(server):
    answer = call("POST", server + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": "t3 t4"}]})  # fmt: skip
    assert answer.status_code == 400 and "chat template" in message(answer), answer.text


# ------------------------------------------------------------------------------------------- 8: Fleet


def test_a_fleet_checks_its_arguments_before_any_server_is_asked():
    asked = []
    transport = httpx.MockTransport(lambda request: asked.append(request) or httpx.Response(500))
    with Fleet(["http://a", "http://b"], transport=transport) as fleet:
        for kwargs in ({"ttl": 0}, {"ttl": -1}, {"ttl": float("nan")}, {"timeout": -1}, {"timeout": "5"},
                       {"mode": "hard"}, {"ttl": True}):  # fmt: skip
            with pytest.raises(ValueError), fleet.pause(**kwargs):
                pytest.fail(f"paused with {kwargs}")
    assert asked == []
    with pytest.raises(ValueError):
        Fleet(["http://a"], request_timeout=0)
    assert CLIENT_MODES == MODES  # the client's copy of the server's modes


def test_a_server_answering_without_a_lease_id_fails_the_pause_and_the_others_are_resumed():
    """Point 8: a bare KeyError, and the other servers' leases held until their ttl."""
    resumed = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/resume":
            resumed.append((request.url.host, json.loads(request.content)["lease_id"]))
            return httpx.Response(200, json={"resumed": True})
        if request.url.host == "bad":
            return httpx.Response(200, json={"paused": True})
        return httpx.Response(200, json={"lease_id": f"lease-{request.url.host}"})

    with Fleet(["http://good", "http://bad"], transport=httpx.MockTransport(answer)) as fleet:
        with pytest.raises(FleetError) as caught, fleet.pause(ttl=5):
            pytest.fail("paused with a server that gave no lease id")
    assert list(caught.value.failed) == ["http://bad"] and "without a lease id" in str(caught.value)
    assert resumed == [("good", "lease-good")] and fleet.leases == {}


def test_a_fleet_pause_without_a_timeout_waits_and_holds(server):
    with Fleet([server], api_key=KEY, request_timeout=HANG_S) as fleet, fleet.pause(timeout=None, ttl=HANG_S):
        assert paused(server)
    assert not paused(server)


# ------------------------------------------------------------------------------------------- 6: stopping


def test_sigterm_with_a_lease_held_and_a_request_queued_answers_it_and_exits(checkpoint):
    """Point 6: the server waited for the lease's ttl (59 s of 60).  With a ttl of an hour, a server that waited for
    it would outlive the join below by far; the queued request must be answered (an error is an answer)."""
    with serve_process(checkpoint, "--num-blocks", "64") as (url, process):
        held = httpx.post(url + "/pause", json={"ttl": 3600}, timeout=HANG_S).json()["lease_id"]
        assert held
        queued, out = in_thread(httpx.post, url + "/v1/completions", json={"prompt": "t3 t4", "max_tokens": 3},
                                timeout=HANG_S)  # fmt: skip
        wait_in_flight(url, 1, headers={})
        process.send_signal(signal.SIGTERM)
        # uvicorn raises the signal again once it has shut down gracefully: the exit status is SIGTERM's
        assert process.wait(timeout=HANG_S) in (0, -signal.SIGTERM)
        queued.join(timeout=HANG_S)
        assert not queued.is_alive()
        assert "value" in out and out["value"].status_code in (200, 500, 503), out

