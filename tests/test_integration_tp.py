"""Tensor parallelism over the real loop: two ranks, gloo on the CPU (issue 5, tests 8 and 9).

Each test spawns two processes (``torch.multiprocessing``, a free port) that run a scenario of
``tests/tp_workers.py`` and write what they saw to JSON; the parent joins them with a deadline, so a hang
fails the test.  NCCL over two CUDA devices runs the same scenario where two GPUs exist.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cbpause.testing import HANG_S, free_port, spawn_ranks, tiny_llama  # noqa: E402

from . import tp_workers  # noqa: E402
from .conftest import MAX_NEW  # noqa: E402

pytestmark = pytest.mark.layer("system")
DEADLINE = HANG_S  # a whole group, load included: a hang, not slowness; the fault bounds are far below it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(path)
    return str(path)


def run_group(scenario: str, checkpoint: str, outdir, backend: str = "gloo") -> dict[int, dict]:
    hung = spawn_ranks(tp_workers.run, (2, free_port(), checkpoint, scenario, str(outdir), backend), 2, DEADLINE)
    assert not hung, f"{scenario}: ranks {hung} still running after {DEADLINE} s (a hang)"
    records = {}
    for rank in range(2):
        path = outdir / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote nothing"
        records[rank] = json.loads(path.read_text())
        assert "worker_error" not in records[rank], records[rank]["worker_error"]
    return records


def check_pauses(records):
    r0, r1 = records[0], records[1]
    for r in (r0, r1):
        # The i-th pause of each rank met the i-th pause of the other inside the same window.
        assert r["probes"] == [[3.0, 2.0 * i] for i in range(5)]
        assert r["violations"] == 0 and r["metrics"] == 5
        assert r["running_after_stop"] is False
    assert len(r0["ids"]) == tp_workers.N_REQUESTS
    assert sorted(r0["outputs"]) == sorted(r0["ids"]) == sorted(r1["outputs"])
    for rid in r0["ids"]:
        assert r0["outputs"][rid]["status"] == r1["outputs"][rid]["status"] == "FINISHED"
        assert len(r0["outputs"][rid]["tokens"]) == MAX_NEW
        assert r0["outputs"][rid]["tokens"] == r1["outputs"][rid]["tokens"]


def test_8_every_rank_pauses_in_the_same_window(checkpoint, tmp_path):
    check_pauses(run_group("pauses", checkpoint, tmp_path))


@pytest.mark.extended  # CI has TP=2 through the real traces' covering subset: nox -s system
def test_modes_and_versions_are_agreed_by_both_ranks(checkpoint, tmp_path):
    """Issue 14 under TP=2: in each window both ranks see the agreed mode, the ranks' batches stay copies of
    each other through keep, retract, drain and abort, and their outputs carry the same version spans."""
    r0, r1 = (records := run_group("modes", checkpoint, tmp_path))[0], records[1]
    for r in (r0, r1):
        assert r["agreed"] == [1, 2, 3, 4] and r["violations"] == 0
    assert sorted(r0["outputs"]) == sorted(r0["ids"]) == sorted(r1["outputs"])
    assert r0["outputs"] == r1["outputs"]  # tokens, statuses, errors and version spans alike
    for out in r0["outputs"].values():  # the drain finished them all, before the abort
        assert out["status"] == "FINISHED" and len(out["tokens"]) == MAX_NEW, out
    assert r0["later_spans"] == r1["later_spans"] == [[0, 4]]


@pytest.mark.extended  # CI has TP=2 through the real traces' covering subset: nox -s system
def test_ranks_that_set_different_versions_agree_on_the_drivers_and_say_so(checkpoint, tmp_path):
    """Issue 26, point 12: set_weight_version is local to a rank; the ranks compare digests at the window's barrier
    and, when they differ, every rank takes PartialSync of the driver's version (with an error logged on each: their
    weights may differ, issue 42), until one version is set on every rank; equal versions log nothing."""
    r0, r1 = (records := run_group("versions_differ", checkpoint, tmp_path))[0], records[1]
    assert r0["between"] == r1["between"] == "PartialSync(sync='a')"
    assert r0["after"] == r1["after"] == "c"
    assert len(r0["errors"]) == len(r1["errors"]) == 1 and "'b'" in r1["errors"][0]
    assert sorted(r0["spans"]) == sorted(r0["ids"]) == sorted(r1["spans"])
    assert r0["spans"] == r1["spans"]  # the same labels on both ranks
    assert all(v != "b" for spans in r0["spans"].values() for _, v in spans)


@pytest.mark.extended  # CI has TP=2 through the real traces' covering subset: nox -s system
def test_9a_peer_never_pauses_both_ranks_end_with_a_clear_error(checkpoint, tmp_path):
    records = run_group("peer_never_pauses", checkpoint, tmp_path)
    r0, r1 = records[0], records[1]
    assert r0["entered"] is True
    # The parked rank left with PeerParkTimeout (D3) instead of waiting for ever.
    assert r1["fatal"] == "PeerParkTimeout" and "P-PEER-PARK-TIMEOUT" in r1["fatal_message"]
    assert r1["pause_after_cause"] == "PeerParkTimeout"
    # The pausing rank's group step failed at the barrier its peer never reached: a recorded error.
    assert r0["fatal"] is not None and r0["pause_after_cause"] is not None
    for r in (r0, r1):
        assert r["loop_alive"] is False and r["stop_returned"] is True
        assert r["pause_after"].startswith("RuntimeError")
    # Nothing lost: every request of the driver got exactly one terminal output.
    assert sorted(r0["outputs"]) == sorted(r0["ids"])


def test_9b_rank_killed_mid_pause_survivor_errors(checkpoint, tmp_path):
    records = run_group("rank_killed_mid_pause", checkpoint, tmp_path)
    r0, r1 = records[0], records[1]
    assert r1.get("killed") is True and r0["probe"] == 2.0
    assert r0["fatal"] is not None and r0["pause_after_cause"] is not None
    assert r0["loop_alive"] is False and r0["stop_returned"] is True
    assert r0["pause_after"].startswith("RuntimeError")
    assert sorted(r0["outputs"]) == sorted(r0["ids"])
    assert all(o["status"] != "FINISHED" or len(o["tokens"]) == MAX_NEW for o in r0["outputs"].values())


@pytest.mark.extended  # CI has TP=2 through the real traces' covering subset: nox -s system
def test_rank_killed_mid_step_survivor_errors_and_fails_every_request(checkpoint, tmp_path):
    records = run_group("rank_killed_mid_step", checkpoint, tmp_path)
    r0, r1 = records[0], records[1]
    assert r1.get("killed") is True
    assert r0["fatal"] is not None and r0["loop_alive"] is False and r0["stop_returned"] is True
    assert r0["pause_after"].startswith("RuntimeError") and r0["pause_after_cause"] is not None
    # Every request of the survivor reached exactly one terminal output, the unfinished ones failed.
    assert sorted(r0["outputs"]) == sorted(r0["ids"])
    assert any(o["status"] == "FAILED" for o in r0["outputs"].values())


@pytest.mark.nccl
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP needs two CUDA devices")
def test_8_nccl_every_rank_pauses_in_the_same_window(checkpoint, tmp_path):
    check_pauses(run_group("pauses", checkpoint, tmp_path, backend="nccl"))
