"""Traces of transformers' real loop are behaviours of the TLA+ spec, and a trace altered in one place is not.

One short scenario on a tiny random Llama (holders pausing while requests flow, then a stop), recorded by
``PauseProtocol(trace=...)`` under the integration, is validated by TLC; then the same trace with one loop
action removed, with a holder entering before its window opened, and with a holder's record claiming a state
the rank was not in, is rejected at exactly the altered record.
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.apps.scenarios.coverage import Coverage  # noqa: E402
from cbpause.apps.scenarios.episodes import quiet_logs  # noqa: E402
from cbpause.apps.scenarios.real import run_single  # noqa: E402
from cbpause.core.transitions import HARD_STOP  # noqa: E402
from cbpause.testing import ForwardProbe, tiny_llama  # noqa: E402
from cbpause.tlc.traces import Trace, describe_rejection, validate  # noqa: E402

from .conftest import TLA_DIR  # noqa: E402

pytestmark = pytest.mark.layer("verify")


def recorded(plan: list) -> Trace:
    """One single-rank scenario of ``plan`` on the real loop (seed 7), which must lose nothing: its trace."""
    quiet_logs()
    model = tiny_llama("cpu", 7)
    probe = ForwardProbe()
    probe.attach(model)
    trace, info = run_single(model, probe, plan, seed=7)
    assert info["errors"] == [] and info["lost"] == 0 and info["duplicated"] == 0, info
    return trace


@pytest.fixture(scope="module")
def real_trace() -> Trace:
    return recorded([("holders", None), ("request_at", "step")])


def altered(trace: Trace, events: list) -> Trace:
    return Trace(events, list(trace.holder_rank), trace.n_ranks)


def first(events: list, action: str, after: int = 0) -> int:
    return next(i for i, e in enumerate(events) if i >= after and e.action == action)


def test_a_real_loop_trace_is_accepted_and_takes_the_loop_actions(real_trace, tmp_path, tlc_ready):
    result = validate(real_trace, TLA_DIR, tmp_path)
    assert result.accepted, describe_rejection(real_trace, result)
    assert result.steps == len(real_trace.events)
    actions = {e.action for e in real_trace.events}
    loop = {"Observe", "AllReduce", "NoPause", "StartStep", "EndStep", "OpenWindow", "CloseWindow", "Barrier"}
    assert loop <= actions
    assert {"RequestPause", "EnterPause", "LeavePause", "RequestStop", "ExitLoop"} <= actions
    coverage = Coverage()
    coverage.add(real_trace.events, 1)
    assert ("body", "StartStep", "step") in coverage.seen  # forward steps run in phase step


def test_a_real_loop_trace_carries_its_requests_from_submit_to_delivery(real_trace):
    """Issue 24, point 3: every accepted request of the real loop is drained, broadcast and delivered exactly once in
    its trace, so TLC checks NothingLostInv and DeliveredAtEnd against what the loop did."""
    events = real_trace.events
    accepted = [e.request for e in events if e.action == "Submit" and e.argument == 1]
    delivered = [e.request for e in events if e.action == "Deliver"]
    drained = [e.request for e in events if e.action == "Drain"]
    assert len(accepted) >= 3
    assert sorted(delivered) == sorted(accepted) and sorted(drained) == sorted(accepted)
    assert any(e.action == "Broadcast" for e in events)
    assert events[-1].action in ("ExitLoop", "Deliver")


def test_a_real_trace_that_delivers_a_request_twice_is_rejected(real_trace, tmp_path, tlc_ready):
    events = list(real_trace.events)
    k = first(events, "Deliver", after=len(events) // 3)
    events.insert(k + 1, events[k])
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == k + 1  # the second delivery matches no step of the spec


def test_a_real_trace_whose_loop_ends_with_an_accepted_request_undelivered_is_rejected(real_trace, tmp_path,
                                                                                      tlc_ready):  # fmt: skip
    """The last request to finish never gets its output: the flush stop cannot end the loop with it in the batch."""
    events = list(real_trace.events)
    k = max(i for i, e in enumerate(events) if e.action == "Deliver")
    assert any(e.request == events[k].request for e in events[:k] if e.action == "Submit")
    del events[k]
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == first(events, "ExitLoop", after=k)


@pytest.fixture(scope="module")
def hard_stop_trace() -> Trace:
    """A hard stop while requests are in the batch (then a restart): their failed outputs come after ExitLoop."""
    return recorded([("stop_at", "step")])


def test_a_real_trace_that_ends_with_a_failed_request_undelivered_is_rejected(hard_stop_trace, tmp_path, tlc_ready):
    """The loop exited, failing what it held, and one of those outputs never reached its caller: every record still
    matches (the loop's steps do not wait for a caller), and the trace ends breaking DeliveredAtEnd."""
    events = list(hard_stop_trace.events)
    assert validate(altered(hard_stop_trace, events), TLA_DIR, tmp_path / "as-recorded").accepted
    exit_loop = first(events, "ExitLoop")
    k = first(events, "Deliver", after=exit_loop)
    del events[k]
    result = validate(altered(hard_stop_trace, events), TLA_DIR, tmp_path / "forged")
    assert not result.accepted
    assert result.violated == "DeliveredAtEnd", result.output[-2000:]
    assert result.matched == len(events)


def test_a_real_trace_whose_broadcast_is_missing_is_rejected_at_the_next_step(real_trace, tmp_path, tlc_ready):
    """A request drained and never carried to the scheduler (the loss of issue 24) leaves it in hand: no step of the
    batch may start."""
    events = list(real_trace.events)
    k = first(events, "Broadcast")
    del events[k]
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == first(events, "StartStep", after=k)


@pytest.mark.parametrize("action", ["NoPause", "StartStep", "Barrier"])
def test_a_real_trace_with_one_loop_action_removed_is_rejected(action, real_trace, tmp_path, tlc_ready):
    events = list(real_trace.events)
    k = first(events, action, after=len(events) // 4)
    del events[k]
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == k  # everything before the gap matched, the record after it does not


def test_a_holder_entering_before_the_window_opened_is_rejected(real_trace, tmp_path, tlc_ready):
    events = list(real_trace.events)
    opened = first(events, "OpenWindow")
    entered = first(events, "EnterPause", after=opened)
    enter = events.pop(entered)
    events.insert(opened, enter)  # the holder claims to be inside while the loop is still deciding
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == opened
    assert ">>" in describe_rejection(altered(real_trace, events), result)


def test_a_holder_record_claiming_a_state_the_rank_was_not_in_is_rejected(real_trace, tmp_path, tlc_ready):
    events = list(real_trace.events)
    k = first(events, "RequestPause")
    forged = events[k].state._replace(phase="step", tp_status=HARD_STOP, local_status=HARD_STOP)
    events[k] = dataclasses.replace(events[k], state=forged)
    result = validate(altered(real_trace, events), TLA_DIR, tmp_path)
    assert not result.accepted
    assert result.matched == k


def test_a_peer_killed_with_requests_in_transit_loses_none(tmp_path, tlc_ready):
    """The TP=2 plan ``kill_payload``: rank 1 dies after the all-reduce that agreed rank 0's non-empty payload, before
    the broadcast that would carry it.  Rank 0's broadcast fails with the drained requests in hand; each gets its
    terminal output (issue 24: before the fix, 1 to 3 of them were lost in every run), and the group's trace is a
    behaviour of the spec."""
    from cbpause.apps.scenarios.real import run_tp

    checkpoint = tmp_path / "ckpt"
    tiny_llama("cpu", 3).save_pretrained(checkpoint)
    trace, info = run_tp("kill_payload", str(checkpoint), seed=24, workdir=tmp_path)
    assert info["errors"] == [], info["errors"]
    assert info["killed"] == [1], "rank 1 was not killed at the broadcast"
    assert info["lost"] == 0 and info["duplicated"] == 0, info
    result = validate(trace, TLA_DIR, tmp_path / "v")
    assert result.accepted, describe_rejection(trace, result)


def test_a_peer_whose_forward_step_fails_ends_both_ranks(tmp_path, tlc_ready):
    """The TP=2 plan ``fatal``: rank 1's forward step raises before the model's own collectives, so rank 0 waits in
    one that rank 1 never joins.  Rank 1's fatal error must end the group within the product's bounds on a peer (rank 0
    learns of it when rank 1's group collective runs out and its process leaves), and the group's trace must be a
    behaviour of the spec.  Run with the bounds of a slow peer (HANG_S), this plan hung until the campaign's 300 s
    deadline (found by the full real-loop campaign, which was the only place it ran)."""
    from cbpause.apps.scenarios.real import run_tp
    from cbpause.apps.scenarios.tp import TIMEOUT_PLANS

    assert "fatal" in TIMEOUT_PLANS
    checkpoint = tmp_path / "ckpt"
    tiny_llama("cpu", 3).save_pretrained(checkpoint)
    trace, info = run_tp("fatal", str(checkpoint), seed=40, workdir=tmp_path)
    assert info["errors"] == [], info["errors"]
    assert info["lost"] == 0 and info["duplicated"] == 0, info
    result = validate(trace, TLA_DIR, tmp_path / "v")
    assert result.accepted, describe_rejection(trace, result)
    assert any("Fatal" in e.action for e in trace.events), "rank 1's fault never reached the trace"


@pytest.mark.parametrize("episode", ["fail_at", "request_at"])
def test_a_traced_loop_without_peers_still_rests_at_the_barrier_for_the_episodes_there(episode):
    """Issue 38's last hostile review: once a loop without peers took P-BARRIER in its window's own call, the phase
    ``barrier`` was never seen by another thread, and the campaign's episodes there did nothing (``fail_at``'s fault
    never fired and the episode waited out its bound).  A loop that records a trace steps through the barrier on its
    own: the episode takes the transition it is there for."""
    from cbpause.apps.scenarios.episodes import EPISODES

    trace = recorded([(episode, "barrier")])
    coverage = Coverage()
    coverage.add(trace.events, 1)
    wanted = EPISODES[episode][2]("barrier")
    assert wanted <= coverage.seen, (wanted, sorted(t for t in coverage.seen if t[0] == "barrier"))
