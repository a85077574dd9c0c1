"""The real loop's labels are a behaviour of ``tla/RequestVersions.tla`` (issue 40, point 2), and a log altered in one
place is not.

One scenario on a tiny random Llama (:func:`cbpause.apps.scenarios.labels.run_labelled`: windows in every mode,
updates inside them, a staleness bound that restarts requests, an abort, every request sampled with a seed of its
own) is traced, and TLC replays its label log
(``tla/TraceRequestVersions.tla``); then forged copies of that log, each one lie about what the loop did, are
rejected.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.apps.scenarios.episodes import quiet_logs  # noqa: E402
from cbpause.apps.scenarios.labels import MAX_STALENESS, TOKENS, run_labelled  # noqa: E402
from cbpause.testing import ForwardProbe, tiny_llama  # noqa: E402
from cbpause.tlc.label_traces import label_log, validate  # noqa: E402

from .conftest import TLA_DIR  # noqa: E402

pytestmark = pytest.mark.layer("verify")


@pytest.fixture(scope="module")
def traced() -> tuple[list[dict], dict]:
    quiet_logs()
    model = tiny_llama("cpu", 7)
    probe = ForwardProbe()
    probe.attach(model)
    recorder, versions = run_labelled(model, probe)
    constants = {"max_staleness": versions.max_staleness, "on_stale": versions.on_stale,
                 "max_restarts": versions.max_stale_restarts}  # fmt: skip
    return label_log(recorder), constants


def check(log: list[dict], constants: dict, tmp_path) -> object:
    return validate(log, TLA_DIR, TOKENS, tmp_path, **constants)


def test_the_real_loop_s_labels_are_accepted_and_take_every_step(traced, tmp_path, tlc_ready):
    log, constants = traced
    result = check(log, constants, tmp_path)
    assert result.accepted, result.output[-3000:]
    assert constants["max_staleness"] == MAX_STALENESS
    actions = {r["a"] for r in log}
    assert actions == {"Submit", "Launch", "Land", "OpenWindow", "DrainFirst", "Update", "CloseWindow", "Output"}
    assert {r["arg"] for r in log if r["a"] == "OpenWindow"} == {1, 2, 3, 4}
    # A keep update: tokens computed with new weights over KV of old ones (the two labels differ)...
    assert any(w != kv for r in log if r["a"] == "Land" for _, w, kv, _ in r["labs"])
    # Every token was drawn at its index in its request's seed's stream (R-SAMPLING): positions recorded, checked.
    assert all(draw >= 0 for r in log if r["a"] == "Land" for *_, draw in r["labs"])
    # ... the bound restarted the requests that fell two versions behind (their labels start again: one version)...
    finished = [r for r in log if r["a"] == "Output" and not r["arg"]]
    assert finished and all(len(r["w"]) == TOKENS for r in finished)
    assert any(len(set(r["w"])) == 1 and r["w"][0] >= 3 for r in finished[:3])
    # ... and the abort ended requests, failed.
    assert any(r["a"] == "Output" and r["arg"] for r in log)


def _index(log: list[dict], predicate, after: int = 0) -> int:
    return next(k for k, r in enumerate(log) if k >= after and predicate(r))


def _forge_read_back_label(log: list[dict]) -> list[dict]:
    """A token labelled with a version other than its step's (as upstream's async batching would, read back after
    a window): the first Land after the first update claims the next version."""
    update = _index(log, lambda r: r["a"] == "Update")
    land = _index(log, lambda r: r["a"] == "Land" and r["labs"], update)
    q, w, kv, draw = log[land]["labs"][0]
    log[land]["labs"][0] = (q, w + 1, kv, draw)
    return log


def _forge_fresh_kv(log: list[dict]) -> list[dict]:
    """A token that claims KV of the new weights after a keep window kept the old KV (D6's lie)."""
    land = _index(log, lambda r: r["a"] == "Land" and any(w != kv for _, w, kv, _ in r["labs"]))
    log[land]["labs"] = [(q, w, w, draw) for q, w, _, draw in log[land]["labs"]]
    return log


def _forge_step_in_window(log: list[dict]) -> list[dict]:
    """A forward step inside a window: the first Launch and Land after an OpenWindow moved before its CloseWindow."""
    opened = _index(log, lambda r: r["a"] == "OpenWindow")
    closed = _index(log, lambda r: r["a"] == "CloseWindow", opened)
    launch = _index(log, lambda r: r["a"] == "Launch", closed)
    step = log[launch : launch + 2]
    del log[launch : launch + 2]
    log[closed:closed] = step
    return log


def _forge_admission_in_drain(log: list[dict]) -> list[dict]:
    """A drain that admits a new request: a request submitted later, its Submit moved before the drain, is in the
    drain's first step."""
    drain = _index(log, lambda r: r["a"] == "DrainFirst")
    launch = _index(log, lambda r: r["a"] == "Launch", drain)
    submit = _index(log, lambda r: r["a"] == "Submit", launch)
    later = log.pop(submit)
    log.insert(drain, later)
    launch = _index(log, lambda r: r["a"] == "Launch", drain + 1)
    assert later["q"] not in log[launch]["set"]
    log[launch]["set"] = sorted([*log[launch]["set"], later["q"]])
    return log


def _forge_output_labels(log: list[dict]) -> list[dict]:
    """An output whose labels are not its tokens' (one label changed)."""
    out = _index(log, lambda r: r["a"] == "Output" and r["w"])
    log[out]["w"] = [log[out]["w"][0] + 1, *log[out]["w"][1:]]
    return log


def _forge_abort_not_failed(log: list[dict]) -> list[dict]:
    """A request the abort ended, delivered as if it had succeeded."""
    out = _index(log, lambda r: r["a"] == "Output" and r["arg"])
    log[out]["arg"] = 0
    return log


def _forge_no_restart(log: list[dict]) -> list[dict]:
    """A request the staleness bound had to restart goes on with its old labels: its tokens after the retract window
    claim to extend the sequence the spec restarted (the Output of a restarted request with one old label)."""
    out = _index(log, lambda r: r["a"] == "Output" and not r["arg"] and r["w"][0] >= 3)
    log[out]["w"] = [0, *log[out]["w"][1:]]
    log[out]["kv"] = [0, *log[out]["kv"][1:]]
    return log


def _forge_draw_off_by_one(log: list[dict]) -> list[dict]:
    """A token drawn at the position of the token before it (a stream that does not move on: two tokens drawn
    alike)."""
    land = _index(log, lambda r: r["a"] == "Land" and any(draw > 0 for *_, draw in r["labs"]))
    q, w, kv, draw = next(t for t in log[land]["labs"] if t[3] > 0)
    log[land]["labs"] = [t if t[0] != q else (q, w, kv, draw - 1) for t in log[land]["labs"]]
    return log


def _forge_draw_after_retract_from_zero(log: list[dict]) -> list[dict]:
    """A request the retract window prefilled again that draws from its stream's start (as a sampler that forgot the
    tokens the retract kept would): its first token after the window claims position 0."""
    retract = _index(log, lambda r: r["a"] == "OpenWindow" and r["arg"] == 2)
    land = _index(log, lambda r: r["a"] == "Land" and any(draw > 0 for *_, draw in r["labs"]), retract)
    log[land]["labs"] = [(q, w, kv, 0 if draw > 0 else draw) for q, w, kv, draw in log[land]["labs"]]
    return log


FORGERIES = {
    "a token drawn at its predecessor's position": _forge_draw_off_by_one,
    "a retracted request drawing from its stream's start": _forge_draw_after_retract_from_zero,
    "a token labelled at read-back": _forge_read_back_label,
    "fresh KV claimed after a keep update": _forge_fresh_kv,
    "a forward step inside a window": _forge_step_in_window,
    "a drain that admits a new request": _forge_admission_in_drain,
    "an output's labels not its tokens'": _forge_output_labels,
    "an aborted request delivered as a success": _forge_abort_not_failed,
    "a stale request not restarted": _forge_no_restart,
}


@pytest.mark.parametrize("lie", list(FORGERIES))
def test_a_forged_label_log_is_rejected(traced, lie, tmp_path, tlc_ready):
    log, constants = traced
    forged = FORGERIES[lie](copy.deepcopy(log))
    assert forged != log
    result = check(forged, constants, tmp_path)
    assert not result.accepted, f"TLC accepted the log with {lie}"


def test_a_step_of_many_new_requests_costs_tlc_states_linear_in_them(tmp_path, tlc_ready):
    """Hostile review: the replay admitted a step's new requests in every order (2^N states for N of them: a real run
    with 64 in its first step never finished); one order covers them all."""
    n = 24
    log = [{"a": "Submit", "q": q, "arg": 1, "set": [], "labs": [], "w": [], "kv": []} for q in range(1, n + 1)]
    log.append({"a": "Launch", "q": 0, "arg": 0, "set": list(range(1, n + 1)), "labs": [], "w": [], "kv": []})
    log.append({"a": "Land", "q": 0, "arg": 0, "set": [], "labs": [(q, 0, 0, -1) for q in range(1, n + 1)], "w": [],
                "kv": []})  # fmt: skip
    log += [{"a": "Output", "q": q, "arg": 0, "set": [], "labs": [], "w": [0], "kv": [0]} for q in range(1, n + 1)]
    result = validate(log, TLA_DIR, 1, tmp_path)
    assert result.accepted, result.output[-2000:]
    assert result.states < 10 * n, result.states
