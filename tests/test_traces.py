"""Trace validation: traces of real threaded runs are behaviours of the TLA+ spec; a wrong one is not."""

import dataclasses
import threading

import pytest

from cbpause import PauseProtocol, TraceRecorder
from cbpause.testing import HANG_S, JOIN_TIMEOUT, Group
from cbpause.tlc.traces import describe_rejection, validate

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("verify")


def paused_group_trace():
    """Two ranks, a holder pausing each, then a hard stop: a small trace with a pause window.  (A rank whose holder
    comes later than its peer's parks for it: ``peer_park_timeout`` must not run out however slow the machine.)"""
    recorder = TraceRecorder()
    group = Group(2, peer_park_timeout=HANG_S, trace=recorder).start()
    inside = threading.Barrier(3)
    done = threading.Event()

    def holder(p):
        p.acquire_pause(None)
        inside.wait(HANG_S)
        done.wait(HANG_S)
        p.release_pause()

    threads = [threading.Thread(target=holder, args=(p,), daemon=True) for p in group.ranks]
    for th in threads:
        th.start()
    inside.wait(HANG_S)
    done.set()
    for th in threads:
        th.join(JOIN_TIMEOUT)
    group.ranks[0].request_stop(PauseProtocol.HARD_STOP, 0)
    assert group.join()
    return recorder


def test_a_pause_window_trace_is_accepted(tmp_path, tlc_ready):
    recorder = paused_group_trace()
    actions = [e.action for e in recorder.events]
    assert "OpenWindow" in actions and "EnterPause" in actions and "Barrier" in actions
    assert validate(recorder, TLA_DIR, tmp_path).accepted


def test_a_forward_step_while_a_holder_is_inside_is_rejected(tmp_path, tlc_ready):
    recorder = paused_group_trace()
    events = list(recorder.events)
    k = next(i for i, e in enumerate(events) if e.action == "EnterPause")
    rank = events[k].rank
    own = [e for e in events[:k] if e.rank == rank and e.action not in ("RequestPause", "EnterPause")]
    # Forge a step of the holder's rank right after it entered: the spec forbids it (ExclusionInv).
    forged = dataclasses.replace(events[k], action="StartStep", holder=None, state=own[-1].state._replace(phase="step"))
    events.insert(k + 1, forged)
    result = validate(recorder, TLA_DIR, tmp_path, events=events)
    assert not result.accepted
    assert result.matched == k + 1  # everything before the forged step matched
    assert ">>" in describe_rejection(recorder, result, events)


def test_recording_is_off_by_default():
    assert PauseProtocol()._trace is None


def pause_after_stop_trace(stop: int | None):
    """One rank: a stop asked (``stop``, or none), then a holder's RequestPause record, forged (the code refuses
    that pause once a stop is asked, so it records none): the state a granted pause would have left."""
    from cbpause.core import transitions as t
    from cbpause.core.recorder import TraceEvent
    from cbpause.tlc.traces import Trace

    recorder = TraceRecorder()
    protocol = PauseProtocol(trace=recorder)
    if stop is not None:
        protocol.request_stop(stop, 0)
    state = protocol.state
    granted = t.request_pause(state, t.KEEP)  # the pure step, without its guard
    forged = TraceEvent("RequestPause", 0, 0, t.KEEP, granted, "waiting", 0)
    return Trace([*recorder.events, forged], [0], 1)


def test_a_pause_granted_after_a_flush_stop_is_rejected(tmp_path, tlc_ready):
    """R-STOP-RETURNS (the D7 fix): no new pause once a stop is asked.  The trace spec reads the spec's own guard,
    so a trace in which the real code granted one would fail validation."""
    from cbpause.core.transitions import FLUSH_AND_STOP

    assert validate(pause_after_stop_trace(None), TLA_DIR, tmp_path / "none").accepted  # the forgery is well formed
    trace = pause_after_stop_trace(FLUSH_AND_STOP)
    result = validate(trace, TLA_DIR, tmp_path / "flush")
    assert not result.accepted
    assert result.matched == 1, describe_rejection(trace, result)  # the stop matched, the pause did not


