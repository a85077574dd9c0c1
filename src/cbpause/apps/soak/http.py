"""``python -m cbpause.apps.soak.http`` (``nox -s soak -- --http``): a soak of ``cbpause serve`` over HTTP.

Two server processes (a tiny random Llama; one queues requests during a pause, one rejects them) take, for
``--minutes`` (or ``--seconds``), with a printed seed:

* completions from client threads, a share of them from clients that give up early (they disconnect) or send
  bad input (which must get a 4xx); most with per-request sampling as RL rollout clients send it (R-SAMPLING: seeds,
  temperature, top-p, top-k, min-p, repetition penalty, ``n`` choices, stop strings, log-probabilities, token ids in
  and out, chat requests), whose answers must carry a log-probability per token, and whose seeds must give the same
  tokens under the same version whatever ran beside them and whatever windows came between (``seeded``: the answers
  compared with an earlier one of the same seed, prompt, arguments and version);
* two ``Fleet`` trainers, each pausing both servers in a random mode, writing new weights and resuming, their pauses
  racing each other (issue 39, point 13), one writing from disk and one by broadcast over a weight-update group (issue
  42: ``broadcasts``, and ``groups`` initialised, again after each transfer that failed): a trainer told its update is
  complete checks, while it still holds its pause, that every server generates with its version
  (``NoMixedWhileComplete``: a server that holds another version under a lease this trainer could still renew is a
  wrong answer); an update the other trainer's lease fences off is reported (``fenced``);
* abandoned leases (a pause taken and never renewed nor resumed: a trainer that hung) and trainer processes
  killed while they hold leases: their leases must end and the servers run again (within the ttl and the loop's
  ``HOLDER_CHECK_S`` on an idle machine: a figure for ``nox -s bench``, not a check here, where a loaded machine
  may take longer; a lease still held after ``HANG_S`` is a hang);
* vLLM- and SGLang-style pauses and resumes, and second resumes of the same lease;
* hostile clients (issue 39): bad bodies to every kind of route (a 4xx each), pairs of completions with one
  ``x-request-id`` (both answered, the second a 409 while the first is in flight: ``duplicates``), floods of twelve
  pauses at once (each answered: ``floods``), and clients that leave while their pause waits (withdrawn, never
  held for good: ``leavers``).

With ``--tp`` the two servers are the two ranks of one tensor-parallel engine (issue 42's relay): the clients send to
the driver, the trainers pause and update both ranks, and the disturbances are those that pause every rank (abandoned
leases, killed trainers).

The ledger, per server: every completion a client waited for is answered exactly once, with a 200 (its tokens and
its version labels, each a version the trainer wrote) or, on the rejecting server during a pause, a 503; the
server's own count of requests by outcome (``/metrics``) equals what the clients sent (nothing lost, nothing run
twice); no HTTP call waits past ``--bound``; no server stays paused for good once nobody holds a lease; and TLC
replays each server's lease log (``--lease-log``) against ``tla/FleetPause.tla`` (``traced``, ``trace_records``,
``rejected_logs=0``; ``--no-validate-leases`` skips it).  With
``--each`` the run goes on past its duration until the trainer has paused, a completion was answered and one was
not (left early or rejected), a flood of pauses came and a client left while its pause waited.  The last line::

    soak-http: seconds=… pauses=… updates=… broadcasts=… groups=… checked_complete=… missed=… fenced=… abandoned=…
               killed=… legacy=… floods=… leavers=… requests=… answered=… rejected=… left=… bad=… duplicates=… partial=…
               torn=… seeded=… lost=0 duplicated=0 hangs=0 wrong=0   (on one line)

``partial`` counts the answers labelled ``PartialSync``: on a TP engine, a write that landed on some ranks only
(R-TP-PARTIAL-WRITE); on a server of its own, torn weights served, which is wrong (R-TORN-HOLD).  ``torn`` counts the
hostile sender's tears: a server torn, refusing completions, then mended by a complete update.  ``missed`` counts
the updates the fleet reported some server missed (a lease that ran out on a loaded machine, a pause that timed out,
a write the other trainer's lease fenced off:
``fenced`` of them): reported, as R-FLEET-ALL-OR-NOTHING and R-WRITE-FENCE require, and not an error.

and the exit status is 1 unless lost, duplicated and hangs are 0 (or an answer was wrong: ``wrong=``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from ...client import Fleet, FleetError
from ...testing import HANG_S
from ...testing.servers import serve_process, serve_tp_processes
from ...testing.trl_cpu import save_tiny_policy
from .tear import tear

TTL = 2.0  # the leases' ttl, short so that expiries happen often
VOCAB = 32
MODES = ("keep", "retract", "drain", "abort")
JSON = {"content-type": "application/json"}
# Bad bodies a stranger sends (issue 39, point 9), to every kind of route: each must be a 4xx that changes nothing.
BAD_ROUTES = ("/v1/completions", "/pause", "/resume", "/update_weight_version")
BAD_BODIES = (b"{not json", b"[1, 2]", b'{"ttl": ' + b"1" * 5000 + b"}", b'{"a": "\xff"}',
              b'{"a": ' + b"[" * 20_000 + b"]" * 20_000 + b"}")  # fmt: skip
KILLED_TRAINER = """
import sys, time
from cbpause.client import Fleet
with Fleet(sys.argv[1:], holder="killed-trainer") as fleet, fleet.pause(mode="keep", timeout=30, ttl=%s):
    print("held", flush=True)
    time.sleep(600)
