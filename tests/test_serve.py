"""``cbpause serve`` and ``cbpause.client.Fleet`` (issue 29): real server processes on localhost, a tiny random Llama
checkpoint, the ``openai`` client and ``httpx``.  The lease table's own rules are tested without HTTP first."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cbpause.client import Fleet, FleetError  # noqa: E402
from cbpause.serve.control import COMPAT, compat_mode  # noqa: E402
from cbpause.serve.leases import Fenced, LeaseGone, LeaseTable, Superseded, UnknownLease, checked_seconds  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.servers import free_port, serve_process  # noqa: E402

from .conftest import ROOT  # noqa: E402

# One process of CI's two runs the module, which starts its servers once (tests/conftest.py, _group_for_xdist).
pytestmark = [pytest.mark.layer("system"), pytest.mark.xdist_group("serve")]
VOCAB = 32
# The servers' default ttl: no lease a test takes may expire under it, however slow the machine (a vLLM- or SGLang-style
# pause cannot name a ttl); the tests that see an expiry name their own.
TTL = HANG_S


def get(url: str, **kwargs):
    """``httpx.get`` bounded by ``HANG_S`` (httpx's own default is 5 s): the server must answer, however loaded."""
    return httpx.get(url, **{"timeout": HANG_S, **kwargs})


def post(url: str, **kwargs):
    """``httpx.post`` bounded by ``HANG_S``, as :func:`get`."""
    return httpx.post(url, **{"timeout": HANG_S, **kwargs})


# ------------------------------------------------------------------------------------------- the lease table alone


class FakeManager:
    """What LeaseTable uses of a manager: ``pause()`` and ``set_weight_version()`` (inside a pause only, as the
    manager's); records entries, exits and versions, and can refuse."""

    def __init__(self) -> None:
        self.inside = 0
        self.refuse: BaseException | None = None
        self.versions: list = []

    def set_weight_version(self, version) -> None:
        if not self.inside:
            raise RuntimeError("set_weight_version() outside a pause")
        self.versions.append(version)

    @contextlib.contextmanager
    def pause(self, timeout=None, mode="keep", into=None):
        if self.refuse is not None:
            raise self.refuse
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


def test_a_resumed_lease_stays_gone_and_a_second_resume_is_idempotent():
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(mode="keep", holder="t")
    assert manager.inside == 1 and len(lease.id) >= 32 and lease.state == "held"
    assert table.resume_lease(lease.id) is True and manager.inside == 0
    assert table.resume_lease(lease.id) is False  # idempotent
    with pytest.raises(LeaseGone):
        table.renew_lease(lease.id)
    with pytest.raises(LeaseGone):
        table.check_held(lease.id)
    with pytest.raises(UnknownLease):
        table.resume_lease("not-a-lease")
    assert table.pause_lease(holder="t").id != lease.id
    table.close()
    assert table.held() == [] and manager.inside == 0


def test_an_expired_lease_ends_its_thread_inside_the_pause_and_is_honoured_no_more():
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(ttl=0.2, holder="t")
    lease.thread.join(timeout=HANG_S)
    assert not lease.thread.is_alive() and lease.state == "expired" and table.expired == 1
    assert manager.inside == 1  # the thread ended without leaving: the loop's dead-holder release is what frees it
    for call in (table.renew_lease, table.resume_lease, table.check_held):
        with pytest.raises(LeaseGone):
            call(lease.id)


def test_a_lease_does_not_expire_during_a_write():
    table = LeaseTable(FakeManager(), default_ttl=HANG_S)
    lease = table.pause_lease(ttl=0.2, holder="t")
    with table.write_weights(lease.id, timeout=HANG_S):  # within the write's own deadline (the ttl by default)
        lease.thread.join(timeout=0.6)  # past its ttl: what must not happen has had the time to
        assert lease.thread.is_alive() and lease.state == "held"
    lease.thread.join(timeout=HANG_S)
    assert lease.state == "expired"


def test_a_write_that_hangs_is_cut_at_its_deadline_and_the_weights_are_labelled_partial():
    """Issue 39, point 11: a write had no deadline, and a lease could not expire during one, so a write that hung
    kept the server paused for ever.  Now the lease expires at the write's deadline, the weights are labelled
    PartialSync while the hold is still in place, and the write's end is refused."""
    from cbpause.integrations.weights import PartialSync

    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(ttl=0.2, holder="t")
    with table.write_weights(lease.id, timeout=0.3, version=7) as writing:
        lease.left.wait(timeout=HANG_S)  # the write "hangs" past its deadline: the lease ends
        assert lease.left.is_set() and lease.state == "expired" and writing.cut
        # labelled before the hold is released; torn, so the cut lease's thread keeps the hold (the keeper)
        assert manager.versions == [PartialSync(7)] and manager.inside == 1 and table.torn is not None
        with pytest.raises(LeaseGone, match="cut off"):
            table.commit_write(writing, lambda: manager.set_weight_version(7))
    assert manager.versions == [PartialSync(7)] and table.torn is not None


def test_torn_weights_are_held_until_a_complete_write_mends_them():
    """R-TORN-HOLD: a write that fails after its first tensor leaves the weights torn.  Its lease's thread keeps the
    loop held after its lease ends (the keeper: one, however many torn writes follow); a lease asked meanwhile takes
    no pause of its own (a supporter: no newcomer could join that window), and the keeper leaves once a complete write
    has mended the weights and no supporter is held."""
    from cbpause.integrations.weights import PartialSync

    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(holder="t")
    with table.write_weights(lease.id, version=1) as writing:
        table.fail_write(writing, lambda: manager.set_weight_version(PartialSync(1)))
    assert table.torn.version == 1 and manager.inside == 1
    with table.write_weights(lease.id, version=3) as writing:
        table.fail_write(writing)  # nothing copied: torn as before
    assert table.torn.version == 1
    keeper = lease.thread
    assert table.resume_lease(lease.id) is True and manager.inside == 1  # the lease ended; its thread keeps the loop
    assert keeper.is_alive() and lease.state == "resumed"
    second = table.pause_lease(holder="t2")  # a supporter: entered at once, no pause of its own
    assert second.state == "held" and manager.inside == 1
    with table.write_weights(second.id, version=2) as writing:
        table.fail_write(writing, lambda: manager.set_weight_version(PartialSync(2)))
    assert table.torn.version == 2
    with table.write_weights(second.id, version=4) as writing:
        table.commit_write(writing, lambda: manager.set_weight_version(4))
    assert table.torn is None and keeper.is_alive() and manager.inside == 1  # mended; the supporter holds on
    assert table.resume_lease(second.id) is True
    keeper.join(timeout=HANG_S)
    assert not keeper.is_alive() and manager.inside == 0 and manager.versions[-1] == 4
    third = table.pause_lease(holder="t3")  # whole weights: a pause of its own again
    assert manager.inside == 1 and table.resume_lease(third.id) is True and manager.inside == 0
    table.close()


def test_a_resumed_lease_whose_write_hangs_ends_at_the_write_s_deadline():
    """The resume waits for the write; the write hangs past its deadline: it is cut, and the lease ends so (expired:
    its thread ends inside the pause, which the loop releases as a dead holder's)."""
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(holder="t")
    with table.write_weights(lease.id, timeout=0.3, version="v2") as writing:
        resumer = threading.Thread(target=table.resume_lease, args=(lease.id,))
        resumer.start()
        resumer.join(timeout=HANG_S)
        assert not resumer.is_alive() and writing.cut and lease.state == "expired" and manager.inside == 1
    from cbpause.integrations.weights import PartialSync

    assert manager.versions == [PartialSync("v2")]


def test_a_write_that_ends_in_time_commits_its_version():
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(holder="t")
    with table.write_weights(lease.id, timeout=HANG_S, version=3) as writing:
        table.commit_write(writing, lambda: manager.set_weight_version(3))
    assert manager.versions == [3] and not writing.cut and lease.state == "held"
    with pytest.raises(ValueError), table.write_weights(lease.id, timeout=-1):
        pytest.fail("a negative write timeout was taken")
    table.close()


def test_a_write_under_an_older_lease_than_the_last_writer_s_is_refused():
    """WriteOrder (FleetPause.tla): a late write of an earlier pause never overwrites a later pause's, even once the
    later pause has ended."""
    table = LeaseTable(FakeManager(), default_ttl=HANG_S)
    older, newer = table.pause_lease(holder="a"), table.pause_lease(holder="b")
    with table.write_weights(newer.id):
        pass
    with table.write_weights(newer.id):  # the last writer may write again
        pass
    table.resume_lease(newer.id)
    with pytest.raises(Superseded), table.write_weights(older.id):
        pytest.fail("an older lease wrote after a newer one")
    table.close()


def test_a_write_while_another_held_lease_wrote_last_is_fenced_until_that_lease_ends():
    """The fence (issue 39, point 13; ``Unfenced`` in FleetPause.tla): trainer a wrote, and may have been told its
    update is complete; trainer b's write, under a later lease, is refused while a's lease is held (it was taken
    before the fix, and overwrote a's weights under a's pause), and taken once a's lease has ended."""
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    a, b = table.pause_lease(holder="a"), table.pause_lease(holder="b")
    with table.write_weights(a.id) as writing:
        table.commit_write(writing, lambda: manager.set_weight_version("a"))
    with pytest.raises(Fenced, match="still held"), table.write_weights(b.id):
        pytest.fail("b overwrote the weights a wrote while a held its lease")
    assert manager.versions == ["a"]
    table.resume_lease(a.id)
    with table.write_weights(b.id) as writing:
        table.commit_write(writing, lambda: manager.set_weight_version("b"))
    assert manager.versions == ["a", "b"]
    table.close()


def test_two_trainers_entered_in_opposite_orders_never_leave_a_mix_behind_a_complete_update():
    """Issue 39, point 13: trainer a's pause reaches server 1 first, trainer b's reaches server 2 first.  a writes both
    and is told its update is complete; before the fence, b's write was taken on server 1 (its lease is the later
    there) and refused on server 2, so the fleet was mixed while a held it, believing it updated.  Now b is refused
    on both, and a's update stands on both until a's leases end."""
    managers = [FakeManager(), FakeManager()]
    tables = [LeaseTable(m, default_ttl=HANG_S) for m in managers]
    a1, b1 = tables[0].pause_lease(holder="a"), tables[0].pause_lease(holder="b")
    b2, a2 = tables[1].pause_lease(holder="b"), tables[1].pause_lease(holder="a")
    for table, manager, lease in ((tables[0], managers[0], a1), (tables[1], managers[1], a2)):
        with table.write_weights(lease.id) as writing:
            table.commit_write(writing, lambda m=manager: m.set_weight_version("a"))
    refused = []
    for table, lease in ((tables[0], b1), (tables[1], b2)):
        try:
            with table.write_weights(lease.id):
                pass
        except (Fenced, Superseded) as error:
            refused.append(type(error).__name__)
    # server 1: a wrote under a lease still held; server 2: b's lease is the older there (WriteOrder comes first)
    assert refused == ["Fenced", "Superseded"], refused
    assert [m.versions for m in managers] == [["a"], ["a"]]
    for table in tables:
        table.close()


def test_a_resume_during_a_write_leaves_the_pause_only_after_the_write():
    """Found in review: a trainer whose write timed out resumes while the server still copies the weights; the loop
    must not step before the copy ends."""
    manager = FakeManager()
    table = LeaseTable(manager, default_ttl=HANG_S)
    lease = table.pause_lease(holder="t")
    resumed = []
    with table.write_weights(lease.id):
        resumer = threading.Thread(target=lambda: resumed.append(table.resume_lease(lease.id)))
        resumer.start()
        resumer.join(timeout=0.5)  # what must not happen has had the time to
        assert manager.inside == 1, "the pause ended while a write under it ran"
    resumer.join(timeout=HANG_S)
    assert resumed == [True] and manager.inside == 0 and not lease.thread.is_alive()


def test_a_pause_that_fails_leaves_no_lease():
    manager = FakeManager()
    manager.refuse = TimeoutError("did not pause")
    table = LeaseTable(manager)
    with pytest.raises(TimeoutError):
        table.pause_lease(timeout=0.1)
    assert table.held() == []


@pytest.mark.parametrize("value", [-1, "5", float("nan"), float("inf"), True, [1], 10_000])
def test_bad_durations_are_refused(value):
    with pytest.raises(ValueError):
        checked_seconds("ttl", value, default=1.0, upper=3600)
    with pytest.raises(ValueError):
        LeaseTable(FakeManager()).pause_lease(ttl=value)


def test_the_mode_table_of_the_docs_is_the_code_s():
    page = (ROOT / "docs" / "serving.md").read_text()
    for (engine, mode, clear_cache), (ours, _) in COMPAT.items():
        cache = "" if clear_cache is None else f"clear_cache={str(clear_cache).lower()}"
        row = rf"\|\s*{engine}\s*\|\s*`{mode}`\s*\|\s*{cache}\s*\|[^|]*\|\s*`{ours}`\s*\|"
        assert re.search(row, page, re.IGNORECASE), (engine, mode, clear_cache)
    assert compat_mode("vllm", "keep", True) == "retract" and compat_mode("vllm", "keep", False) == "keep"
    with pytest.raises(ValueError):
        compat_mode("sglang", "wait")


# ------------------------------------------------------------------------------------------- real servers


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from cbpause.testing.trl_cpu import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("ckpt") / "tiny", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(checkpoint, weights_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with serve_process(checkpoint, "--weights-dir", str(weights_dir), "--default-ttl", str(TTL), "--num-blocks", "64",
                       log=log) as (url, process):  # fmt: skip
        yield url
    assert process.returncode is not None


@pytest.fixture(scope="module")
def rejecting(checkpoint, weights_dir):
    with serve_process(checkpoint, "--while-paused", "reject", "--weights-dir", str(weights_dir), "--num-blocks",
                       "64") as (url, _process):  # fmt: skip
        yield url


def policy(seed: int):
    from transformers import GenerationConfig

    from cbpause.testing.llama import tiny_llama

    model = tiny_llama(seed=seed, vocab_size=VOCAB)
    model.generation_config = GenerationConfig(eos_token_id=-1, pad_token_id=0)
    return model.eval()


def write_weights(model, path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def expected_text(model, prompt: list[int], n: int) -> str:
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    return " ".join(f"t{i}" for i in out)


def complete(url: str, prompt: str, n: int = 4, **kwargs):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    return client.completions.create(model=kwargs.pop("model", None) or "ignored-pinned", prompt=prompt, max_tokens=n,
                                     temperature=0, **kwargs)  # fmt: skip


def paused(url: str) -> bool:
    return get(url + "/is_paused").json()["is_paused"]


def version(url: str):
    return get(url + "/weight_info").json()["weight_version"]


def test_completions_flow_while_a_trainer_pauses_updates_from_disk_and_resumes(server, checkpoint, weights_dir):
    prompt = [3, 4, 5]
    text = " ".join(f"t{i}" for i in prompt)
    with pytest.raises(openai.BadRequestError):  # the server is pinned to its checkpoint
        complete(server, text, model="some/other-model")
    assert complete(server, text, model=str(checkpoint)).choices[0].text == expected_text(policy(0), prompt, 4)
    answers, errors, stop = [], [], threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                answers.append(complete(server, "t7 t8", n=6, model=str(checkpoint)))
            except Exception as error:  # noqa: BLE001 -- any failure fails the test below
                errors.append(error)

    thread = threading.Thread(target=traffic)
    thread.start()
    new = policy(1)
    write_weights(new, weights_dir / "v1.safetensors")
    try:
        for _ in range(2):  # two windows while requests flow
            with Fleet([server], request_timeout=HANG_S) as fleet, fleet.pause(mode="keep", timeout=HANG_S, ttl=HANG_S):
                assert paused(server)
                assert fleet.update_weights_from_disk("v1.safetensors", 1) == [server]
            assert not paused(server)
    finally:
        stop.set()
        thread.join(timeout=HANG_S)
    assert not thread.is_alive() and errors == [] and answers
    after = complete(server, text, model=str(checkpoint))
    assert after.choices[0].text == expected_text(new, prompt, 4)
    assert after.model_extra["weight_versions"] == [[0, 1]] and after.model_extra["kv_versions"] == [[0, 1]]
    assert version(server) == 1


TRAINER = """
import sys, time
from cbpause.client import Fleet
ttl, bound = float(sys.argv[2]), float(sys.argv[3])
fleet = Fleet([sys.argv[1]], holder="doomed-trainer", request_timeout=bound)
post, first = fleet._post, []


def told(url, route, body, **kwargs):  # says how each renewal went: how far it pushed the lease's end
    answer = post(url, route, body, **kwargs)
    if route == "/pause" and isinstance(answer, dict):
        first.append(answer["expires_at"])
    elif route.endswith("/renew"):
        renewed = isinstance(answer, dict)
        print(f"renewed {answer['expires_at'] - first[0]}" if renewed else f"lost {answer}", flush=True)
    return answer


fleet._post = told
with fleet.pause(mode="keep", timeout=bound, ttl=ttl):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_trainer_s_leases_expire_and_the_servers_resume(server, rejecting):
    """A live trainer's renewals push its lease's end past its first ttl; killed, it renews no more: the lease expires
    and the server resumes.  How soon after the kill (the ttl and the loop's HOLDER_CHECK_S on an idle machine) is the
    bench's figure, not a check here: a loaded machine takes longer.  The ttl leaves a renewal (every ttl / 3) room
    to come late."""
    ttl = 6.0
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, server, str(ttl), str(HANG_S)], stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    lines: list[str] = []
    try:
        while "held" not in lines or not any(x.startswith(("renewed", "lost")) for x in lines):
            line = trainer.stdout.readline()  # the renewer's line may come first on a loaded machine
            assert line, f"the trainer ended: {lines}"
            lines.append(line.strip())
        renewal = next(x for x in lines if x.startswith(("renewed", "lost")))
        assert renewal.startswith("renewed") and float(renewal.split()[1]) > 0, lines  # the lease outlives its ttl
        assert paused(server)
    finally:
        trainer.kill()
        trainer.wait(timeout=HANG_S)
    killed = time.monotonic()
    while paused(server) and time.monotonic() - killed < HANG_S:
        time.sleep(0.05)  # polling: the server is another process
    assert not paused(server), f"a killed trainer's lease still held {HANG_S} s after the kill"
    metrics = get(server + "/metrics").text
    assert re.search(r"^cbpause_leases_expired_total [1-9]", metrics, re.M)


def test_two_trainers_racing_share_the_window_and_each_resume_counts_once(server):
    leases, barrier = {}, threading.Barrier(2)

    def trainer(name: str):
        barrier.wait(timeout=HANG_S)
        leases[name] = post(server + "/pause", json={"mode": "keep", "timeout": HANG_S, "holder": name}).json()

    threads = [threading.Thread(target=trainer, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=HANG_S)
    assert {"a", "b"} == set(leases) and leases["a"]["lease_id"] != leases["b"]["lease_id"]
    a, b = leases["a"]["lease_id"], leases["b"]["lease_id"]
    assert post(server + "/resume", json={"lease_id": a}).json()["resumed"] is True
    assert post(server + "/resume", json={"lease_id": a}).json()["resumed"] is False  # idempotent
    assert paused(server)  # b still holds it
    assert post(server + f"/pause/{a}/renew").status_code == 410  # a's lease is gone
    assert post(server + "/update_weight_version", json={"lease_id": a, "weight_version": 9}).status_code == 410
    assert post(server + "/resume", json={"lease_id": b}).json()["resumed"] is True
    assert not paused(server) and version(server) != 9


def bad_requests(server: str, lease: str) -> list[tuple[str, str, object, int]]:
    """(route, what is wrong, body, the status it must get)."""
    return [
        ("/pause", "unknown mode", {"mode": "freeze"}, 400),
        ("/pause", "negative timeout", {"mode": "keep", "timeout": -1}, 400),
        ("/pause", "non-numeric ttl", {"mode": "keep", "ttl": "ten"}, 400),
        ("/pause", "zero ttl", {"mode": "keep", "ttl": 0}, 400),
        ("/pause", "malformed JSON", b"{mode: keep", 400),
        ("/pause", "a JSON list", b"[1, 2]", 400),
        ("/pause?mode=freeze", "unknown vLLM mode", None, 400),
        ("/pause?mode=keep&clear_cache=maybe", "bad clear_cache", None, 400),
        ("/pause_generation", "unknown SGLang mode", {"mode": "wait"}, 400),
        ("/pause/nope/renew", "unknown lease", {}, 404),
        ("/resume", "unknown lease", {"lease_id": "nope"}, 404),
        (f"/pause/{lease}/renew", "bad ttl", {"ttl": -5}, 400),
        ("/update_weights_from_disk", "no lease", {"path": "v1.safetensors"}, 409),
        ("/update_weights_from_disk", "path outside", {"lease_id": lease, "path": "/etc/passwd"}, 400),
        ("/update_weights_from_disk", "path escaping", {"lease_id": lease, "path": "../../../etc/hosts"}, 400),
        ("/update_weights_from_disk", "missing file", {"lease_id": lease, "path": "nothing.safetensors"}, 400),
        ("/update_weights_from_disk", "wrong shape", {"lease_id": lease, "path": "shape.safetensors"}, 400),
        ("/update_weights_from_disk", "wrong dtype", {"lease_id": lease, "path": "dtype.safetensors"}, 400),
        ("/update_weights_from_disk", "unknown name", {"lease_id": lease, "path": "name.safetensors"}, 400),
        ("/update_weights_from_disk", "not safetensors", {"lease_id": lease, "path": "junk.safetensors"}, 400),
        ("/update_weights_from_disk", "bad version", {"lease_id": lease, "path": "v1.safetensors",
                                                      "weight_version": [1]}, 400),  # fmt: skip
        ("/update_weight_version", "no lease", {"weight_version": 3}, 409),
        ("/update_weight_version", "unknown lease", {"lease_id": "nope", "weight_version": 3}, 404),
    ]


def test_each_bad_input_is_a_4xx_with_a_message_and_changes_nothing(server, checkpoint, weights_dir):
    import torch
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(3)}, str(weights_dir / "shape.safetensors"))
    save_file({"model.norm.weight": torch.ones(policy(0).config.hidden_size, dtype=torch.float16)},
              str(weights_dir / "dtype.safetensors"))  # fmt: skip
    save_file({"model.no_such.weight": torch.ones(2)}, str(weights_dir / "name.safetensors"))
    (weights_dir / "junk.safetensors").write_bytes(b"not a safetensors file")
    before = (version(server), get(server + "/weight_info").json()["parameters"])
    text = complete(server, "t3 t4", model=str(checkpoint)).choices[0].text
    lease = post(server + "/pause", json={"mode": "keep", "ttl": HANG_S}).json()["lease_id"]
    try:
        for route, what, body, status in bad_requests(server, lease):
            content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            response = post(server + route, content=content, headers={"content-type": "application/json"})
            assert response.status_code == status, (route, what, response.text)
            assert response.json()["error"], (route, what)
            assert get(server + "/is_paused").json()["leases"] == 1, (route, what)
    finally:
        assert post(server + "/resume", json={"lease_id": lease}).json()["resumed"] is True
    assert not paused(server)
    assert (version(server), get(server + "/weight_info").json()["parameters"]) == before
    assert complete(server, "t3 t4", model=str(checkpoint)).choices[0].text == text


def test_a_prompt_too_long_for_the_cache_is_a_400_and_the_server_serves_on(server, checkpoint):
    too_long = post(server + "/v1/completions", json={"prompt": "t3 " * 40000, "max_tokens": 2})
    # refused before the loop: longer than the server's max_model_len (which the cache holds)
    assert too_long.status_code == 400 and "max_model_len" in too_long.json()["error"]["message"]
    assert complete(server, "t3 t4", model=str(checkpoint)).choices[0].text


def test_vllm_and_sglang_routes_pause_and_resume_with_the_documented_modes(server):
    answer = post(server + "/pause?mode=keep").json()  # vLLM's default clear_cache=true: our retract
    assert answer["mode"] == "retract" and answer["ttl"] == TTL and paused(server)
    assert post(server + "/resume").json()["resumed"] == 1 and not paused(server)
    answer = post(server + "/pause_generation", json={"mode": "in_place"}).json()
    assert answer["mode"] == "keep" and paused(server)
    assert post(server + "/continue_generation").json()["resumed"] == 1 and not paused(server)


def test_a_request_during_a_pause_is_rejected_with_retry_after_when_the_server_rejects(rejecting):
    lease = post(rejecting + "/pause", json={"mode": "keep", "ttl": HANG_S}).json()["lease_id"]
    try:
        response = post(rejecting + "/v1/completions", json={"prompt": "t3", "max_tokens": 2})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
    finally:
        post(rejecting + "/resume", json={"lease_id": lease})
    assert post(rejecting + "/v1/completions", json={"prompt": "t3", "max_tokens": 2}).status_code == 200
    assert re.search(r'^cbpause_requests_total\{outcome="rejected"\} 1', get(rejecting + "/metrics").text, re.M)


def test_a_fleet_with_a_server_down_pauses_none_and_names_it(server, rejecting):
    down = f"http://127.0.0.1:{free_port()}"
    with Fleet([server, rejecting, down], request_timeout=HANG_S) as fleet:
        with pytest.raises(FleetError) as caught, fleet.pause(timeout=HANG_S, ttl=HANG_S):
            pytest.fail("paused a fleet with a server down")
    assert list(caught.value.failed) == [down] and down in str(caught.value)
    assert not paused(server) and not paused(rejecting)


def test_a_fleet_reports_a_server_whose_lease_was_lost(server, rejecting):
    with Fleet([server, rejecting], request_timeout=HANG_S) as fleet, fleet.pause(timeout=HANG_S, ttl=HANG_S):
        lost = fleet.leases[rejecting]
        assert post(rejecting + "/resume", json={"lease_id": lost}).json()["resumed"] is True  # as if expired
        with pytest.raises(FleetError) as caught:
            fleet.update_weight_version(7)
        assert list(caught.value.failed) == [rejecting] and caught.value.updated == [server]
    assert version(server) == 7 and version(rejecting) != 7
    assert not paused(server) and not paused(rejecting)


def test_a_client_that_disconnects_while_queued_has_its_request_cancelled(checkpoint):
    """In-process (:func:`in_process`), to see what the engine delivered for the request."""
    with in_process(checkpoint) as (url, app):
        delivered: dict[str, list] = {}
        router = app.state.manager.output_router
        deliver = router.deliver

        def spy(output):
            delivered.setdefault(output.request_id, []).append(output)
            deliver(output)

        router.deliver = spy
        lease = post(url + "/pause", json={"mode": "keep", "ttl": HANG_S}).json()["lease_id"]
        with pytest.raises(httpx.ReadTimeout):  # queued behind the pause; the client gives up and disconnects
            post(url + "/v1/completions", json={"prompt": "t3 t4", "max_tokens": 8}, headers={"x-request-id": "leaver"},
                 timeout=1.0)  # fmt: skip
        deadline = time.monotonic() + HANG_S
        while app.state.generate.outcomes["cancelled"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the server notices the disconnect on its own event loop
        assert app.state.generate.outcomes["cancelled"] == 1
        assert post(url + "/resume", json={"lease_id": lease}).json()["resumed"] is True
        after = post(url + "/v1/completions", json={"prompt": "t3", "max_tokens": 2})
        assert after.status_code == 200
        outputs = delivered.get("leaver", [])
        assert all(len(o.generated_tokens) == 0 for o in outputs), outputs  # it never ran


@contextlib.contextmanager
def in_process(checkpoint, **kwargs):
    """A server in this process (uvicorn in a thread), to see the engine's and the loop's state: yields (url, app);
    on the way out, the server stops and its loop with it."""
    import uvicorn
    from transformers import ContinuousBatchingConfig

    from cbpause.serve import build_app
    from cbpause.testing.servers import wait_healthy

    app = build_app(str(checkpoint), default_ttl=HANG_S,
                    continuous_batching_config=ContinuousBatchingConfig(num_blocks=64), **kwargs)  # fmt: skip
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=HANG_S)
    assert not thread.is_alive() and not app.state.manager.is_running()


def sse_events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


def test_every_route_s_answer_leaves_nothing_registered_and_a_refused_id_may_be_sent_again(checkpoint):
    """On either server (transformers 5.23-5.24's manager, 5.25's engine: serving_manager, serving_engine): a
    streamed answer's finish chunk carries its labels, with usage asked too (found by issue 41's hostile review: they
    were on the usage chunk); /v1/responses (transformers' handler) answers; a request refused during a pause leaves
    nothing under its x-request-id, so the client's retry with the same id is served (it was a 409 on every release);
    an id is free as soon as its answer is out (a reuse at once was a 409 one time in seven); a body whose
    stream_options, suffix or stream has the wrong type is a 400 naming it (it was a 500); afterwards nothing is
    registered with the loop's router."""
    with in_process(checkpoint, while_paused="reject") as (url, app):
        body = {"prompt": "t3 t4", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        streamed = post(url + "/v1/completions", json=body)
        events = sse_events(streamed.text)
        finish = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
        assert streamed.status_code == 200 and finish and finish[-1]["weight_versions"] == [[0, None]], streamed.text
        assert any(e.get("usage") for e in events), streamed.text
        responses = post(url + "/v1/responses", json={"input": "t3 t4", "max_output_tokens": 2})
        assert responses.status_code in (200, 400), responses.text  # 400: a checkpoint without a chat template
        for bad in ({"stream_options": "x", "stream": True}, {"suffix": 5}, {"stream": "yes"}):
            answer = post(url + "/v1/completions", json={"prompt": "t3", "max_tokens": 2, **bad})
            assert answer.status_code == 400 and next(iter(bad)) in answer.json()["error"]["message"], answer.text
        lease = post(url + "/pause", json={"mode": "keep", "ttl": HANG_S}).json()["lease_id"]
        again_id = {"x-request-id": "again"}
        refused = post(url + "/v1/completions", json={"prompt": "t3", "max_tokens": 2}, headers=again_id)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert post(url + "/resume", json={"lease_id": lease}).json()["resumed"] is True
        for _ in range(20):
            again = post(url + "/v1/completions", json={"prompt": "t3", "max_tokens": 2}, headers=again_id)
            assert again.status_code == 200 and again.json()["weight_versions"] == [[0, None]], again.text
        assert app.state.manager.output_router.result_handlers == {}


def test_a_stream_the_staleness_bound_restarts_after_it_sent_tokens_ends_with_an_error(checkpoint):
    """Tokens sent cannot be taken back: a streamed request restarted by the staleness bound (max_staleness=0) after
    it streamed tokens ends with an error chunk that says so, is cancelled in the loop and counted aborted (found by
    issue 41's hostile review: the client got the old tokens, then the restarted answer, more than max_tokens, and
    labels of the new version only)."""
    with in_process(checkpoint, max_staleness=0, on_stale="restart") as (url, app):
        lease = post(url + "/pause", json={"mode": "keep"}).json()["lease_id"]
        assert post(url + "/update_weight_version", json={"lease_id": lease, "weight_version": 0}).status_code == 200
        post(url + "/resume", json={"lease_id": lease})
        body = {"prompt": "t3 t4", "max_tokens": 1500, "stream": True}
        text = ""
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as answer:
            lines = answer.iter_lines()
            for line in lines:  # the first token's chunk: tokens were sent
                text += line + "\n"
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    break
            lease = post(url + "/pause", json={"mode": "keep"}).json()["lease_id"]
            assert post(url + "/update_weight_version",
                        json={"lease_id": lease, "weight_version": 1}).status_code == 200  # fmt: skip
            post(url + "/resume", json={"lease_id": lease})
            text += "\n".join(lines)
        events = sse_events(text)
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events), text[-500:]
        assert "staleness bound after" in events[-1]["error"]["message"], events[-1]
        assert app.state.generate.outcomes["aborted"] == 1 and app.state.generate.outcomes["finished"] == 0
        router, deadline = app.state.manager.output_router, time.monotonic() + HANG_S
        while router.result_handlers and time.monotonic() < deadline:  # the cancellation's output, on the server's
            time.sleep(0.02)  # own event loop: nothing here to wait on but its state
        assert router.result_handlers == {}


def test_a_client_that_leaves_mid_stream_has_its_request_cancelled(checkpoint):
    """A streamed request whose client closes the connection after the first token is cancelled in the loop, counted
    once, and leaves nothing registered (on 5.25 the route is cancelled, and with it the future the engine awaited:
    a cancelled future has no result, found by this test's neighbour before it landed)."""
    with in_process(checkpoint) as (url, app):
        body = {"prompt": "t3 t4", "max_tokens": 1500, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=HANG_S) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    break  # a token came: the client leaves
        generate, router = app.state.generate, app.state.manager.output_router
        deadline = time.monotonic() + HANG_S
        while (generate.outcomes["cancelled"] < 1 or router.result_handlers) and time.monotonic() < deadline:
            time.sleep(0.02)  # the server notices the disconnect on its own event loop
        assert generate.outcomes["cancelled"] == 1 and generate.outcomes["finished"] == 0, generate.outcomes
        assert router.result_handlers == {}


def test_a_request_the_loop_fails_is_an_openai_shaped_500_and_one_a_stop_ends_a_503(checkpoint):
    """A non-streamed request's failure: a 503 once the loop stops or died (a stop's flush that ran out was a plain
    text 500 before issue 41's hostile review), an OpenAI-shaped 500 otherwise; neither a bare RuntimeError."""
    from types import SimpleNamespace

    from fastapi import HTTPException

    failed = SimpleNamespace(error="boom", weight_versions=[], kv_versions=[])
    with in_process(checkpoint) as (_url, app):
        with pytest.raises(HTTPException) as running:
            app.state.generate._settle("r", failed)
    with pytest.raises(HTTPException) as stopped:
        app.state.generate._settle("r", failed)
    assert (running.value.status_code, stopped.value.status_code) == (500, 503)
    assert "boom" in running.value.detail and "stopped" in stopped.value.detail


def test_a_stream_s_chunks_pass_at_once_not_one_behind():
    """Each token's chunk is sent as its output comes, its choice's finish chunk with the labels once the request
    ends: holding a chunk back until the next came withheld a stream's last token for a whole pause (issue 41's
    hostile review: 515 of 516 tokens after 2 s of a keep pause)."""
    import asyncio
    from types import SimpleNamespace

    from cbpause.integrations.sampling import SamplingParams
    from cbpause.serve import generation
    from cbpause.serve import openai as routes
    from cbpause.testing.trl_cpu import tiny_tokenizer

    handlers = {}
    generate = SimpleNamespace(count=lambda outcome: None, _refuse_duplicate=lambda request_id: None, client_ids=set(),
                               _enqueue=lambda rid, *args, **kwargs: handlers.setdefault(rid, args[4]))  # fmt: skip
    manager = SimpleNamespace(cancel_request=lambda request_id: None, versions=SimpleNamespace(restarts={}))
    served = generation.Served(name="m", checkpoint="m", vocab_size=VOCAB, max_model_len=64, default_max_tokens=None,
                           sampling=SamplingParams(temperature=0.0), eos_token_ids=(), chat=False)  # fmt: skip
    parsed = generation.parse_completion({"prompt": [3, 4], "max_tokens": 2, "stream": True}, served)

    def output(tokens: list[int], finished: bool) -> SimpleNamespace:
        return SimpleNamespace(generated_tokens=tokens, logprobs=[0.0] * len(tokens), error=None,
                               is_finished=lambda: finished, weight_versions=[(0, 7)], kv_versions=[(0, 7)])

    async def read() -> tuple[str, list[str]]:
        run = routes.Run(manager, generate, tiny_tokenizer(VOCAB), served, parsed, "r", [[3, 4]], [2], None)
        run.start()
        chunks = run.stream()
        handlers["r"](output([5], False))
        first = await asyncio.wait_for(chunks.__anext__(), HANG_S)  # a bound on a hang, not a timing
        handlers["r"](output([5, 6], True))
        return first, [chunk async for chunk in chunks]

    first, rest = asyncio.run(read())
    assert '"t5"' in first and "weight_versions" not in first
    finish = json.loads(rest[-2][len("data: "):]) if rest[-1] == "data: [DONE]\n\n" else None
    assert finish is not None and finish["choices"][0]["finish_reason"] == "length", rest
    assert finish["choices"][0]["weight_versions"] == [[0, 7]] == finish["weight_versions"]


@pytest.mark.extended  # 20 s and more; CI runs the HTTP soak briefly (tests/test_sessions.py): nox -s system
def test_a_short_soak_over_http_loses_nothing():
    """The covering subset of ``nox -s soak -- --http`` (two servers, trainers, abandoned and killed leases)."""
    from cbpause.apps.soak import http as soak_http

    result = soak_http.run(soak_http.parse_args(["--seconds", "20", "--seed", "3", "--each"]))
    assert result["lost"] == result["duplicated"] == result["hangs"] == result["wrong"] == 0, result
    assert result["pauses"] > 0 and result["answered"] > 0 and result["requests"] > result["answered"]


@pytest.mark.parametrize("argv", [["--seconds", "-5"], ["--seconds", "nan"], ["--bound", "0"]])
def test_the_http_soak_refuses_a_duration_or_bound_that_is_not_positive(argv, capsys):
    from cbpause.apps.soak import http as soak_http

    with pytest.raises(SystemExit) as exit_:
        soak_http.parse_args(argv)
    assert exit_.value.code == 2 and "must be > 0" in capsys.readouterr().err


def test_the_http_bench_measures_both_sides(tmp_path):
    from cbpause.apps.bench.http_side import main

    assert main(tmp_path, 3, rounds=1, requests=8) == 0
    result = json.loads((tmp_path / "http.json").read_text())
    assert result["in_process"]["entry"]["n"] == result["http"]["entry"]["n"] == 3
    assert result["http"]["entry"]["median_ms"] > 0
    sampling = result["sampling"]
    assert sampling["single"]["requests"] == sampling["mixed"]["requests"] == 8
    assert sampling["mixed"]["tok_s_median"] > 0 and sampling["mixed_over_single_tok_s"] > 0


def test_the_console_script_serves_and_refuses_a_bad_command_line():
    import shutil

    script = shutil.which("cbpause")
    if script is None:
        pytest.skip("the console script is not installed (pip install -e '.[serve]' installs it)")
    helped = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=HANG_S)
    assert helped.returncode == 0 and "--weights-dir" in helped.stdout and "--default-ttl" in helped.stdout
    wrong = subprocess.run([script, "frobnicate"], capture_output=True, text=True, timeout=HANG_S)
    assert wrong.returncode != 0 and "usage: cbpause serve" in wrong.stderr


class Clock:
    """A table's clock that the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_cut_write_is_labelled_partial_before_the_next_writer_commits():
    """Issue 39's hostile review: lease a's write hangs past its deadline; a's renewal cuts it, which frees the write
    slot and lifts the fence; b writes and commits vB.  a's lease thread used to label the weights
    ``PartialSync(vA)`` only after that, over b's acknowledged version (30 runs of 30).  The cut labels them now, in
    the locked step that frees the slot (FleetPause's WriteCut is one step)."""
    from cbpause.integrations.weights import PartialSync

    manager, clock, records = FakeManager(), Clock(), []
    table = LeaseTable(manager, default_ttl=100, clock=clock, log=records.append)
    a, b = table.pause_lease(holder="a"), table.pause_lease(holder="b")
    inside, go = threading.Event(), threading.Event()

    def write_a():
        with pytest.raises(LeaseGone), table.write_weights(a.id, timeout=5, version="vA") as writing:
            inside.set()
            go.wait(HANG_S)
            table.commit_write(writing, lambda: manager.set_weight_version("vA"))

    thread = threading.Thread(target=write_a)
    thread.start()
    assert inside.wait(HANG_S)
    clock.now += 6  # past a's write deadline: its copy hangs
    with pytest.raises(LeaseGone):
        table.renew_lease(a.id)  # a's renewer looks at it: the cut
    with table.write_weights(b.id, timeout=5, version="vB") as writing:
        table.commit_write(writing, lambda: manager.set_weight_version("vB"))
    go.set()
    thread.join(HANG_S)
    a.thread.join(HANG_S)
    assert not thread.is_alive() and not a.thread.is_alive()
    assert manager.versions == [PartialSync("vA"), "vB"], manager.versions
    assert [r["a"] for r in records if r["a"].startswith("Write")] == ["WriteBegin", "WriteCut", "WriteBegin",
                                                                       "WriteEnd"]  # fmt: skip
    table.close()


def test_a_copy_that_fails_is_a_write_that_failed_in_the_log_and_in_the_labels(tmp_path):
    """Issue 39's hostile review: a copy that failed on its first tensor left the log without an end of the write
    (TLC could not replay it), and one that failed half-way was logged as a complete write while the weights were
    labelled ``PartialSync``.  Both are ``WriteFail`` now, and the log replays."""
    import torch

    from cbpause.integrations.weights import PartialSync
    from cbpause.serve.control import _write
    from cbpause.serve.transfer import CopyFailed, WriteFailed
    from cbpause.tlc.fleet_traces import validate

    from .conftest import TLA_DIR

    class Model(FakeManager):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    for tensors, labels in (({"0.weight": torch.zeros(3, 3)}, []),  # fails on the first tensor: nothing copied
                            ({"0.weight": torch.ones(2, 2), "1.weight": torch.zeros(3, 3)}, [PartialSync("v1")])):
        manager, records = Model(), []
        table = LeaseTable(manager, default_ttl=HANG_S, log=records.append)
        lease = table.pause_lease(holder="t")
        with pytest.raises(WriteFailed) as failed:
            _write(table, lease.id, manager, Given(tensors), "v1")
        assert isinstance(failed.value.cause, CopyFailed) and failed.value.torn == bool(labels)
        table.resume_lease(lease.id)
        assert manager.versions == labels and (table.torn is not None) == bool(labels)
        table.close()
        assert [r["a"] for r in records] == ["PauseLease", "WriteBegin", "WriteFail", "ResumeLease"], records
        assert records[2]["ver"] == (-1 if labels else 0)  # Partial(1) in the log's sign, or the label unchanged
        result = validate(records, TLA_DIR, tmp_path / str(len(labels)))
        assert result.accepted, result.output[-2000:]


def test_a_resume_that_waited_for_a_write_cut_at_its_deadline_says_the_lease_expired():
    """Issue 39's hostile review: the resume answered True (HTTP ``resumed: true``) while the write it waited for was
    cut and the lease ended as expired, its pause not left (the loop releases it as a dead holder's)."""
    table = LeaseTable(FakeManager(), default_ttl=HANG_S)
    lease = table.pause_lease(holder="t")
    answers = []
    with table.write_weights(lease.id, timeout=0.2):
        resumer = threading.Thread(target=lambda: answers.append(_outcome(table.resume_lease, lease.id)))
        resumer.start()
        lease.left.wait(HANG_S)  # the write "hangs" past its deadline: cut (its thread keeps the torn loop)
    resumer.join(HANG_S)
    assert not resumer.is_alive() and lease.state == "expired"
    assert answers == ["LeaseGone"], answers
    table.close()


class Given:
    """A transport of the tensors it is given, unchecked (what a transport's check would refuse reaches the copy)."""

    staged = False

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def receive(self, load, progress=None) -> None:
        for name, tensor in self.tensors.items():
            load(name, tensor)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 -- the test compares what came back
        return type(error).__name__
