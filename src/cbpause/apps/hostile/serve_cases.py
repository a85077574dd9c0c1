"""The hostile user of ``cbpause serve`` and ``Fleet`` (issue 39): each case of the issue's list, against a guarded
server process (an API key, a served name, 48 leases and 64 kB bodies at most).  One home for each case: the hostile
suite's probe ``serve_hostile_clients`` runs them all on one server, and ``tests/test_serve_hostile.py`` runs each as a
test.  A case returns when the server did the right thing, and raises :class:`~.support.Wrong`,
:class:`~.support.Silent` or :class:`~.support.Lost` otherwise.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .serve_openai import openai_conventions, rollout_clients_misuse
from .serve_support import (
    KEY,
    MAX_LEASES,
    VOCAB,
    Guarded,
    call,
    check,
    completion,
    group_body,
    guarded_server,
    in_thread,
    joined,
    joined_group,
    lease,
    message,
    paused,
    resume,
    wait_in_flight,
)
from .serve_transfer import (
    fleet_client_limits,
    joins_and_receivers_end_when_asked,
    senders_whose_bytes_are_not_their_manifest_s,
    stalled_transfer_ends_when_asked,
    torn_after_the_first_bucket,
    values_no_answer_could_carry,
)
from .support import WAIT, Lost, Silent, Wrong

__all__ = ["CASES", "Guarded", "VOCAB", "guarded_server", "serve_hostile_clients"]


# ------------------------------------------------------------------------------------------- 1, 2: bodies and ids


def empty_object_is_a_keep_pause(server: Guarded) -> None:
    """Point 1: ``{}`` was falsy, so it took vLLM's branch: an abort pause, a legacy lease any resume ended."""
    held = call("POST", server.url + "/pause", json={})
    check(held.status_code == 200 and held.json()["mode"] == "keep", f"{{}} gave {held.text[:200]}", Silent)
    check(call("POST", server.url + "/resume").json()["resumed"] == 0, "a body-less resume ended a keyed lease", Silent)
    check(paused(server.url), "the lease was ended by a body-less resume", Silent)
    resume(server.url, held.json()["lease_id"])
    check(not paused(server.url), "still paused after its resume")


def duplicate_request_id(server: Guarded) -> None:
    """Point 2: the duplicate's handler replaced the first request's, which then never got its answer."""
    held = lease(server.url)
    first = in_thread(completion, server.url, headers={"x-request-id": "twice"})
    try:
        wait_in_flight(server.url, 1)  # queued behind the pause
        duplicate = completion(server.url, headers={"x-request-id": "twice"})
        check(duplicate.status_code == 409 and "in flight" in duplicate.json()["error"]["message"],
              f"duplicate (an OpenAI-shaped 409): {duplicate.text[:200]}")  # fmt: skip
    finally:
        resume(server.url, held)
    answer = joined(*first)
    check(answer.status_code == 200 and answer.json()["choices"][0]["text"], f"the first: {answer.text[:200]}", Lost)


# ------------------------------------------------------------------------------------------- 3, 9: what it holds


def waiting_pauses_hold_no_worker(server: Guarded) -> None:
    """Point 3: 45 abort pauses waiting behind a keep lease held 40 worker threads; the holder's own resume waited
    for its lease's expiry.  A waiting pause is an await now: the resume answers, and the waiting ones get in."""
    held = lease(server.url)
    waiting = [in_thread(call, "POST", server.url + "/pause", json={"mode": "abort", "ttl": WAIT, "holder": f"w{i}"})
               for i in range(45)]  # fmt: skip
    try:
        answer = call("POST", server.url + "/resume", json={"lease_id": held})
        check(answer.status_code == 200 and answer.json()["resumed"] is True, f"the resume: {answer.text[:200]}")
    finally:
        answers = [joined(*w) for w in waiting]
        for a in answers:
            if a.status_code == 200:
                resume(server.url, a.json()["lease_id"])
    check(all(a.status_code == 200 for a in answers), f"waiting pauses: {[a.status_code for a in answers]}")
    check(not paused(server.url), "still paused")