"""


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = Counter()
        self.sent: Counter = Counter()  # per server: completions a server received (all of them, left included)
        self.wrong: list[str] = []
        self.versions: set = {None}  # the versions the trainer wrote (labels must be among them)
        self.tp = False  # the servers are one TP engine's ranks: a PartialSync label may be served (R-TP-PARTIAL-WRITE)
        # (server, version, choice, arguments) -> the tokens of the first such answer (check_sampled)
        self.streams: dict[tuple, list[int]] = {}

    def count(self, key: str, k: int = 1) -> None:
        with self.lock:
            self.n[key] += k

    def problem(self, what: str) -> None:
        with self.lock:
            self.wrong.append(what)
        print(f"soak-http: WRONG: {what}", flush=True)


def client(url: str, ledger: Ledger, stop: threading.Event, rng: random.Random, bound: float) -> None:
    """Completions until ``stop``: most waited for, some abandoned after a short timeout, some malformed."""
    with httpx.Client(timeout=bound) as http:
        while not stop.is_set():
            roll = rng.random()
            if roll < 0.05:  # bad input, to a generation or a control route: a 4xx, and nothing runs
                route, bad = rng.choice(BAD_ROUTES), rng.choice(BAD_BODIES)
                r = http.post(url + route, content=bad, headers=JSON)
                ledger.count("bad")
                if not 400 <= r.status_code < 500:
                    ledger.problem(f"{url}: a bad body to {route} got {r.status_code}")
                continue
            if roll < 0.07:  # two completions with one x-request-id: both answered, the second a 409 if the first
                duplicate_pair(url, http, ledger, rng)  # is still in flight
                continue
            if roll < 0.10:  # two sampled requests alike at once: one seed's stream, beside each other
                twin_pair(url, http, ledger, rng)
                continue
            n = rng.randint(1, 6)
            body, choices = request_body(rng, n)
            with ledger.lock:
                ledger.sent[url] += choices
            ledger.count("requests")
            if roll < 0.12:  # a client that leaves early (it may still get its answer)
                try:
                    http.post(url + route_of(body), json=body, timeout=rng.uniform(0.01, 0.3))
                except httpx.TimeoutException:
                    pass
                ledger.count("left")
                continue
            started = time.monotonic()
            try:
                r = http.post(url + route_of(body), json=body)
            except httpx.TimeoutException:
                ledger.count("hangs")
                ledger.problem(f"{url}: a completion got no answer within {bound} s")
                continue
            except httpx.HTTPError as error:
                ledger.count("lost")
                ledger.problem(f"{url}: a completion failed: {error!r}")
                continue
            check_answer(url, r, n, ledger, time.monotonic() - started, body)


def route_of(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


SEEDS = 4  # the seeds, prompts and sampling profiles the soak's sampled requests draw from: the same come back often,
PROMPTS = ([3, 4], [5, 6, 7], [9])  # so that check_sampled compares many answers with an earlier one
PROFILES = ({"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 5},
            {"temperature": 1.3, "min_p": 0.05, "repetition_penalty": 1.2}, {"temperature": 0.0, "top_k": -1})
TOKEN_ARGUMENTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")  # what a stream depends on


def request_body(rng: random.Random, n: int) -> tuple[dict, int]:
    """A generation request of ``n`` tokens a choice, and its number of choices: mostly the checkpoint's sampling, a
    text prompt; often per-request sampling as RL rollout clients send it (R-SAMPLING: a seed, temperature, top-p,
    top-k, min-p, a repetition penalty, log-probabilities, token ids in and out, several choices, a stop string), a
    chat request sometimes."""
    if rng.random() < 0.4:
        words = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
        return {"prompt": " ".join(f"t{w}" for w in words), "max_tokens": n}, 1
    words = list(rng.choice(PROMPTS))
    body: dict = {"max_tokens": n, "seed": rng.randrange(SEEDS), **rng.choice(PROFILES), "return_token_ids": True}
    choices = rng.choice([1, 1, 2, 3])
    body["n"] = choices
    if rng.random() < 0.2:
        body["messages"] = [{"role": "user", "content": " ".join(f"t{w}" for w in words)}]
        body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
    else:
        body["prompt"] = words
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.15:
        body["stop"] = [f"t{rng.randrange(3, VOCAB)}"]
    return body, choices


def twice_at_once(send: Callable[[], httpx.Response]) -> tuple[list, bool]:
    """Sends one request from two threads at once: the answers (a response, or the transport's error) and whether
    the other thread is still waiting past the hang bound."""
    answers: list = []

    def once() -> None:
        try:
            answers.append(send())
        except httpx.HTTPError as error:
            answers.append(error)

    other = threading.Thread(target=once, name="twice-at-once")
    other.start()
    once()
    other.join(timeout=HANG_S + 5)
    return answers, other.is_alive()


def duplicate_pair(url: str, http: httpx.Client, ledger: Ledger, rng: random.Random) -> None:
    """Issue 39, point 2: a duplicate id stole the answer of the request in flight.  Both are answered: the first
    with its tokens (or a 503 during a pause on the rejecting server), the second with them too or a 409."""
    rid = f"dup-{rng.randrange(2**40)}"
    body = {"prompt": "t3 t4", "max_tokens": rng.randint(2, 6)}
    with ledger.lock:
        ledger.sent[url] += 2
    ledger.count("requests", 2)
    answers, hung = twice_at_once(lambda: http.post(url + "/v1/completions", json=body, headers={"x-request-id": rid}))
    if hung or len(answers) != 2:
        ledger.count("hangs")
        ledger.problem(f"{url}: a duplicate pair got {len(answers)} answers")
        return
    codes = sorted(a.status_code if isinstance(a, httpx.Response) else 0 for a in answers)
    if 0 in codes or any(c not in (200, 409, 503) for c in codes) or codes == [409, 409]:
        ledger.count("lost")
        ledger.problem(f"{url}: a duplicate pair was answered {codes}")
        return
    ledger.count("duplicates", codes.count(409))
    for a in answers:
        if a.status_code == 200:
            check_answer(url, a, body["max_tokens"], ledger, 0.0)
        elif a.status_code == 503:
            ledger.count("rejected")


def twin_pair(url: str, http: httpx.Client, ledger: Ledger, rng: random.Random) -> None:
    """Two requests alike (a seed, per-request sampling), sent at once: each is answered, and two answers under the
    same version (check_sampled) have the same tokens, whatever ran beside them (R-SAMPLING)."""
    n = rng.randint(2, 8)
    body, choices = request_body(rng, n)
    while "seed" not in body:
        body, choices = request_body(rng, n)
    body.pop("stop", None)
    with ledger.lock:
        ledger.sent[url] += 2 * choices
    ledger.count("requests", 2)
    answers, hung = twice_at_once(lambda: http.post(url + route_of(body), json=body))
    if hung or any(not isinstance(a, httpx.Response) for a in answers):
        ledger.count("hangs" if hung else "lost")
        ledger.problem(f"{url}: a twin pair got {answers}")
        return
    for a in answers:
        check_answer(url, a, n, ledger, 0.0, body)


def check_answer(url: str, r: httpx.Response, n: int, ledger: Ledger, waited: float,
                 asked: dict | None = None) -> None:  # fmt: skip
    if r.status_code == 503 and "retry-after" in r.headers:  # refused during a pause, or ended by an abort pause
        ledger.count("rejected")
        return
    if r.status_code != 200:
        ledger.count("lost")
        ledger.problem(f"{url}: a completion got {r.status_code}: {r.text[:200]}")
        return
    body = r.json()
    asked = asked or {}
    if len(body["choices"]) != asked.get("n", 1):
        ledger.problem(f"{url}: {len(body['choices'])} choices for n={asked.get('n', 1)}")
    with ledger.lock:
        known = set(ledger.versions)
    # A write that failed half-way, or (a TP engine) landed on some ranks only, labels PartialSync of its version:
    # never a policy's, and a label of a version some trainer wrote all the same.
    known |= {f"PartialSync(sync={v!r})" for v in known}
    for choice in body["choices"]:
        labels = {v for _, v in choice.get("weight_versions", [])}
        if any(str(v).startswith("PartialSync(") for v in labels):
            ledger.count("partial")
            if not ledger.tp:  # one server's partial label is torn weights, which it must never serve (R-TORN-HOLD)
                ledger.problem(f"{url}: an answer labelled {labels}: torn weights served")
        tokens = choice.get("token_ids")
        count = len(tokens) if tokens is not None else body["usage"]["completion_tokens"]
        if count != n and not choice.get("finish_reason") == "stop":
            ledger.problem(f"{url}: {count} tokens for max_tokens={n}")
        if not labels or not labels <= known:
            ledger.problem(f"{url}: labels {labels} not among the versions written {known}")
        if tokens is not None:
            check_sampled(url, asked, choice, tokens, ledger)
    ledger.count("answered")


def check_sampled(url: str, asked: dict, choice: dict, tokens: list[int], ledger: Ledger) -> None:
    """A choice of a request with per-request sampling: a log-probability per token, and the seed's stream: the same
    seed, prompt and arguments under one version (its tokens' and its KV's) give the same tokens, whatever ran beside
    them and whatever windows came between (R-SAMPLING)."""
    logprobs = choice.get("logprobs") or {}
    count = len(logprobs["content"]) if "content" in logprobs else len(logprobs.get("token_logprobs", []))
    if count != len(tokens):
        ledger.problem(f"{url}: {count} log-probabilities for {len(tokens)} tokens")
    weights, kv = choice.get("weight_versions", []), choice.get("kv_versions", [])
    if len(weights) != 1 or weights != kv or "stop" in asked or not isinstance(weights[0][1], int):
        return
    # Choice i samples with seed + i; a shorter answer of the same stream is a prefix of a longer one.
    arguments = {k: asked.get(k) for k in TOKEN_ARGUMENTS}
    arguments["seed"] = asked["seed"] + choice["index"]
    prompt = asked.get("prompt") or asked["messages"][0]["content"]
    key = (url, weights[0][1], "messages" in asked, json.dumps(prompt), json.dumps(arguments, sort_keys=True))
    with ledger.lock:
        first = ledger.streams.get(key)
        if first is None or len(tokens) > len(first):
            ledger.streams[key] = tokens
    if first is None:
        return
    ledger.count("seeded")
    shorter, longer = sorted((first, tokens), key=len)
    if longer[: len(shorter)] != shorter:
        ledger.problem(f"{url}: a seed's stream changed under one version: {first} then {tokens} for {asked}")


TRAINERS = 2  # racing each other: their pauses reach the servers in either order (issue 39, point 13)
GROUP_TIMEOUT_S = 60.0  # each collective's deadline in the broadcasting trainer's weight-update group


def trainer(urls: list[str], weights: list[str], ledger: Ledger, stop: threading.Event, rng: random.Random,
            k: int = 0, tensors: list[dict] | None = None) -> None:  # fmt: skip
    """Fleet pauses in random modes, each with a weight update, and now and then a second resume of a lease.
    Trainer ``k`` writes the versions ``k + 1``, ``k + 1 + TRAINERS``, ...: each version names its trainer.  With
    ``tensors`` (the same policies as ``weights``, in memory) it sends its updates by broadcast (issue 42), over a
    weight-update group it initialises again whenever a failed transfer closed it."""
    version = k + 1 - TRAINERS
    with Fleet(urls, holder=f"soak-trainer-{k}") as fleet:
        while not stop.is_set():
            mode = rng.choice(MODES)
            try:
                if tensors is not None and fleet.weight_group is None:
                    fleet.init_weights_update_group("127.0.0.1", timeout=GROUP_TIMEOUT_S)
                    ledger.count("groups")
                with fleet.pause(mode=mode, timeout=30, ttl=TTL):
                    version += TRAINERS
                    with ledger.lock:
                        ledger.versions.add(version)
                    if tensors is None:
                        fleet.update_weights_from_disk(weights[version % len(weights)], version)
                    else:
                        fleet.update_weights_from_distributed(tensors[version % len(tensors)].items(), version)
                        ledger.count("broadcasts")
                    leases = dict(fleet.leases)
                    complete_update_stands(fleet, version, ledger)
                ledger.count("pauses")
                ledger.count("updates")
                for url, lease in leases.items():  # a second resume of the same lease: idempotent (410 if it expired)
                    r = httpx.post(url + "/resume", json={"lease_id": lease}, timeout=HANG_S)
                    if not (r.status_code == 200 and r.json()["resumed"] is False or r.status_code == 410):
                        ledger.problem(f"{url}: a second resume got {r.status_code} {r.text[:100]}")
            except FleetError as error:  # reported, as it must be: a lease lost on a loaded machine, a pause timed out
                ledger.count("missed")
                if "still held" in str(error):  # Fenced: the other trainer wrote last and holds its lease
                    ledger.count("fenced")
                print(f"soak-http: reported: {error}", flush=True)
            stop.wait(rng.uniform(0.05, 0.5))


def complete_update_stands(fleet: Fleet, version: int, ledger: Ledger) -> None:
    """``NoMixedWhileComplete``, checked on the real servers: the trainer was told its update is complete, and holds
    its pause; each server must generate with its version.  The version is read first and the lease renewed after:
    a renewal that succeeds shows the lease was held from the write to the read (a lease that ended is never honoured
    again), so a server with another version then is a wrong answer; one whose renewal is refused lost the lease on
    a loaded machine, and the fence rightly let the other trainer in."""
    for url, lease in fleet.leases.items():
        seen = httpx.get(url + "/weight_info", timeout=HANG_S).json()["weight_version"]
        renewed = httpx.post(url + f"/pause/{lease}/renew", json={}, timeout=HANG_S).status_code == 200
        if seen != version and renewed:
            ledger.problem(f"{url}: version {seen!r} while the trainer told its update {version} is complete holds "
                           "its lease there (a mixed fleet)")
    ledger.count("checked_complete")


def disturber(urls: list[str], ledger: Ledger, stop: threading.Event, rng: random.Random, tp: bool = False,
              tensors: list[dict] | None = None) -> None:  # fmt: skip
    """Abandoned leases, killed trainer processes, floods of pauses, clients that leave while their pause waits,
    vLLM/SGLang-style pauses and (with ``tensors``, the policies) a hostile sender that tears a server's weights, one
    at a time: each kind once in every round of six, in a shuffled order (so that a short run sees every kind), the
    roll within a kind random.  With ``tp`` (``urls`` are the ranks of one TP engine)
    only the kinds that pause every rank, as a TP engine must be paused (a pause on one rank parks the others, D3):
    abandoned leases (one on each rank, in one mode) and killed trainers."""
    kinds: list[float] = []
    while not stop.wait(rng.uniform(0.5, 2.0)):
        if not kinds:
            kinds = [0.2, 0.5] if tp else [0.2, 0.5, 0.6, 0.68, 0.9] + ([0.95] if tensors else [])  # (the bands below)
            rng.shuffle(kinds)
        roll, url = kinds.pop(), rng.choice(urls)
        if roll < 0.4:  # a trainer that hangs: a lease never renewed nor resumed (on every rank of a TP engine)
            body = {"mode": rng.choice(MODES), "ttl": TTL, "timeout": 30, "holder": "hung-trainer"}
            targets = urls if tp else [url]
            with ThreadPoolExecutor(len(targets)) as pool:
                asked = [pool.submit(httpx.post, u + "/pause", json=body, timeout=HANG_S) for u in targets]
                answers = [a.result() for a in asked]
            if any(r.status_code == 200 for r in answers):
                ledger.count("abandoned")
                for u in targets:
                    expect_running(u, time.monotonic(), ledger, stop)
        elif roll < 0.55:
            trainer_process = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER % TTL, *urls],
                                               stdout=subprocess.PIPE, text=True)  # fmt: skip
            try:
                held = trainer_process.stdout.readline().strip() == "held"
            finally:
                trainer_process.kill()
                trainer_process.wait(timeout=HANG_S)
            if held:
                ledger.count("killed")
                for u in urls:
                    expect_running(u, time.monotonic(), ledger, stop)
        elif roll < 0.65:
            flood(url, ledger, rng)
        elif roll < 0.7:  # a client that leaves while its pause waits: its pause is withdrawn, never held for good
            try:
                httpx.post(url + "/pause", json={"mode": "abort", "ttl": TTL, "holder": "leaver"},
                           timeout=rng.uniform(0.001, 0.05))  # fmt: skip
            except httpx.TimeoutException:
                pass
            ledger.count("leavers")
            expect_running(url, time.monotonic(), ledger, stop, {"leaver"})
        elif roll >= 0.93:
            tear(url, tensors, ledger, rng, TTL, GROUP_TIMEOUT_S)
        else:
            engine = rng.choice(("vllm", "sglang"))
            if engine == "vllm":
                r = httpx.post(url + "/pause?mode=" + rng.choice(("keep", "wait", "abort")), timeout=HANG_S)
            else:
                r = httpx.post(url + "/pause_generation", json={"mode": rng.choice(("abort", "retract", "in_place"))},
                               timeout=HANG_S)  # fmt: skip
            if r.status_code == 200:
                ledger.count("legacy")
                resume = httpx.post(url + ("/resume" if engine == "vllm" else "/continue_generation"), timeout=HANG_S)
                if resume.status_code != 200 or resume.json()["resumed"] < 1:
                    ledger.problem(f"{url}: a {engine}-style resume got {resume.status_code} {resume.text[:100]}")


def flood(url: str, ledger: Ledger, rng: random.Random) -> None:
    """Issue 39, point 3: pauses waiting for the window held the server's worker threads, so a holder's own resume
    waited for its lease's expiry.  Twelve pauses at once, each answered (a lease, resumed at once; a 504 after its
    timeout; a 429 past the cap), none past the bound."""
    answers: list = []

    def ask(i: int) -> None:
        try:
            r = httpx.post(url + "/pause", json={"mode": rng.choice(MODES), "ttl": TTL, "timeout": 2,
                                                 "holder": f"flood-{i}"}, timeout=HANG_S)  # fmt: skip
            answers.append(r)
            if r.status_code == 200:
                httpx.post(url + "/resume", json={"lease_id": r.json()["lease_id"]}, timeout=HANG_S)
        except httpx.HTTPError as error:
            answers.append(error)

    threads = [threading.Thread(target=ask, args=(i,), name=f"flood-{i}") for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S + 5)
    codes = [a.status_code if isinstance(a, httpx.Response) else 0 for a in answers]
    if len(codes) != 12 or any(c not in (200, 429, 503, 504) for c in codes):
        ledger.count("hangs" if len(codes) != 12 else "lost")
        ledger.problem(f"{url}: a flood of pauses was answered {codes}")
    ledger.count("floods")


def expect_running(url: str, since: float, ledger: Ledger, stop: threading.Event,
                   who: set[str] = frozenset({"hung-trainer", "killed-trainer"})) -> None:  # fmt: skip
    """The abandoned lease ends once its holder is gone, and with it the pause it held (others may pause the server
    meanwhile: what must end is this lease, so the check is on the leases of abandoned holders).  When is the bench's
    figure, not a check: a lease still held ``HANG_S`` after it was left is a hang."""
    while time.monotonic() < since + HANG_S:
        holders = httpx.get(url + "/is_paused", timeout=HANG_S).json()["holders"]
        if not who & set(holders):
            return
        stop.wait(0.05)
    ledger.count("hangs")
    ledger.problem(f"{url}: an abandoned lease was still held {time.monotonic() - since:.1f} s after it was left")


def server_counts(url: str) -> Counter:
    text = httpx.get(url + "/metrics", timeout=HANG_S).text
    found = re.finditer(r'^cbpause_requests_total\{outcome="(\w+)"\} (\S+)', text, re.M)
    return Counter({m.group(1): int(float(m.group(2))) for m in found})


def account(url: str, ledger: Ledger) -> None:
    """The server's count of completions by outcome against what the clients sent it: every one accounted for once."""
    counts = server_counts(url)
    seen, sent = sum(counts.values()), ledger.sent[url]
    if seen != sent:
        ledger.count("lost" if seen < sent else "duplicated", abs(seen - sent))
        ledger.problem(f"{url}: sent {sent} completions, the server accounts for {seen}: {dict(counts)}")


