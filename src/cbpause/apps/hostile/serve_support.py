"""What the hostile cases of ``cbpause serve`` share (:mod:`.serve_cases`, :mod:`.serve_openai`): the guarded server
(an API key, a served name, 48 leases and 64 kB bodies at most), and the calls, checks and waits of a case."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .support import WAIT, Lost, Wrong

KEY = "hostile-key-39"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-served"
VOCAB = 32
MAX_LEASES = 48

__all__ = ["AUTH", "KEY", "MAX_LEASES", "NAME", "VOCAB", "Guarded", "call", "check", "completion", "group_body",
           "guarded_server", "in_thread", "joined", "joined_group", "lease", "message", "paused", "resume",
           "wait_in_flight"]  # fmt: skip


@dataclass
class Guarded:
    """A guarded server: its URL, the checkpoint it serves, its ``--weights-dir``, and a scratch folder."""

    url: str
    checkpoint: Path
    weights_dir: Path
    scratch: Path
    pid: int = 0  # the server's process


@contextlib.contextmanager
def guarded_server(checkpoint: Path, weights_dir: Path, scratch: Path) -> Iterator[Guarded]:
    """The server, its lease log in ``scratch/leases.jsonl`` (validated by :func:`lease_log_is_a_behaviour`)."""
    from ...testing.servers import serve_process

    with serve_process(checkpoint, "--weights-dir", str(weights_dir), "--default-ttl", str(WAIT), "--num-blocks",
                       "64", "--api-key", KEY, "--served-model-name", NAME, "--max-leases", str(MAX_LEASES),
                       "--max-body-bytes", "65536", "--lease-log", str(scratch / "leases.jsonl")) as (url, process):
        yield Guarded(url, checkpoint, weights_dir, scratch, process.pid)


def check(condition: object, message: str, kind: type[AssertionError] = Wrong) -> None:
    if not condition:
        raise kind(message)


def call(method: str, url: str, **kwargs: Any) -> Any:
    """A request with the key, bounded by ``WAIT``."""
    import httpx

    headers = {**AUTH, **kwargs.pop("headers", {})}
    return httpx.request(method, url, headers=headers, **{"timeout": WAIT, **kwargs})


def message(answer: Any) -> str:
    """The error message of an answer: the control routes' ``{"error": text}`` or OpenAI's ``{"error": {message}}``."""
    error = answer.json().get("error", answer.json().get("detail"))
    return error["message"] if isinstance(error, dict) else str(error)


def lease(url: str, **body: Any) -> str:
    answer = call("POST", url + "/pause", json={"ttl": WAIT, **body})
    check(answer.status_code == 200, f"a pause was refused: {answer.status_code} {answer.text[:200]}")
    return answer.json()["lease_id"]


def resume(url: str, lease_id: str) -> None:
    answer = call("POST", url + "/resume", json={"lease_id": lease_id})
    check(answer.status_code == 200 and answer.json()["resumed"] is True, f"a resume: {answer.text[:200]}")


def paused(url: str) -> bool:
    return call("GET", url + "/is_paused").json()["is_paused"]


def completion(url: str, **kwargs: Any) -> Any:
    return call("POST", url + "/v1/completions", json={"model": NAME, "prompt": "t3 t4", "max_tokens": 3}, **kwargs)


def wait_in_flight(url: str, n: int, headers: dict | None = None) -> None:
    """Until the server counts ``n`` generation requests in flight (another process: nothing to wait on but its
    answers); ``WAIT`` at most."""
    import httpx

    for _ in range(int(WAIT * 20)):
        metrics = httpx.get(url + "/metrics", headers=AUTH if headers is None else headers, timeout=WAIT).text
        if f"cbpause_requests_in_flight {float(n)}" in metrics.splitlines():
            return
        threading.Event().wait(0.05)
    raise Lost(f"{url} never had {n} requests in flight")


def in_thread(fn: Callable, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 -- reported to the case
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def joined(thread: threading.Thread, out: dict) -> Any:
    thread.join(timeout=WAIT)
    if thread.is_alive():
        raise Lost(f"a client got no answer within {WAIT} s")
    if "error" in out:
        raise Wrong(f"a client failed: {out['error']!r}")
    return out["value"]


def group_body(port: int, **body: Any) -> dict:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "hostile", "backend": "gloo", "timeout": WAIT, **body}  # fmt: skip


def joined_group(url: str, name: str, timeout: float = WAIT) -> Any:
    """A weight-update group of this process (rank 0) and the server (rank 1), both joined."""
    from ...client.weight_group import WeightGroup
    from ...testing.servers import free_port

    port = free_port()
    asked = in_thread(call, "POST", url + "/init_weights_update_group",
                      json=group_body(port, group_name=name, timeout=timeout))  # fmt: skip
    group = WeightGroup("127.0.0.1", port, 0, 2, group_name=name, timeout_s=timeout)
    answer = joined(*asked)
    check(answer.status_code == 200, f"joining group {name}: {answer.status_code} {answer.text[:200]}")
    return group
