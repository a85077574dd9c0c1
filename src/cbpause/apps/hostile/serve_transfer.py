"""The hostile user of weight transfer and of the fleet's client limits: what a hostile round of the weight routes
found besides the wire itself.  Cases of :data:`.serve_cases.CASES`, on the same guarded server."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from .serve_support import (
    KEY,
    NAME,
    Guarded,
    call,
    check,
    completion,
    in_thread,
    joined,
    joined_group,
    lease,
    message,
    resume,
)
from .support import WAIT, Lost, Silent, Wrong

__all__ = ["fleet_client_limits", "joins_and_receivers_end_when_asked", "senders_whose_bytes_are_not_their_manifest_s",
           "stalled_transfer_ends_when_asked", "torn_after_the_first_bucket", "values_no_answer_could_carry"]

STALL_TIMEOUT_S = 600  # the group's deadline in the stall case: far past the wait below, so only the ask can end it


def _stalled_update(url: str, name: str, held: str) -> tuple:
    """A transfer in cbpause's format that the trainer voted for and then never sent (it stalled): the route's
    answer, waited for in a thread, and the trainer's group."""
    info = call("GET", url + "/weight_info").json()
    tensor, spec = next(iter(info["parameters"].items()))
    group = joined_group(url, name, timeout=STALL_TIMEOUT_S)
    update = in_thread(call, "POST", url + "/update_weights_from_distributed",
                       json={"group_name": name, "names": [tensor], "dtypes": [spec["dtype"]],
                             "shapes": [spec["shape"]], "weight_version": "stalled", "lease_id": held,
                             "bucket_bytes": 1 << 20})  # fmt: skip
    check(group.vote(True), "the server voted no to a valid update")
    return update, group


def stalled_transfer_ends_when_asked(server: Guarded) -> None:
    """A transfer that stopped progressing held its route, its lease and the pause for the group's deadline (30 to
    600 s), whatever the trainer or the operator asked: ``/destroy_weights_update_group`` and SIGTERM both waited.
    Both end it now, at once: the group's deadline here is far past the wait for the answer."""
    import signal

    from ...testing.servers import serve_process

    before = call("GET", server.url + "/weight_info").json()["weight_version"]
    held = lease(server.url, holder="stalled")
    update, group = _stalled_update(server.url, "stalled", held)
    try:
        gone = call("POST", server.url + "/destroy_weights_update_group", json={"group_name": "stalled"})
        check(gone.status_code == 200 and gone.json()["destroyed"], f"destroy: {gone.status_code} {gone.text[:200]}")
        answer = joined(*update)
        check(answer.status_code == 502 and message(answer), f"the stalled transfer: {answer.status_code}", Silent)
    finally:
        group.destroy()
        resume(server.url, held)
    check(call("GET", server.url + "/weight_info").json()["weight_version"] == before, "a stalled transfer relabelled")
    with serve_process(server.checkpoint, "--num-blocks", "64") as (url, process):
        answer = call("POST", url + "/pause", json={"ttl": STALL_TIMEOUT_S}, headers={})
        update, group = _stalled_update(url, "stalled", answer.json()["lease_id"])
        try:
            process.send_signal(signal.SIGTERM)
            check(process.wait(timeout=WAIT) in (0, -signal.SIGTERM), f"SIGTERM: exit {process.returncode}", Silent)
            check(joined(*update).status_code in (502, 503), "the stalled transfer was not answered", Lost)
        finally:
            group.destroy()