def validate_lease_logs(logs: list[Path], ledger: Ledger) -> None:
    """TLC replays each server's lease log against ``tla/FleetPause.tla`` (``tla/TraceFleetPause.tla``)."""
    from ...tlc import default_tla_dir, fleet_traces

    for path in logs:
        records = fleet_traces.read_log(path)
        result = fleet_traces.validate(records, default_tla_dir())
        ledger.count("traced")
        ledger.count("trace_records", len(records))
        if not result.accepted:
            ledger.count("rejected_logs")
            ledger.problem(f"TLC rejected the lease log {path.name} ({len(records)} records)")


def exercised(ledger: Ledger, tp: bool = False) -> bool:
    """What ``--each`` waits for: the trainer paused, an update by broadcast landed, a completion was answered and one
    was not (left or rejected), a flood of pauses came, a client left while its pause waited and a hostile sender tore
    a server's weights (with ``tp``: a lease abandoned on every rank in place of the last three, which a TP engine is
    not given)."""
    with ledger.lock:
        n = ledger.n
        done = n["pauses"] > 0 and n["broadcasts"] > 0 and n["answered"] > 0 and n["left"] + n["rejected"] > 0
        return done and (n["abandoned"] > 0 if tp else n["floods"] > 0 and n["leavers"] > 0 and n["torn"] > 0)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    ledger, stop = Ledger(), threading.Event()
    ledger.tp = bool(args.tp)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cbpause-soak-http-")))
        checkpoint = save_tiny_policy(tmp / "ckpt", vocab_size=VOCAB)
        weights = tmp / "weights"
        weights.mkdir()
        names = []
        for seed in (1, 2):  # two other policies' weights, which the trainer writes in turn
            model = save_tiny_policy(tmp / f"v{seed}", vocab_size=VOCAB, seed=seed)
            (model / "model.safetensors").rename(weights / f"w{seed}.safetensors")
            names.append(f"w{seed}.safetensors")
        urls, logs = [], []
        if args.tp:  # one engine of two TP ranks (issue 42's relay): the clients send to the driver only
            logs = [tmp / "leases-rank0.jsonl", tmp / "leases-rank1.jsonl"]
            ranks = stack.enter_context(serve_tp_processes(
                checkpoint, 2, "--weights-dir", str(weights), "--default-ttl", str(TTL), "--num-blocks", "128",
                rank_args=[("--lease-log", str(log)) for log in logs]))  # fmt: skip
            urls = [url for url, _ in ranks]
        for rule in () if args.tp else ("queue", "reject"):
            logs.append(tmp / f"leases-{rule}.jsonl")
            options = ("--weights-dir", str(weights), "--default-ttl", str(TTL), "--while-paused", rule,
                       "--lease-log", str(logs[-1]))  # fmt: skip
            url, _ = stack.enter_context(serve_process(checkpoint, *options, "--num-blocks", "128"))
            urls.append(url)
        generating = urls[:1] if args.tp else urls

        def rand() -> random.Random:
            return random.Random(rng.random())

        threads = [threading.Thread(target=client, name=f"client-{i}",
                                    args=(generating[i % len(generating)], ledger, stop, rand(), args.bound))
                   for i in range(4)]  # fmt: skip
        # Trainer 0 sends its updates by broadcast, trainer 1 from disk: the two kinds of write race each other.
        from safetensors.torch import load_file

        in_memory = [load_file(str(weights / name)) for name in names]
        threads += [threading.Thread(target=trainer, args=(urls, names, ledger, stop, rand(), k,
                                                           in_memory if k == 0 else None), name=f"trainer-{k}")
                    for k in range(TRAINERS)]  # fmt: skip
        threads.append(threading.Thread(target=disturber, args=(urls, ledger, stop, rand(), args.tp,
                                                                None if args.tp else in_memory),
                                        name="disturber"))  # fmt: skip
        started = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(args.duration)
        while args.each and not exercised(ledger, args.tp):
            if time.monotonic() - started > args.duration + HANG_S:  # not even after the bound: a hang
                ledger.count("hangs")
                ledger.problem(f"--each: no pause, answer or unanswered completion after {HANG_S} s more: {ledger.n}")
                break
            stop.wait(0.1)
        stop.set()
        for t in threads:
            t.join(timeout=args.bound + HANG_S)  # a completion's wait, or a disturbance's: a hang
            if t.is_alive():
                ledger.count("hangs")
                ledger.problem(f"thread {t.name} did not end")
        for url in urls:
            account(url, ledger)
        seconds = time.monotonic() - started
        if args.validate_leases:
            validate_lease_logs(logs, ledger)
    n = ledger.n
    keys = "pauses updates broadcasts groups checked_complete missed fenced abandoned killed legacy".split()
    keys += "floods leavers requests answered rejected left bad".split()
    keys += ["duplicates", "partial", "torn", "seeded"]
    keys += ["traced", "trace_records", "rejected_logs"] if args.validate_leases else []
    keys += ["lost", "duplicated", "hangs"]
    return {"seconds": round(seconds), **{k: n[k] for k in keys}, "wrong": len(ledger.wrong)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.soak.http", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None, help="how long (default 5)")
    g.add_argument("--seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--bound", type=float, default=HANG_S, help="no HTTP call may wait longer: a hang (default 300 s)")
    p.add_argument("--each", action="store_true", help="go on past the duration until the trainer paused, a completion "
                   "was answered and one was not (left or rejected)")  # fmt: skip
    p.add_argument("--tp", action="store_true", help="the servers are the two ranks of one tensor-parallel engine "
                   "(cbpause serve --tp-size 2): completions go to the driver, every pause to both ranks")
    p.add_argument("--no-validate-leases", dest="validate_leases", action="store_false", help="skip TLC's "
                   "validation of the servers' lease logs at the end (default: validated)")  # fmt: skip
    args = p.parse_args(argv)
    args.duration = args.seconds if args.seconds is not None else 60 * (5 if args.minutes is None else args.minutes)
    if not args.duration > 0 or not args.bound > 0:  # as the in-process soak: a NaN or a negative is refused
        p.error("the duration and --bound must be > 0")
    args.seed = args.seed if args.seed is not None else random.randrange(2**32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"soak-http: seed {args.seed} for {args.duration:g} s (reproduce with --seed {args.seed})", flush=True)
    r = run(args)
    print("soak-http: " + " ".join(f"{k}={v}" for k, v in r.items()))
    return 1 if r["lost"] or r["duplicated"] or r["hangs"] or r["wrong"] or r.get("rejected_logs") else 0


if __name__ == "__main__":
    sys.exit(main())
