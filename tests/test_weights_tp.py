"""An engine of tensor-parallel ranks served over HTTP, and weights into it by broadcast (issue 42's relay): two
``cbpause serve --tp-size 2`` processes (one rank each, meeting over gloo) and a trainer (this process, rank 0 of the
weight-update group).  Every rank joins the group and receives each whole tensor, and copies its own shard of it.
After an update the driver's greedy completion is the trainer's ``generate`` with the new weights, labelled with the
new version on every rank; a bad manifest is a 4xx on every rank with nothing copied; a rank killed mid-transfer makes
the trainer's call raise naming it, and the engine serves no mix: the driver refuses generation once its peer is
gone (the TP group's collective fails), never answers with half-updated weights."""

from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from cbpause.client import Fleet, FleetError  # noqa: E402
from cbpause.testing import HANG_S  # noqa: E402
from cbpause.testing.servers import serve_tp_processes  # noqa: E402

from .conftest import TLA_DIR  # noqa: E402
from .test_serve import VOCAB, complete, policy  # noqa: E402
from .test_weights_broadcast import PROMPT, expected_text, info, text  # noqa: E402

# One process of CI's two runs the module, which starts its servers once (tests/conftest.py, _group_for_xdist).
pytestmark = [pytest.mark.layer("system"), pytest.mark.xdist_group("weights_tp")]
# Every rank's flags: leases no slow machine lets expire (HANG_S).  A rank killed is seen by its peer at once (gloo's
# connection closes): the test that kills one waits for the error, not for a time.
FLAGS = ("--default-ttl", str(HANG_S), "--num-blocks", "64", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from cbpause.testing.trl_cpu import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("ckpt") / "tiny", vocab_size=VOCAB)


def engine(checkpoint, tmp_path):
    """Two ranks: ``(urls, processes, lease logs, weights dirs)``; rank 1's ``--weights-dir`` is inside rank 0's, so
    that a file can be in reach of rank 0 only."""
    logs = [tmp_path / "rank0.lease.log", tmp_path / "rank1.lease.log"]
    dirs = [tmp_path / "weights", tmp_path / "weights" / "both"]
    dirs[1].mkdir(parents=True)
    rank_args = [("--lease-log", str(log), "--weights-dir", str(d)) for log, d in zip(logs, dirs, strict=True)]
    with serve_tp_processes(checkpoint, 2, *FLAGS, rank_args=rank_args,
                            logs=[tmp_path / "rank0.out", tmp_path / "rank1.out"]) as ranks:  # fmt: skip
        yield [url for url, _ in ranks], [p for _, p in ranks], logs, dirs


@pytest.fixture(scope="module")
def tp_engine(checkpoint, tmp_path_factory):
    yield from engine(checkpoint, tmp_path_factory.mktemp("tp"))


@pytest.fixture()
def tp_engine_to_kill(checkpoint, tmp_path):
    yield from engine(checkpoint, tmp_path)