def senders_whose_bytes_are_not_their_manifest_s(server: Guarded) -> None:
    """A broadcast that sent fewer bytes than its manifest (half a tensor's rows, bfloat16 for a float32 entry) was
    committed and served as the new policy; one that sent more ended the server (gloo's length check terminates the
    process that receives).  Each is refused before anything is copied, the server stays up with the weights and the
    label it had, and the trainer can join a new group at once."""
    import torch

    from ...client import buckets

    info = call("GET", server.url + "/weight_info").json()
    before, text = info["weight_version"], completion(server.url).json()["choices"][0]["text"]
    name, spec = next((n, s) for n, s in info["parameters"].items() if s["dtype"] == "float32" and len(s["shape"]) == 2)
    shape, dtype = tuple(spec["shape"]), torch.float32
    whole = torch.randn(shape)
    bucket = buckets.layout([(name, shape, dtype)], 1 << 20)[0]
    packed = buckets.pack(bucket, [whole])
    senders = {
        "half the rows": lambda group: (group.broadcast(torch.tensor(buckets.header(bucket, packed))),
                                        group.broadcast(packed[: bucket.nbytes // 2])),
        "bfloat16 for float32": lambda group: (group.broadcast(torch.tensor(buckets.header(bucket, packed))),
                                               group.broadcast(whole.bfloat16().reshape(-1).view(torch.uint8))),
        "twice the bytes": lambda group: (group.broadcast(torch.tensor(buckets.header(bucket, packed))),
                                          group.broadcast(torch.cat([packed, packed]))),
        "a header too long": lambda group: group.broadcast(torch.zeros(64, dtype=torch.int64)),
        "a stock tensor, more bytes than its manifest": lambda group: group.broadcast(torch.randn(shape[0] * 2,
                                                                                                  shape[1])),
        "a stock tensor, half its rows": lambda group: group.broadcast(torch.randn(shape[0] // 2, shape[1])),
        "a stock tensor, bfloat16 for float32": lambda group: group.broadcast(whole.bfloat16()),
    }  # fmt: skip
    for what, send in senders.items():
        group = joined_group(server.url, "liar", timeout=5)
        held = lease(server.url, holder="liar")
        try:
            stock = what.startswith("a stock")
            body = {"group_name": "liar", "names": [name], "dtypes": ["float32"], "shapes": [list(shape)],
                    "weight_version": "mixed", "lease_id": held, **({} if stock else {"bucket_bytes": 1 << 20})}
            update = in_thread(call, "POST", server.url + "/update_weights_from_distributed", json=body)
            try:  # (a stock trainer casts no vote)
                check(stock or group.vote(True), f"{what}: the server voted no to a valid manifest")
                send(group)
                check(stock or not group.vote(True), f"{what}: the server voted yes to what it received")
            except RuntimeError:
                pass  # the server left the group: the trainer's collectives fail, as they should
            answer = joined(*update)
            check(400 <= answer.status_code < 600 and answer.status_code != 500 and message(answer),
                  f"{what}: {answer.status_code} {answer.text[:300]}")  # fmt: skip
        finally:
            group.destroy()
            resume(server.url, held)
            call("POST", server.url + "/destroy_weights_update_group", json={"group_name": "liar"})
        check(call("GET", server.url + "/health").status_code == 200, f"{what}: the server is gone", Silent)
        after = call("GET", server.url + "/weight_info").json()["weight_version"]
        check(after == before, f"{what}: the weights were relabelled {after!r}")
        check(completion(server.url).json()["choices"][0]["text"] == text, f"{what}: the weights changed", Wrong)


def torn_after_the_first_bucket(server: Guarded) -> None:
    """Bounded staging copies each bucket as it arrives: a sender whose second bucket is short leaves the weights
    torn (R-TORN-HOLD).  The server must then label them partial, refuse every generation request with a 503 and say
    it is torn, and no lease's end may mend it; a complete update does, and the server serves again."""
    import torch

    from ...client import buckets

    info = call("GET", server.url + "/weight_info").json()
    found = [(n, s) for n, s in info["parameters"].items() if s["dtype"] == "float32" and len(s["shape"]) == 2][:2]
    manifest = [(n, tuple(s["shape"]), torch.float32) for n, s in found]
    size = buckets.aligned(buckets.tensor_bytes(manifest[0][1], torch.float32))
    size = max(size, buckets.aligned(buckets.tensor_bytes(manifest[1][1], torch.float32)), buckets.MIN_BUCKET_BYTES)
    layout = buckets.layout(manifest, size)
    check(len(layout) == 2, f"the case needs two buckets, not {len(layout)}")
    tensors = [torch.randn(shape) for _, shape, _ in manifest]
    body = {"group_name": "tearer", "names": [n for n, _, _ in manifest], "dtypes": ["float32"] * 2,
            "shapes": [list(shape) for _, shape, _ in manifest], "bucket_bytes": size}  # fmt: skip

    def send(version: str, short: bool, queued: dict | None = None) -> Any:
        group = joined_group(server.url, "tearer", timeout=5)
        held = lease(server.url, holder="tearer")
        if queued is not None:  # a pause that waits, queued at a window that is closing, when the weights tear
            other = lease(server.url, holder="leaver")
            resume(server.url, other)  # the window is closing now: a newcomer is queued until it closes
            queued["pause"] = in_thread(call, "POST", server.url + "/pause", json={"holder": "queued", "ttl": WAIT})
        try:
            update = in_thread(call, "POST", server.url + "/update_weights_from_distributed",
                               json={**body, "weight_version": version, "lease_id": held})  # fmt: skip
            try:
                check(group.vote(True), "the server voted no to a valid manifest")
                for i, bucket in enumerate(layout):
                    packed = buckets.pack(bucket, [tensors[i]])
                    group.broadcast(torch.tensor(buckets.header(bucket, packed)))
                    group.broadcast(packed[: bucket.nbytes // 2] if short and i == 1 else packed)
                group.vote(True)
            except RuntimeError:
                pass  # the server left the group: the trainer's collectives fail, as they should
            return joined(*update)
        finally:
            group.destroy()
            resume(server.url, held)
            call("POST", server.url + "/destroy_weights_update_group", json={"group_name": "tearer"})

    queued: dict = {}
    answer = send("torn", short=True, queued=queued)
    check(answer.status_code == 502 and "torn" in message(answer), f"{answer.status_code} {answer.text[:300]}")
    waited = joined(*queued["pause"])  # the keeper's window never closes: the queued pause is held beside it
    check(waited.status_code == 200, f"a pause queued when the weights tore: {waited.status_code} {waited.text[:200]}")
    resume(server.url, waited.json()["lease_id"])
    health = call("GET", server.url + "/health").json()
    check(health.get("torn") is True, f"a torn server's health says {health}")
    label = call("GET", server.url + "/weight_info").json()["weight_version"]
    check(label == "PartialSync(sync='torn')", f"torn weights labelled {label!r}", Wrong)
    refused = completion(server.url)
    check(refused.status_code == 503 and "torn" in refused.text, f"a torn server answered a completion "
          f"{refused.status_code} {refused.text[:200]}", Wrong)  # fmt: skip
    refused = call("POST", server.url + "/v1/responses", json={"model": NAME, "input": "t3 t4", "max_output_tokens": 2})
    check(refused.status_code == 503 and "torn" in refused.text, f"a torn server answered /v1/responses "
          f"{refused.status_code} {refused.text[:200]}", Wrong)  # fmt: skip
    held = lease(server.url, holder="labeller")
    try:  # a label alone would leave the mix in place under a clean version
        labelled = call("POST", server.url + "/update_weight_version", json={"lease_id": held, "weight_version": "x"})
        check(labelled.status_code == 409 and "torn" in message(labelled), f"a label alone on torn weights: "
              f"{labelled.status_code} {labelled.text[:200]}", Wrong)  # fmt: skip
    finally:
        resume(server.url, held)
    answer = send("mended", short=False)
    check(answer.status_code == 200, f"a complete update to a torn server: {answer.status_code} {answer.text[:300]}")
    check(call("GET", server.url + "/health").json().get("torn") is False, "a mended server still says it is torn")
    check(completion(server.url).status_code == 200, "a mended server refuses completions", Silent)


def values_no_answer_could_carry(server: Guarded) -> None:
    """A lone surrogate as a lease holder's name or a weight version was taken, and every answer that named it was a
    400 from then on (``/is_paused``, ``/weight_info``, every completion); an integer version past 64 bits ended
    ``/metrics``.  Each is a 400 before anything is set, and the server answers on."""
    before = call("GET", server.url + "/weight_info").json()["weight_version"]
    raw = {"content-type": "application/json"}
    answer = call("POST", server.url + "/pause", content=b'{"holder": "\\ud800x", "ttl": 5}', headers=raw)
    check(answer.status_code == 400 and "holder" in message(answer), f"a surrogate holder: {answer.status_code}")
    held = lease(server.url)
    try:
        for version, named in ((b'"\\udc00v"', "weight_version"), (str(2**64).encode(), "64 bits"),
                               (b'"' + b"v" * 300 + b'"', "256")):  # fmt: skip
            body = b'{"lease_id": "' + held.encode() + b'", "weight_version": ' + version + b"}"
            answer = call("POST", server.url + "/update_weight_version", content=body, headers=raw)
            check(answer.status_code == 400 and named in message(answer),
                  f"version {version[:20]!r}: {answer.status_code} {answer.text[:200]}")  # fmt: skip
        answer = call("POST", server.url + "/init_weights_update_group", content=b'{"group_name": "\\udfff", '
                      b'"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}',
                      headers=raw)  # fmt: skip
        check(answer.status_code == 400, f"a surrogate group name: {answer.status_code}")
    finally:
        resume(server.url, held)
    for route in ("/is_paused", "/weight_info", "/metrics", "/v1/models"):
        answer = call("GET", server.url + route)
        check(answer.status_code == 200, f"{route} after the refusals: {answer.status_code} {answer.text[:200]}",
              Silent)  # fmt: skip
    check(call("GET", server.url + "/weight_info").json()["weight_version"] == before, "a refused version was set")


def fleet_client_limits(server: Guarded) -> None:
    """``Fleet.pause(ttl=1e-6)`` renewed in a busy loop; ``Fleet.pause(timeout=None)`` against a server that accepts
    connections and never answers waited for ever; two ``FleetEngine`` s on one server sent the same request ids."""
    import httpx

    from ...client import MIN_RENEW_S, Fleet, FleetError
    from ...integrations.trl_fleet import FleetEngine

    renewals: list[float] = []
    enough = threading.Event()

    def fake(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/renew"):
            renewals.append(time.monotonic())
            if len(renewals) >= 6:
                enough.set()
        return httpx.Response(200, json={"lease_id": "fake", "resumed": True})

    fleet = Fleet(["http://fake"], transport=httpx.MockTransport(fake))
    with fleet.pause(ttl=1e-6):
        check(enough.wait(WAIT), "the renewals stopped", Silent)
    spans = [b - a for a, b in zip(renewals, renewals[1:], strict=False)]
    check(min(spans[:5]) >= MIN_RENEW_S * 0.9, f"renewals {spans[:5]} s apart: faster than one per {MIN_RENEW_S} s")

    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        outcome: dict = {}

        def pause_for_ever() -> None:
            try:
                with Fleet([url], request_timeout=0.5).pause(timeout=None):
                    outcome["entered"] = True
            except FleetError as error:
                outcome["error"] = error

        thread = threading.Thread(target=pause_for_ever, daemon=True)
        thread.start()
        thread.join(WAIT)
        check(not thread.is_alive(), "Fleet.pause(timeout=None) waits for ever on a server that never answers", Silent)
        check("/health" in str(outcome.get("error")), f"a silent server: {outcome}")

    engines = [FleetEngine([server.url], api_key=KEY) for _ in range(2)]
    try:
        ids = [engine.add_request([3, 4], 2) for engine in engines for _ in range(3)]
        check(len(set(ids)) == len(ids), f"two engines on one server sent the same request ids: {ids}")
        answers = [engine.get_result(timeout=WAIT) for engine in engines for _ in range(3)]
        failed = [a.error for a in answers if a is None or a.error is not None]
        check(not failed, f"requests of two engines on one server failed: {failed[:2]}", Wrong)
    finally:
        for engine in engines:
            engine.close()


def _receivers(pid: int) -> list[int]:
    """The receiving processes of the server process ``pid``."""
    from ...testing.servers import child_processes

    return child_processes(pid, b"cbpause.serve.receiver")


def joins_and_receivers_end_when_asked(server: Guarded) -> None:
    """What a hostile review found of the receiving processes: a destroy during a join was ignored (the join then
    registered its group), a join past its timeout left its process alive for two minutes (sixteen of them locked out
    every join), and a receiving process that died between two updates made every later update a bare 500.  A destroy
    now ends a join under way, a join past its timeout kills its process, and an update on a group whose process died
    is a 502 that drops the group."""
    import os
    import signal

    from .serve_support import group_body

    def until(condition: Any, what: str) -> None:
        for _ in range(int(WAIT * 10)):
            if condition():
                return
            threading.Event().wait(0.1)
        raise Silent(what)

    before = set(_receivers(server.pid))
    with socket.socket() as silent:  # a master that accepts and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        asked = in_thread(call, "POST", server.url + "/init_weights_update_group",
                          json=group_body(port, group_name="cancelled", timeout=600))  # fmt: skip
        until(lambda: set(_receivers(server.pid)) - before, "no receiving process started for the join")
        gone = call("POST", server.url + "/destroy_weights_update_group", json={"group_name": "cancelled"})
        check(gone.json() == {"destroyed": True}, f"a destroy during a join: {gone.text[:200]}")
        answer = joined(*asked)
        check(answer.status_code != 200, f"a destroyed join was answered {answer.status_code}: {answer.text[:200]}")
        none = call("POST", server.url + "/update_weights_from_distributed", json={"group_name": "cancelled"})
        check(none.status_code == 404, f"a destroyed join left its group: {none.status_code}")
        late = call("POST", server.url + "/init_weights_update_group",
                    json=group_body(port, group_name="late", timeout=1))  # fmt: skip
        check(late.status_code == 504, f"a join nobody completes: {late.status_code} {late.text[:200]}")
    until(lambda: set(_receivers(server.pid)) <= before, "receiving processes outlived their joins")

    group = joined_group(server.url, "orphaned", timeout=5)
    held = lease(server.url, holder="orphaned")
    try:
        for pid in _receivers(server.pid):
            os.kill(pid, signal.SIGKILL)  # (the kernel's OOM killer, say)
        info = call("GET", server.url + "/weight_info").json()
        tensor, spec = next(iter(info["parameters"].items()))
        answer = call("POST", server.url + "/update_weights_from_distributed",
                      json={"group_name": "orphaned", "names": [tensor], "dtypes": [spec["dtype"]],
                            "shapes": [spec["shape"]], "lease_id": held})  # fmt: skip
        check(answer.status_code == 502 and message(answer), f"an update after its process died: "
              f"{answer.status_code} {answer.text[:200]}")  # fmt: skip
        again = call("POST", server.url + "/update_weights_from_distributed", json={"group_name": "orphaned"})
        check(again.status_code == 404, f"the group whose process died was kept: {again.status_code}")
    finally:
        group.destroy()
        resume(server.url, held)