def lease_cap(server: Guarded) -> None:
    """Point 9: 1,000 leases were granted (1,043 threads, 1.2 GB)."""
    taken = [lease(server.url, holder=f"h{i}") for i in range(MAX_LEASES)]
    try:
        refused = call("POST", server.url + "/pause", json={"ttl": WAIT})
        check(refused.status_code == 429 and refused.headers.get("retry-after"), f"past the cap: {refused.text[:200]}")
        check(call("GET", server.url + "/is_paused").json()["leases"] == MAX_LEASES, "a lease past the cap", Silent)
    finally:
        for lease_id in taken:
            resume(server.url, lease_id)
    check(not paused(server.url), "still paused")


def leaver_leaves_no_lease(server: Guarded) -> None:
    """A client that disconnects while its pause waits: nobody knows the lease's id, so it must not hold (on
    transformers 5.25, whose app cancels the route of a client that left, the pause held until its ttl: issue 41)."""
    import httpx

    held = lease(server.url)
    try:  # its ttl outlasts the wait below: a pause that expires instead of being withdrawn fails the case
        call("POST", server.url + "/pause", json={"mode": "abort", "ttl": 3 * WAIT, "holder": "leaver"}, timeout=1.0)
        raise Wrong("an abort pause behind a keep lease answered at once")
    except httpx.ReadTimeout:
        pass  # the client gives up and disconnects
    resume(server.url, held)
    for _ in range(int(WAIT * 10)):  # the withdrawn pause may open, then closes at once
        if "leaver" not in call("GET", server.url + "/is_paused").json()["holders"] and not paused(server.url):
            return
        threading.Event().wait(0.1)  # another process: nothing to wait on but its answers
    raise Silent("the pause of a client that left is still held")