def test_a_bad_set_of_tensor_parallel_options_is_refused_before_anything_starts():
    from cbpause.integrations.serving import TensorParallel
    from cbpause.serve.__main__ import _tensor_parallel, parser

    good = {"size": 2, "rank": 1, "init_method": "tcp://127.0.0.1:29500"}
    assert TensorParallel(**good).driver is False and TensorParallel(**{**good, "rank": 0}).driver
    for bad, match in ((dict(size=1), "2 ranks or more"), (dict(size=True), "2 ranks or more"),
                       (dict(rank=2), "rank must be"), (dict(rank=-1), "rank must be"),
                       (dict(init_method="127.0.0.1:29500"), "tcp://"), (dict(init_method="file:///no/dir/f"), "tcp://"),
                       (dict(backend="mpi"), "backend"),
                       (dict(timeout=0), "timeout"), (dict(timeout=float("nan")), "timeout")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            TensorParallel(**{**good, **bad})
    for argv, match in ((["--tp-size", "2"], "needs --tp-rank"), (["--tp-rank", "1"], "needs --tp-size"),
                        (["--tp-init-method", "tcp://h:1"], "needs --tp-size"),
                        (["--tp-timeout", "5"], "needs --tp-size"),
                        (["--tp-backend", "gloo"], "needs --tp-size"),
                        (["--peer-join-grace", "1"], "needs --tp-size")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _tensor_parallel(parser().parse_args(["ckpt", *argv]))
    assert _tensor_parallel(parser().parse_args(["ckpt"])) is None
    given = _tensor_parallel(parser().parse_args(["ckpt", "--tp-size", "2", "--tp-rank", "0", "--tp-init-method",
                                                  "tcp://h:1", "--tp-timeout", "7"]))  # fmt: skip
    assert (given.backend, given.timeout) == ("gloo", 7.0)
    from cbpause.serve import _peer_join_grace, build_app

    for grace in (0, -1, 0.1, float("nan"), True, "5", 300, float("inf")):  # refused before the model loads
        with pytest.raises(ValueError, match="peer_join_grace must be at least"):
            _peer_join_grace(grace, 300.0, True)
    with pytest.raises(ValueError, match="TP engine only"):
        build_app("no-such-checkpoint", peer_join_grace=5)
    # Found by review: the default grace was checked against a --peer-park-timeout given alone, TP or not.
    assert _peer_join_grace(None, 5.0, True) == 2.5 and _peer_join_grace(None, 5.0, False) == 10.0
    assert _peer_join_grace(None, None, True) == 10.0 and _peer_join_grace(2, None, True) == 2.0


def test_the_driver_serves_and_the_other_rank_refuses_generation(tp_engine, checkpoint):
    from transformers import AutoModelForCausalLM

    urls, _, _, _ = tp_engine
    want = expected_text(AutoModelForCausalLM.from_pretrained(checkpoint).eval(), PROMPT, 6).strip()
    assert text(urls[0]) == want  # the sharded model computes what the whole one does
    refused = httpx.post(urls[1] + "/v1/completions", json={"model": "tiny", "prompt": "t1", "max_tokens": 2},
                         timeout=HANG_S)  # fmt: skip
    assert refused.status_code == 409 and "rank 0" in refused.json()["error"]["message"], refused.text
    # Its shapes are the whole tensors' (what a trainer sends), on every rank.
    shapes = [{k: v["shape"] for k, v in info(url)["parameters"].items()} for url in urls]
    whole = {k: list(v.shape) for k, v in AutoModelForCausalLM.from_pretrained(checkpoint).state_dict().items()}
    assert shapes == [whole, whole]


def test_an_update_by_broadcast_reaches_every_rank_s_shard_and_labels_the_engine(tp_engine, tmp_path):
    urls, _, logs, _ = tp_engine
    before = text(urls[0])
    new = policy(seed=7)
    with Fleet(urls, request_timeout=HANG_S) as fleet:
        fleet.init_weights_update_group("127.0.0.1", timeout=HANG_S)
        with fleet.pause(ttl=HANG_S):  # every rank paused: their windows open together (R-SAME-WINDOW)
            updated = fleet.update_weights_from_distributed(new.named_parameters(), weight_version=1)
        assert sorted(updated) == sorted(urls)
        want = expected_text(new, PROMPT, 6).strip()
        assert text(urls[0]) == want != before
        assert [info(url)["weight_version"] for url in urls] == [1, 1]
        # A bad manifest: a 4xx at once on every rank, nothing copied; each rank left the group.
        name, tensor = next(iter(new.named_parameters()))
        with fleet.pause(ttl=HANG_S):
            with pytest.raises(FleetError) as refused:
                fleet.update_weights_from_distributed([(name, tensor[:1])], weight_version=9)
        assert set(refused.value.failed) == set(urls)
        assert all(reason.startswith("400 ") for reason in refused.value.failed.values()), refused.value.failed
        assert text(urls[0]) == want and [info(url)["weight_version"] for url in urls] == [1, 1]
        assert fleet.weight_group is None
        fleet.init_weights_update_group("127.0.0.1", timeout=HANG_S)
        with fleet.pause(ttl=HANG_S):
            fleet.update_weights_from_distributed(policy(seed=8).named_parameters(), weight_version=2)
        assert text(urls[0]) == expected_text(policy(seed=8), PROMPT, 6).strip()
        fleet.destroy_weights_update_group()
    from cbpause.tlc.fleet_traces import read_log, validate

    for n, log in enumerate(logs):
        records = read_log(log)
        result = validate(records, TLA_DIR, tmp_path / str(n))
        assert result.accepted, result.output[-2000:]
        assert [r["a"] for r in records].count("WriteEnd") == 2


def test_an_update_that_lands_on_one_rank_only_labels_the_engine_partial_until_a_full_one(tp_engine):
    """An update from disk that one rank refuses (the file is outside its --weights-dir) and the other takes: the
    ranks' weights differ, so at the window's barrier every rank labels its tokens PartialSync of the driver's version,
    never the new policy's (a mix served as complete is what issue 42 forbids); a full update ends it."""
    from .test_serve import write_weights

    urls, _, _, dirs = tp_engine
    write_weights(policy(seed=9), dirs[0] / "model.safetensors")  # in rank 0's reach only
    with Fleet(urls, request_timeout=HANG_S) as fleet:
        # A write that lands on rank 0 only and names the version both ranks hold already (a retry's, or None): the
        # labels alone would not differ (found by review); that a rank set one and the other did not does.
        held = info(urls[0])["weight_version"]
        assert info(urls[1])["weight_version"] == held
        with fleet.pause(ttl=HANG_S):
            with pytest.raises(FleetError):
                fleet.update_weights_from_disk(str(dirs[0] / "model.safetensors"), weight_version=held)
        assert [info(url)["weight_version"] for url in urls] == [f"PartialSync(sync={held!r})"] * 2
        with fleet.pause(ttl=HANG_S):
            with pytest.raises(FleetError) as failed:
                fleet.update_weights_from_disk(str(dirs[0] / "model.safetensors"), weight_version="half")
        assert failed.value.updated == [urls[0]] and list(failed.value.failed) == [urls[1]]
        answer = complete(urls[0], " ".join(f"t{i}" for i in PROMPT), n=4, model="tiny")
        assert [v for _, v in answer.weight_versions] == ["PartialSync(sync='half')"], answer.weight_versions
        assert [info(url)["weight_version"] for url in urls] == ["PartialSync(sync='half')"] * 2
        write_weights(policy(seed=10), dirs[1] / "model.safetensors")
        with fleet.pause(ttl=HANG_S):
            assert sorted(fleet.update_weights_from_disk(str(dirs[1]), weight_version="whole")) == sorted(urls)
    assert text(urls[0]) == expected_text(policy(seed=10), PROMPT, 6).strip()
    assert [info(url)["weight_version"] for url in urls] == ["whole", "whole"]


def test_a_fleet_pause_refused_on_one_rank_does_not_lose_the_engine(checkpoint, tmp_path):
    """Found by review: a fleet pause granted on the driver and refused on rank 1 (a key only rank 1 asks for) was
    released on the driver, but rank 1 stayed parked for the driver's pause with no holder of its own, and both
    failed at peer_park_timeout (300 s), requests waiting meanwhile.  Rank 1 now joins the pause with an empty window
    of its own after its --peer-join-grace (serve.PEER_JOIN_GRACE_S by default; 1 s here), and the engine serves
    on."""
    rank_args = [("--peer-join-grace", "1"), ("--peer-join-grace", "1", "--api-key", "only-rank-1")]
    with serve_tp_processes(checkpoint, 2, *FLAGS, rank_args=rank_args,
                            logs=[tmp_path / "rank0.out", tmp_path / "rank1.out"]) as ranks:  # fmt: skip
        (driver, _), (peer, _) = ranks
        before = text(driver)
        with Fleet([driver, peer], request_timeout=HANG_S) as fleet:
            with pytest.raises(FleetError) as refused:
                with fleet.pause(ttl=HANG_S):
                    pass
        assert list(refused.value.failed) == [peer] and "401" in refused.value.failed[peer], refused.value.failed
        assert text(driver) == before  # answered once rank 1 joined, not a 503 at peer_park_timeout
        answer = httpx.get(peer + "/health", timeout=HANG_S)
        assert answer.status_code == 200, answer.text


def test_a_rank_killed_mid_transfer_is_named_and_the_engine_serves_no_mix(tp_engine_to_kill):
    urls, processes, _, _ = tp_engine_to_kill
    big = policy(seed=11)
    with Fleet(urls, request_timeout=HANG_S, bucket_bytes=64 * 1024) as fleet:
        fleet.init_weights_update_group("127.0.0.1", timeout=HANG_S)
        group = fleet.weight_group
        broadcast, sent = group.broadcast, []

        def broadcast_then_kill(tensor):  # rank 1 dies once bucket 0 has arrived whole
            if len(sent) == 2:
                os.kill(processes[1].pid, signal.SIGKILL)
                processes[1].wait(timeout=HANG_S)
            sent.append(tensor)
            broadcast(tensor)

        group.broadcast = broadcast_then_kill
        with fleet.pause(ttl=HANG_S):
            with pytest.raises(FleetError) as failed:
                fleet.update_weights_from_distributed(big.named_parameters(), weight_version=5)
        assert urls[1] in failed.value.failed and failed.value.updated == []
    # The driver copied bucket 0 as it arrived (bounded staging): its weights are torn, labelled so, and it refuses
    # generation (R-TORN-HOLD); its peer is gone too, so it would refuse rather than answer with one shard anyway.
    assert info(urls[0])["weight_version"] == "PartialSync(sync=5)"
    client = openai.OpenAI(base_url=urls[0] + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="tiny", prompt="t3 t4 t5", max_tokens=6, temperature=0)
    assert refused.value.status_code >= 500, refused.value
