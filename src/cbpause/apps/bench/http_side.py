"""``python -m cbpause.apps.bench --http`` (``nox -s bench -- --http``): pause-entry latency over HTTP next to the
in-process one, on the same tiny checkpoint with the same traffic.

* **in-process**: ``manager.pause(mode="keep")`` on a :func:`init_continuous_batching` manager in this process,
  from the call to the entry into the window;
* **HTTP**: ``POST /pause`` to a ``cbpause serve`` process on localhost, from sending the request to reading the
  lease (the window is open then), as a trainer sees it; and ``POST /resume``.

Both while 4 client threads keep completions of 16 tokens in flight.  Writes ``http.json`` and ``http.md`` under
``--out``.  Needs the ``serve`` extra.
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


def main(out: Path, pauses: int) -> int:
    from ...testing.trl_cpu import save_tiny_policy

    with tempfile.TemporaryDirectory(prefix="cbpause-bench-http-") as tmp:
        checkpoint = save_tiny_policy(Path(tmp) / "ckpt", vocab_size=VOCAB)
        result = {"pauses": pauses, "clients": CLIENTS, "tokens": TOKENS,
                  "in_process": in_process(checkpoint, pauses), "http": over_http(checkpoint, pauses)}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "http.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = ["| pause | median ms | p90 ms | max ms |", "|---|---:|---:|---:|"]
    for name, f in (("in-process `manager.pause()` entry", result["in_process"]["entry"]),
                    ("HTTP `POST /pause` (lease in hand)", result["http"]["entry"]),
                    ("HTTP `POST /resume`", result["http"]["resume"])):  # fmt: skip
        rows.append(f"| {name} | {f['median_ms']} | {f['p90_ms']} | {f['max_ms']} |")
    (out / "http.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0