def bad_bodies(server: Guarded) -> None:
    """Point 9: a 64 MB body was read whole; a 5,000-digit integer or deep nesting was a 500 with a traceback."""
    cases = {
        "a 5,000-digit integer": (b'{"ttl": ' + b"1" * 5000 + b"}", 400),
        "nesting 100,000 deep": (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 413),  # 200 kB: too big first
        "nesting 20,000 deep": (b'{"a": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400),
        "not an object": (b"[1, 2]", 400),
        "not JSON": (b"{not json", 400),
        "not UTF-8": (b'{"a": "\xff"}', 400),
        "a body over the limit": (b'{"a": "' + b"x" * 70_000 + b'"}', 413),
    }
    for route in ("/pause", "/v1/completions", "/update_weight_version"):
        for what, (body, status) in cases.items():
            answer = call("POST", server.url + route, content=body, headers={"content-type": "application/json"})
            check(answer.status_code == status and message(answer), f"{route}, {what}: {answer.status_code}")
    # Found by review: a body that is JSON but not an object, sent as another content type; an unhashable mode.
    for route in ("/v1/completions", "/v1/chat/completions", "/pause"):
        for body, kind in ((b"[1]", "text/plain"), (b'"x"', "text/plain"), (b"null ", "application/x-www-form")):
            answer = call("POST", server.url + route, content=body, headers={"content-type": kind})
            check(400 <= answer.status_code < 500, f"{route}, {body!r} as {kind}: {answer.status_code}")
    for mode in ([], {}, 3):
        answer = call("POST", server.url + "/pause_generation", json={"mode": mode})
        check(answer.status_code == 400, f"/pause_generation with mode {mode!r}: {answer.status_code}")
    check(not paused(server.url), "a bad body paused the server", Silent)


# ------------------------------------------------------------------------------------------- 4, 5: files


def symlink_out_of_the_weights_dir(server: Guarded) -> None:
    """Point 4: only the top-level path was resolved; an outside file was loaded and the completions changed."""
    from safetensors.torch import save_file

    from ...testing.llama import tiny_llama

    outside = server.scratch / "outside.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_llama(seed=99, vocab_size=VOCAB).state_dict().items()}, str(outside))
    linked = server.weights_dir / "linked"
    linked.mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (linked / "model.safetensors").symlink_to(outside)
    loop = server.weights_dir / "loop1.safetensors"  # found by review: a loop of links, a name too long (a 500)
    with contextlib.suppress(FileExistsError):
        loop.symlink_to("loop2.safetensors")
        (server.weights_dir / "loop2.safetensors").symlink_to("loop1.safetensors")
    before = completion(server.url).json()["choices"][0]["text"]
    held = lease(server.url)
    try:
        refused = call("POST", server.url + "/update_weights_from_disk", json={"lease_id": held, "path": "linked"})
        check(refused.status_code == 400 and "outside the weights directory" in refused.text, refused.text[:200])
        for path in ("loop1.safetensors", "a" * 5000, "x/" * 3000 + "y"):
            answer = call("POST", server.url + "/update_weights_from_disk", json={"lease_id": held, "path": path})
            check(answer.status_code == 400, f"path {path[:20]!r}...: {answer.status_code} {answer.text[:200]}")
    finally:
        resume(server.url, held)
    check(completion(server.url).json()["choices"][0]["text"] == before, "the weights changed", Silent)


def fifo_named_safetensors(server: Guarded) -> None:
    """Point 5: opening the FIFO froze the server until someone opened its other end."""
    fifo = server.weights_dir / "fifo"
    fifo.mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkfifo(fifo / "model.safetensors")
    held = lease(server.url)
    try:
        for path in ("fifo", "fifo/model.safetensors"):
            refused = call("POST", server.url + "/update_weights_from_disk", json={"lease_id": held, "path": path})
            check(refused.status_code == 400 and "not a regular file" in refused.text, refused.text[:200])
        check(call("GET", server.url + "/health").status_code == 200, "unhealthy")
    finally:
        resume(server.url, held)


# ------------------------------------------------------------------------------------------- 7: authentication


def strangers_are_refused(server: Guarded) -> None:
    """Point 7: anyone who reached the port could pause in abort mode for an hour, load weights, read holders."""
    import httpx

    routes = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/update_weight_version"),
              ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/metrics"), ("GET", "/weight_info"), ("GET", "/server_info"), ("GET", "/get_world_size")]
    for method, route in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            answer = httpx.request(method, server.url + route, json={"mode": "abort", "ttl": 3600}, headers=headers,
                                   timeout=WAIT)  # fmt: skip
            check(answer.status_code == 401 and answer.headers.get("www-authenticate") == "Bearer",
                  f"{method} {route} with {headers}: {answer.status_code}")  # fmt: skip
    check(httpx.get(server.url + "/health", timeout=WAIT).status_code == 200, "/health needs no key")
    check(httpx.head(server.url + "/health", timeout=WAIT).status_code == 200, "HEAD /health (a probe's) refused")
    check(not paused(server.url), "a stranger paused the server", Silent)


# ------------------------------------------------------------------------------------------- 8: Fleet


def fleet_checks_and_releases(server: Guarded) -> None:
    """Point 8: a 200 without lease_id was a bare KeyError, the other leases left held; timeout=None a TypeError;
    ttl <= 0 renewed in a tight loop."""
    import httpx

    from ...client import Fleet, FleetError

    asked: list = []
    transport = httpx.MockTransport(lambda request: asked.append(request) or httpx.Response(500))
    with Fleet(["http://a", "http://b"], transport=transport) as fleet:
        for kwargs in ({"ttl": 0}, {"ttl": -1}, {"ttl": float("nan")}, {"timeout": -1}, {"timeout": "5"},
                       {"mode": "hard"}, {"ttl": True}):  # fmt: skip
            try:
                with fleet.pause(**kwargs):
                    raise Silent(f"paused with {kwargs}")
            except ValueError:
                pass
    check(asked == [], f"a server was asked before the arguments were checked: {asked}")
    resumed: list = []

    def answer(request: Any) -> Any:
        if request.url.path == "/resume":
            resumed.append((request.url.host, json.loads(request.content)["lease_id"]))
            return httpx.Response(200, json={"resumed": True})
        if request.url.host == "bad":
            return httpx.Response(200, json={"paused": True})
        return httpx.Response(200, json={"lease_id": f"lease-{request.url.host}"})

    with Fleet(["http://good", "http://bad"], transport=httpx.MockTransport(answer)) as fleet:
        try:
            with fleet.pause(ttl=5):
                raise Silent("paused with a server that gave no lease id")
        except FleetError as error:
            check(list(error.failed) == ["http://bad"] and "without a lease id" in str(error), str(error))
    check(resumed == [("good", "lease-good")] and fleet.leases == {}, f"left held: {resumed}", Lost)
    with Fleet([server.url], api_key=KEY, request_timeout=WAIT) as fleet, fleet.pause(timeout=None, ttl=WAIT):
        check(paused(server.url), "a fleet pause without a timeout did not hold")
    check(not paused(server.url), "still paused after the fleet's pause")
    fleet_interrupted_while_its_pause_waits(server)


def fleet_interrupted_while_its_pause_waits(server: Guarded) -> None:
    """Found by review: Ctrl-C while ``Fleet.pause()`` waited for a window waited for the pause's answer, then dropped
    the lease it brought back, which held the server until its ttl.  Now the interrupt comes at once, and the lease
    that comes later is resumed by the thread that got it.  (Ctrl-C is a real SIGINT to this process, whose main
    thread runs the case; the kernel may hand it to any of the process's threads, as it does a terminal's.)"""
    from ...client import Fleet

    if threading.current_thread() is not threading.main_thread():
        return
    held = lease(server.url)  # a keep lease: the fleet's abort pause waits behind it
    timer = threading.Timer(1.0, os.kill, args=(os.getpid(), signal.SIGINT))
    try:
        with Fleet([server.url], api_key=KEY, holder="ctrlc", request_timeout=WAIT) as fleet:
            timer.start()
            try:
                with fleet.pause(mode="abort", timeout=None, ttl=WAIT):
                    raise Silent("the fleet paused behind a keep lease")
            except KeyboardInterrupt:
                pass
            check(fleet.leases == {}, f"the fleet kept {fleet.leases}")
    finally:
        timer.cancel()
        resume(server.url, held)
    for _ in range(int(WAIT * 10)):
        if "ctrlc" not in call("GET", server.url + "/is_paused").json()["holders"] and not paused(server.url):
            return
        threading.Event().wait(0.1)  # another process: nothing to wait on but its answers
    raise Lost("the lease of an interrupted fleet pause is still held")


# ------------------------------------------------------------------------------------------- 6: stopping


def second_trainer_is_fenced(server: Guarded) -> None:
    """Point 13: trainer a wrote under its lease and may have been told its update is complete; trainer b, whose lease
    was entered later, wrote over it under a's pause (the write-order rule let the later lease in).  Now b is refused
    (409, the fence) while a holds its lease, a's version stands, and b's write is taken once a has resumed."""
    a, b = lease(server.url, holder="trainer-a"), lease(server.url, holder="trainer-b")
    try:
        wrote = call("POST", server.url + "/update_weight_version", json={"lease_id": a, "weight_version": "a-39"})
        check(wrote.status_code == 200, f"trainer a's write: {wrote.status_code} {wrote.text[:200]}")
        fenced = call("POST", server.url + "/update_weight_version", json={"lease_id": b, "weight_version": "b-39"})
        check(fenced.status_code == 409 and "still held" in message(fenced),
              f"trainer b's write under trainer a's pause got {fenced.status_code} {fenced.text[:200]}")  # fmt: skip
        version = call("GET", server.url + "/weight_info").json()["weight_version"]
        check(version == "a-39", f"trainer a's update was overwritten while it held its lease: {version!r}")
        resume(server.url, a)
        taken = call("POST", server.url + "/update_weight_version", json={"lease_id": b, "weight_version": "b-39"})
        check(taken.status_code == 200, f"trainer b's write once a resumed: {taken.status_code} {taken.text[:200]}")
    finally:
        for lease_id in (a, b):
            call("POST", server.url + "/resume", json={"lease_id": lease_id})


def sigterm_answers_and_exits(server: Guarded) -> None:
    """Point 6: on SIGTERM with a lease held and a request queued the server waited for the lease's ttl.  With a ttl
    of an hour, a server that waited for it would outlive the wait below by far; the queued request must be answered
    (an error is an answer).  A server of its own (it is stopped)."""
    import httpx

    from ...testing.servers import serve_process

    with serve_process(server.checkpoint, "--num-blocks", "64") as (url, process):
        check(httpx.post(url + "/pause", json={"ttl": 3600}, timeout=WAIT).status_code == 200, "no lease")
        queued = in_thread(httpx.post, url + "/v1/completions", json={"prompt": "t3 t4", "max_tokens": 3},
                           timeout=WAIT)  # fmt: skip
        wait_in_flight(url, 1, headers={})
        process.send_signal(signal.SIGTERM)
        # uvicorn raises the signal again once it has shut down gracefully: the exit status is SIGTERM's
        check(process.wait(timeout=WAIT) in (0, -signal.SIGTERM), f"the server exited with {process.returncode}")
        answer = joined(*queued)
        check(answer.status_code in (200, 500, 503), f"the queued request got {answer.status_code}", Lost)


# ------------------------------------------------------------------------------------------- issue 42: weight groups


def weight_groups_refuse_bad_input_and_are_capped(server: Guarded) -> None:
    """Issue 42: every bad field of a join is a 400 naming it; a join nobody completes is a 504 once its timeout
    passed; a fifth group is a 429 (each holds sockets to every member); an update on no group is a 404."""
    from ...testing.servers import free_port

    port = free_port()
    for bad in ({"master_port": 0}, {"master_port": "80"}, {"rank_offset": 0}, {"rank_offset": 2},
                {"world_size": 10**6}, {"rank_offset": True}, {"backend": "mpi"}, {"backend": "nccl"},
                {"group_name": ""}, {"group_name": "x" * 65}, {"timeout": -1}, {"timeout": 601},
                {"master_address": None}):  # fmt: skip
        answer = call("POST", server.url + "/init_weights_update_group", json=group_body(port, **bad))
        check(answer.status_code == 400, f"a join with {bad} got {answer.status_code} {answer.text[:200]}")
    alone = call("POST", server.url + "/init_weights_update_group", json=group_body(port, timeout=1))
    check(alone.status_code == 504, f"a join nobody completes got {alone.status_code} {alone.text[:200]}")
    # A master that accepts and never answers (a frozen trainer): torch's store waited for ever, and four such joins
    # held every group slot (review).  Now a 504, and the slot is free again.
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        for _ in range(5):  # more than the group slots
            mute = call("POST", server.url + "/init_weights_update_group",
                        json=group_body(silent.getsockname()[1], group_name="silent", timeout=1))  # fmt: skip
            check(mute.status_code == 504, f"a join to a silent master got {mute.status_code} {mute.text[:200]}")
    groups = [joined_group(server.url, f"g{i}") for i in range(4)]
    try:
        fifth = call("POST", server.url + "/init_weights_update_group", json=group_body(free_port(), group_name="g4"))
        check(fifth.status_code == 429, f"a fifth group got {fifth.status_code} {fifth.text[:200]}")
        again = call("POST", server.url + "/init_weights_update_group", json=group_body(free_port(), group_name="g0"))
        check(again.status_code == 409, f"a second group g0 got {again.status_code} {again.text[:200]}")
        none = call("POST", server.url + "/update_weights_from_distributed",
                    json={"group_name": "nope", "names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
        check(none.status_code == 404, f"an update on no group got {none.status_code} {none.text[:200]}")
    finally:
        for i, group in enumerate(groups):
            call("POST", server.url + "/destroy_weights_update_group", json={"group_name": f"g{i}"})
            group.destroy()
    gone = call("POST", server.url + "/destroy_weights_update_group", json={"group_name": "g0"})
    check(gone.status_code == 200 and gone.json() == {"destroyed": False}, f"a second destroy: {gone.text[:200]}")


def transfer_cut_while_receiving_keeps_the_weights(server: Guarded) -> None:
    """Issue 42, R-STAGED-TRANSFER: a trainer votes for its update and then sends nothing (it hung).  The write is cut
    at its deadline while the server receives: the lease ends, and the weights and their label stay as they were
    (nothing was copied); the transfer then fails at the group's deadline, and the server serves on."""
    info = call("GET", server.url + "/weight_info").json()
    before, text = info["weight_version"], completion(server.url).json()["choices"][0]["text"]
    name, spec = next(iter(info["parameters"].items()))
    group = joined_group(server.url, "hung-trainer", timeout=5)
    held = lease(server.url, holder="hung-trainer")
    try:
        update = in_thread(call, "POST", server.url + "/update_weights_from_distributed",
                           json={"group_name": "hung-trainer", "names": [name], "dtypes": [spec["dtype"]],
                                 "shapes": [spec["shape"]], "weight_version": "never", "lease_id": held,
                                 "write_timeout": 0.5, "bucket_bytes": 1 << 20})  # fmt: skip
        check(group.vote(True), "the server voted no to a valid update")
        answer = joined(*update)  # no tensor is sent: the write is cut, the receive fails at the group's deadline
        check(answer.status_code in (410, 502), f"a transfer that never came got {answer.status_code} "
              f"{answer.text[:200]}")  # fmt: skip
        renewed = call("POST", server.url + f"/pause/{held}/renew", json={})
        check(renewed.status_code == 410, f"the cut lease was renewed: {renewed.status_code} {renewed.text[:200]}")
    finally:
        group.destroy()
    after = call("GET", server.url + "/weight_info").json()["weight_version"]
    check(after == before, f"a transfer cut before any tensor arrived relabelled the weights: {after!r}")
    check(completion(server.url).json()["choices"][0]["text"] == text, "the weights changed", Wrong)


def tp_engine_refuses_what_would_part_its_ranks(server: Guarded) -> None:
    """Issue 42's relay: an engine of two TP ranks, one ``cbpause serve`` each (an engine of its own).  A partial or
    bad set of ``--tp-*`` options exits at once with a message; a rank whose peer never comes exits once its
    ``--tp-timeout`` has passed, naming the wait, instead of never answering; a generation request to the rank that is
    not the driver is a 409 (its request would not be in the batch the group shares); an update from disk that lands
    on one rank only (the file outside the other's ``--weights-dir``) labels every rank ``PartialSync``, never the
    new version: the ranks' weights differ."""
    import subprocess
    import sys

    import httpx

    from ...testing.servers import free_port, serve_tp_processes

    base = [sys.executable, "-m", "cbpause.serve", str(server.checkpoint), "--port", str(free_port())]
    # (Each start imports torch and transformers: three, the rest of TensorParallel's checks are unit tests.)
    for bad in (["--tp-size", "2"], ["--tp-size", "2", "--tp-rank", "2", "--tp-init-method", "tcp://h:1"],
                ["--tp-size", "2", "--tp-rank", "0", "--tp-init-method", f"tcp://127.0.0.1:{free_port()}",
                 "--tp-timeout", "2"]):  # fmt: skip
        done = subprocess.run(base + bad, capture_output=True, text=True, timeout=WAIT)
        check(done.returncode != 0 and done.stderr.strip().splitlines()[-1].startswith("cbpause serve: "),
              f"cbpause serve {' '.join(bad)} exited {done.returncode}: {done.stderr[-300:]}")  # fmt: skip
    both = server.scratch / "tp-weights" / "both"
    both.mkdir(parents=True)
    rank_args = [("--weights-dir", str(both.parent)), ("--weights-dir", str(both))]
    with serve_tp_processes(server.checkpoint, 2, "--num-blocks", "64", "--default-ttl", str(WAIT),
                            rank_args=rank_args) as ranks:  # fmt: skip
        (driver, _), (peer, _) = ranks
        refused = httpx.post(peer + "/v1/completions", json={"prompt": "t3 t4", "max_tokens": 2}, timeout=WAIT)
        check(refused.status_code == 409, f"rank 1 took a generation request: {refused.status_code}")
        from ...client import Fleet, FleetError
        from ...testing.trl_cpu import save_tiny_policy

        save_tiny_policy(both.parent / "new", vocab_size=VOCAB, seed=5)  # in the driver's reach only
        with Fleet([driver, peer], request_timeout=WAIT) as fleet, fleet.pause(ttl=WAIT):
            try:
                fleet.update_weights_from_disk(str(both.parent / "new" / "model.safetensors"), weight_version="v1")
                raise Wrong("an update one rank refused was reported whole")
            except FleetError as error:
                check(error.updated == [driver], f"updated {error.updated}, failed {list(error.failed)}")
        label = httpx.post(driver + "/v1/completions", json={"prompt": "t3 t4", "max_tokens": 2},
                           timeout=WAIT).json().get("weight_versions")  # fmt: skip
        check(label == [[0, "PartialSync(sync='v1')"]], f"tokens of an engine whose ranks differ labelled {label}")


# The lease table's steps the cases before lease_log_is_a_behaviour take, whatever the timing.
LOGGED = frozenset({"PauseLease", "ResumeLease", "WriteBegin", "WriteEnd", "WriteRefused"})


def lease_log_is_a_behaviour(server: Guarded) -> None:
    """What the server's lease table did under every case before this one is a behaviour of ``tla/FleetPause.tla``
    (``tla/TraceFleetPause.tla``): TLC replays its lease log."""
    from ...tlc import default_tla_dir, fleet_traces

    records = fleet_traces.read_log(server.scratch / "leases.jsonl")
    # What the cases before this one make the table do (how many records varies with the machine's timing).
    taken = {record["a"] for record in records}
    check(LOGGED <= taken, f"the lease log of {len(records)} records lacks {sorted(LOGGED - taken)}")
    result = fleet_traces.validate(records, default_tla_dir())
    check(result.accepted, f"TLC rejected the server's lease log of {len(records)} records:\n{result.output[-2000:]}")


# Every case, in the order the probe runs them (the SIGTERM case starts and stops a server of its own; the lease log
# of the guarded server is validated last, once every case has been through it).
CASES: dict[str, Callable[[Guarded], None]] = {case.__name__: case for case in (
    empty_object_is_a_keep_pause, duplicate_request_id, waiting_pauses_hold_no_worker, lease_cap,
    leaver_leaves_no_lease, bad_bodies, symlink_out_of_the_weights_dir, fifo_named_safetensors, strangers_are_refused,
    openai_conventions, rollout_clients_misuse, fleet_checks_and_releases, second_trainer_is_fenced,
    weight_groups_refuse_bad_input_and_are_capped, transfer_cut_while_receiving_keeps_the_weights,
    senders_whose_bytes_are_not_their_manifest_s, torn_after_the_first_bucket, stalled_transfer_ends_when_asked,
    sigterm_answers_and_exits,
    tp_engine_refuses_what_would_part_its_ranks, values_no_answer_could_carry, fleet_client_limits,
    joins_and_receivers_end_when_asked,
    lease_log_is_a_behaviour,
)}  # fmt: skip


def serve_hostile_clients() -> None:
    """The hostile suite's serve section: every case of :data:`CASES` on one guarded server process."""
    from ...testing.trl_cpu import save_tiny_policy

    with tempfile.TemporaryDirectory(prefix="cbpause-hostile-serve-") as tmp:
        root = Path(tmp)
        checkpoint = save_tiny_policy(root / "tiny", vocab_size=VOCAB)
        (root / "weights").mkdir()
        (root / "scratch").mkdir()
        with guarded_server(checkpoint, root / "weights", root / "scratch") as server:
            for name, case in CASES.items():
                try:
                    case(server)
                except (Wrong, Silent, Lost) as error:
                    raise type(error)(f"{name}: {error}") from None
