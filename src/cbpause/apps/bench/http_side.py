"""``python -m cbpause.apps.bench --http`` (``nox -s bench -- --http``): pause-entry latency over HTTP next to the
in-process one, on the same tiny checkpoint with the same traffic.

* **in-process**: ``manager.pause(mode="keep")`` on a :func:`init_continuous_batching` manager in this process,
  from the call to the entry into the window;
* **HTTP**: ``POST /pause`` to a ``cbpause serve`` process on localhost, from sending the request to reading the
  lease (the window is open then), as a trainer sees it; and ``POST /resume``.

Both while 4 client threads keep completions of 16 tokens in flight.  Then the cost of per-request sampling
(R-SAMPLING): on one server, rounds of completions from ``CLIENTS * 2`` client threads, every request sampled with the
checkpoint's one configuration (``single``) or each with arguments of its own (``mixed``: its temperature, top-p,
top-k, min-p, repetition penalty, seed and top log-probabilities, as RL rollout clients send them), the two kinds of
round interleaved; tokens per second and each request's latency (p50, p99).  Writes ``http.json`` and ``http.md``
under ``--out``.  Needs the ``serve`` extra.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

CLIENTS = 4
TOKENS = 16
VOCAB = 32


def figures(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"n": len(ordered), "median_ms": round(1000 * statistics.median(ordered), 2),
            "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 2),
            "max_ms": round(1000 * ordered[-1], 2)}  # fmt: skip


def with_traffic(send: Callable[[], None], measure: Callable[[], dict]) -> dict:
    """``measure()`` while ``CLIENTS`` threads call ``send()`` in a loop."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            send()

    threads = [threading.Thread(target=loop, name=f"traffic-{i}") for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        return measure()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def in_process(checkpoint: Path, pauses: int) -> dict:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig

    from ...integrations.transformers import init_continuous_batching

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    manager = init_continuous_batching(model, model.generation_config, ContinuousBatchingConfig(num_blocks=128))
    manager.start()

    def send() -> None:
        rid = manager.add_request([3, 4, 5], max_new_tokens=TOKENS)
        manager.get_result(rid, timeout=60)

    def measure() -> dict:
        entries = []
        for _ in range(pauses):
            time.sleep(0.05)  # let the traffic refill the batch between pauses (a pacing, not a synchronisation)
            started = time.perf_counter()
            with manager.pause(mode="keep", timeout=60):
                entries.append(time.perf_counter() - started)
        return {"entry": figures(entries)}

    try:
        return with_traffic(send, measure)
    finally:
        manager.stop(block=True, timeout=60)


def over_http(checkpoint: Path, pauses: int) -> dict:
    import httpx

    from ...testing.servers import serve_process

    with serve_process(checkpoint, "--num-blocks", "128") as (url, _process):
        http = httpx.Client(timeout=60)

        def send() -> None:
            httpx.post(url + "/v1/completions", json={"prompt": "t3 t4 t5", "max_tokens": TOKENS}, timeout=60)

        def measure() -> dict:
            entries, resumes = [], []
            for _ in range(pauses):
                time.sleep(0.05)
                started = time.perf_counter()
                lease = http.post(url + "/pause", json={"mode": "keep", "timeout": 60, "ttl": 30}).json()["lease_id"]
                entries.append(time.perf_counter() - started)
                started = time.perf_counter()
                http.post(url + "/resume", json={"lease_id": lease}).raise_for_status()
                resumes.append(time.perf_counter() - started)
            return {"entry": figures(entries), "resume": figures(resumes)}

        try:
            return with_traffic(send, measure)
        finally:
            http.close()


SAMPLING_CLIENTS = 8


def mixed_body(i: int) -> dict:
    """The ``i``-th request of a mixed round: each with sampling of its own."""
    return {"prompt": [3 + i % 7, 4, 5], "max_tokens": TOKENS, "temperature": (0.0, 0.6, 1.0, 1.4)[i % 4],
            "top_p": (1.0, 0.9)[i % 2], "top_k": (0, 8, 3)[i % 3], "min_p": (0.0, 0.05)[(i // 2) % 2],
            "repetition_penalty": (1.0, 1.15)[(i // 3) % 2], "seed": i, "logprobs": i % 4,
            "return_token_ids": True}  # fmt: skip


def single_body(i: int) -> dict:
    """The ``i``-th request of a single-configuration round: the checkpoint's sampling."""
    return {"prompt": [3 + i % 7, 4, 5], "max_tokens": TOKENS}


def sampling_rounds(checkpoint: Path, rounds: int, requests: int) -> dict:
    """``rounds`` rounds of each kind (single, mixed, interleaved), ``requests`` completions a round from
    ``SAMPLING_CLIENTS`` threads: tokens per second over the round, and each request's latency."""
    import httpx
    from transformers import GenerationConfig

    from ...testing.servers import serve_process

    # A sampling checkpoint: both kinds of round sample.
    GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=TOKENS, eos_token_id=-1,
                     pad_token_id=0).save_pretrained(checkpoint)  # fmt: skip
    results: dict[str, dict[str, list]] = {"single": {"tok_s": [], "latency": []},
                                           "mixed": {"tok_s": [], "latency": []}}  # fmt: skip
    with serve_process(checkpoint, "--num-blocks", "256") as (url, _process):
        http = httpx.Client(timeout=120, limits=httpx.Limits(max_connections=SAMPLING_CLIENTS))

        def round_of(make: Callable[[int], dict]) -> tuple[float, list[float]]:
            latencies: list[float] = []
            tokens = [0]
            lock = threading.Lock()
            numbers = iter(range(requests))

            def client() -> None:
                while True:
                    with lock:
                        i = next(numbers, None)
                    if i is None:
                        return
                    started = time.perf_counter()
                    answer = http.post(url + "/v1/completions", json=make(i))
                    answer.raise_for_status()
                    with lock:
                        latencies.append(time.perf_counter() - started)
                        tokens[0] += answer.json()["usage"]["completion_tokens"]

            started = time.perf_counter()
            threads = [threading.Thread(target=client) for _ in range(SAMPLING_CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=600)
            return tokens[0] / (time.perf_counter() - started), latencies

        try:
            round_of(single_body)  # a warm-up round, not counted
            for _ in range(rounds):
                for kind, make in (("single", single_body), ("mixed", mixed_body)):
                    tok_s, latencies = round_of(make)
                    results[kind]["tok_s"].append(tok_s)
                    results[kind]["latency"] += latencies
        finally:
            http.close()
    out = {}
    for kind, r in results.items():
        ordered = sorted(r["latency"])
        out[kind] = {"rounds": rounds, "requests": len(ordered),
                     "tok_s_median": round(statistics.median(r["tok_s"]), 1),
                     "p50_ms": round(1000 * statistics.median(ordered), 2),
                     "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 2)}  # fmt: skip
    out["mixed_over_single_tok_s"] = round(out["mixed"]["tok_s_median"] / out["single"]["tok_s_median"], 3)
    return out


def main(out: Path, pauses: int, rounds: int = 5, requests: int = 64) -> int:
    from ...testing.trl_cpu import save_tiny_policy

    with tempfile.TemporaryDirectory(prefix="cbpause-bench-http-") as tmp:
        checkpoint = save_tiny_policy(Path(tmp) / "ckpt", vocab_size=VOCAB)
        result = {"pauses": pauses, "clients": CLIENTS, "tokens": TOKENS,
                  "in_process": in_process(checkpoint, pauses), "http": over_http(checkpoint, pauses),
                  "sampling": sampling_rounds(checkpoint, rounds, requests)}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "http.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = ["| pause | median ms | p90 ms | max ms |", "|---|---:|---:|---:|"]
    for name, f in (("in-process `manager.pause()` entry", result["in_process"]["entry"]),
                    ("HTTP `POST /pause` (lease in hand)", result["http"]["entry"]),
                    ("HTTP `POST /resume`", result["http"]["resume"])):  # fmt: skip
        rows.append(f"| {name} | {f['median_ms']} | {f['p90_ms']} | {f['max_ms']} |")
    rows += ["", "| completions | tokens/s, median of rounds | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    for kind in ("single", "mixed"):
        f = result["sampling"][kind]
        rows.append(f"| {kind} sampling ({f['requests']} requests) | {f['tok_s_median']} | {f['p50_ms']} | "
                    f"{f['p99_ms']} |")
    rows.append(f"\nmixed / single tokens per second: {result['sampling']['mixed_over_single_tok_s']}")
    (out / "http.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0