def test_trace_validation_follows_a_guard_changed_in_the_spec(tla_copy, tmp_path, tlc_ready):
    """One home per guard: loosen RequestPause's D7 guard in a copy of PauseProtocol.tla (back to what it was
    before the D7 fix, a pause allowed under a flush stop) and the trace spec, unchanged, accepts the trace it
    rejected: it evaluates the spec's guard, not a restatement of it."""
    from cbpause.core.transitions import FLUSH_AND_STOP

    spec = tla_copy / "PauseProtocol.tla"
    lines = spec.read_text().splitlines(keepends=True)
    tagged = [n for n, line in enumerate(lines) if "\\* guard:D7" in line]
    assert len(tagged) == 1, "expected exactly one line tagged guard:D7"
    assert "ls = DONT_STOP" in lines[tagged[0]]
    lines[tagged[0]] = lines[tagged[0]].replace("ls = DONT_STOP", "ls < HARD_STOP")
    spec.write_text("".join(lines))
    trace = pause_after_stop_trace(FLUSH_AND_STOP)
    assert validate(trace, tla_copy, tmp_path / "loose").accepted
    assert not validate(trace, TLA_DIR, tmp_path / "strict").accepted


def test_a_request_record_keeps_its_action_name():
    """PauseProtocol records a request's step under its TLA+ action name, which action_of leaves as it is."""
    from cbpause.core.recorder import REQUEST_RECORDS, action_of

    assert all(action_of(a) == a for a in REQUEST_RECORDS)


def _group_iteration_trace(late: bool) -> list:
    """Two ranks, hand-written from the transitions: request 0 is drained, agreed, broadcast by rank 0 (rank 1's
    record of the same broadcast comes ``late``: after rank 0 delivered request 0 (failed alone at admission), idled,
    drained request 1 and observed, as a real TP=2 trace had it), then rank 1 idles and observes."""
    from cbpause.core import transitions as t
    from cbpause.core.recorder import TraceEvent

    s = [t.RankState(), t.RankState()]
    events = []

    def rec(action, rank, fn=None, *args, request="", argument=0):
        if fn is not None:
            s[rank] = fn(s[rank], *args)
        events.append(TraceEvent(action, rank, None, argument, s[rank], "", len(events), request))

    rec("Submit", 0, request="req_0", argument=1)
    rec("Drain", 0, request="req_0")
    rec("Observe", 0, t.observe)
    rec("Observe", 1, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, 0)
    rec("AllReduce", 1, t.all_reduce, 0, 0)
    rec("NoPause", 0, t.no_pause)
    rec("NoPause", 1, t.no_pause)
    rec("Broadcast", 0)
    peer = len(events)
    rec("Broadcast", 1)
    rec("Deliver", 0, request="req_0")  # failed alone at its admission: the driver has no work
    rec("Idle", 0, t.idle)
    rec("Submit", 0, request="req_1", argument=1)
    rec("Drain", 0, request="req_1")
    rec("Observe", 0, t.observe)
    if late:  # rank 1 had not recorded its part of the broadcast yet
        events.append(events.pop(peer))
    rec("Idle", 1, t.idle)  # the body of the iteration before: the next payload is not its iteration's
    rec("Observe", 1, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, 0)
    return events


@pytest.mark.parametrize("late", [False, True])
def test_a_peer_finishes_its_iteration_after_the_driver_took_its_next_payload(late, tmp_path, tlc_ready):
    """Once the broadcast returned (or the all-reduce agreed no payload), the driver needs no peer until its next
    all-reduce: it may idle, drain the next requests and observe before the peer records its Broadcast and its Idle.
    The spec allows it (``PayloadPending``: a peer in the body of the iteration before does not wait for the next
    payload; the model had it time out at a broadcast nobody sent), and so does the trace spec (its ``owed``: a
    peer's Broadcast record after the driver's took the step).  A real TP=2 trace came out so in 2 runs of 7 and was
    rejected (issue 38)."""
    from cbpause.tlc.traces import Trace

    trace = Trace(_group_iteration_trace(late), [], 2)
    result = validate(trace, TLA_DIR, tmp_path)
    assert result.accepted, describe_rejection(trace, result)
