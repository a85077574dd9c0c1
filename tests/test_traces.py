"""Trace validation: traces of real threaded runs are behaviours of the TLA+ spec; a wrong one is not."""

import dataclasses
import threading

import pytest

from cbpause import PauseProtocol, TraceRecorder
from cbpause.core.transitions import DRAIN
from cbpause.testing import HANG_S, JOIN_TIMEOUT, Group
from cbpause.tlc.traces import describe_rejection, validate

from .conftest import TLA_DIR

pytestmark = pytest.mark.layer("verify")


class _Requests(TraceRecorder):
    """A recorder that says when ``n`` RequestPause records have come in."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.requested = threading.Event()

    def record(self, *args, **kwargs):
        super().record(*args, **kwargs)
        if sum(e.action == "RequestPause" for e in self.events) >= self.n:
            self.requested.set()


def paused_group_trace():
    """Two ranks, a holder pausing each, then a hard stop: a small trace with a pause window.

    The same trace however slow the machine: the holders ask before the loops start and the stop is asked while they
    are inside, so no rank steps freely while a thread is scheduled (under load, free-running loops made traces of
    thousands of steps, and TLC took minutes on one).  A rank whose holder comes later than its peer's parks for it:
    ``peer_park_timeout`` must not run out however slow the machine."""
    recorder = _Requests(2)
    group = Group(2, peer_park_timeout=HANG_S, trace=recorder)
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
    assert recorder.requested.wait(HANG_S)
    group.start()
    inside.wait(HANG_S)
    group.ranks[0].request_stop(PauseProtocol.HARD_STOP, 0)
    done.set()
    for th in threads:
        th.join(JOIN_TIMEOUT)
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


class _Log:
    """A trace written by hand from the transitions (ranks and the holder numbered from 0, as the recorder does)."""

    def __init__(self, n_ranks: int = 1):
        from cbpause.core import transitions as t

        self.t = t
        self.s = [t.RankState() for _ in range(n_ranks)]
        self.events: list = []
        self.n_ranks = n_ranks

    def rec(self, action, rank=0, fn=None, *args, request="", argument=0, holder=None, holder_state=""):
        from cbpause.core.recorder import TraceEvent

        if fn is not None:
            self.s[rank] = fn(self.s[rank], *args)
        self.events.append(TraceEvent(action, rank, holder, argument, self.s[rank], holder_state, len(self.events),
                                      request))  # fmt: skip

    def trace(self, events=None):
        from cbpause.tlc.traces import Trace

        events = list(self.events if events is None else events)
        holders = sorted({e.holder for e in events if e.holder is not None})
        return Trace(events, [next(e.rank for e in events if e.holder == h) for h in holders], self.n_ranks)


def _group_iteration_trace(late: bool) -> list:
    """Two ranks, hand-written from the transitions: request 0 is drained, agreed, broadcast by rank 0 (rank 1's
    record of the same broadcast comes ``late``: after rank 0 delivered request 0 (failed alone at admission), idled,
    drained request 1 and observed, as a real TP=2 trace had it), then rank 1 idles and observes."""
    log = _Log(2)
    t, rec, events = log.t, log.rec, log.events
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


def _queue_trace(forge: bool = False) -> _Log:
    """One rank, three holders: A and B share a window, A leaves (it is closing), C asks and is queued, B leaves,
    which closes the window and makes C waiting; C enters the next window.  ``forge``: C queues while the window
    is open and not closing yet (before A leaves), which the code never does."""
    log = _Log()
    t, rec = log.t, log.rec
    keep = t.KEEP

    def holder(action, fn, h, after, *args, argument=0):
        rec(action, 0, fn, *args, argument=argument, holder=h, holder_state=after)

    holder("RequestPause", t.request_pause, 0, "waiting", keep, argument=keep)
    rec("Observe", 0, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, keep)
    rec("OpenWindow", 0, t.open_window)
    holder("EnterPause", t.enter_pause, 0, "inside")
    holder("RequestPause", t.request_pause, 1, "waiting", keep, argument=keep)
    holder("EnterPause", t.enter_pause, 1, "inside")
    if forge:
        holder("QueuePause", t.queue_pause, 2, "queued", keep, argument=keep)
    holder("LeavePause", t.leave_pause, 0, "idle", keep)  # the window is closing
    if not forge:
        holder("QueuePause", t.queue_pause, 2, "queued", keep, argument=keep)
    holder("LeavePause", t.leave_pause, 1, "idle", keep, (keep,))  # closes it: C waits, counted
    rec("CloseWindow", 0, t.close_window)
    rec("Barrier", 0, t.barrier)
    rec("Idle", 0, t.idle)
    rec("Observe", 0, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, keep)
    rec("OpenWindow", 0, t.open_window)
    holder("EnterPause", t.enter_pause, 2, "inside")
    holder("LeavePause", t.leave_pause, 2, "idle", keep)
    return log


def test_a_holder_queued_at_a_closing_window_is_accepted_and_one_queued_at_an_open_one_is_not(tmp_path, tlc_ready):
    """Issue 40, point 3: QueuePause, and the Drop that closes the window making the queued holder waiting, as the
    code records them; a QueuePause at a window that is not closing is refused at that record."""
    log = _queue_trace()
    assert [e.state.count for e in log.events if e.action == "LeavePause"] == [1, 1, 0]  # C counted by B's leave
    result = validate(log.trace(), TLA_DIR, tmp_path / "ok")
    assert result.accepted, describe_rejection(log.trace(), result)
    forged = _queue_trace(forge=True)
    result = validate(forged.trace(), TLA_DIR, tmp_path / "forged")
    at = next(n for n, e in enumerate(forged.events) if e.action == "QueuePause")
    assert not result.accepted and result.matched == at, describe_rejection(forged.trace(), result)


def _drain_trace(forge: str = "") -> _Log:
    """One rank, one holder asking for a drain while request ``a`` is in flight: the first decisions find the batch
    busy (DrainFirst), a step ends ``a``, the next decision opens the window.  Request ``b``, submitted during the
    drain, is taken from the queue and carried to the scheduler, which holds it (``Admits``) until the window has
    closed: its first step comes after.  ``forge`` writes what the code never does: ``"window-in-flight"``, the
    window opened at the first decision, ``a`` still in flight; ``"admit"``, ``b``'s first step during the drain."""
    log = _Log()
    t, rec = log.t, log.rec
    rec("Submit", request="a", argument=1)
    rec("Drain", request="a")
    rec("Observe", 0, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, 0)
    rec("NoPause", 0, t.no_pause)
    rec("Broadcast")
    rec("StartStep", 0, t.start_step)
    rec("EndStep", 0, t.end_step)
    rec("FirstStep", request="a")  # a is in flight
    rec("RequestPause", 0, t.request_pause, t.DRAIN, argument=t.DRAIN, holder=0, holder_state="waiting")
    rec("Observe", 0, t.observe)
    if forge == "window-in-flight":
        rec("AllReduce", 0, t.all_reduce, 0, t.DRAIN, False)  # the batch claimed empty
        rec("OpenWindow", 0, t.open_window)
        return log
    rec("AllReduce", 0, t.all_reduce, 0, t.DRAIN, True)
    rec("DrainFirst", 0, t.drain_first)
    rec("Submit", request="b", argument=1)
    rec("StartStep", 0, t.start_step)
    rec("EndStep", 0, t.end_step)
    rec("Drain", request="b")  # taken from the queue; the scheduler will hold it
    rec("Observe", 0, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, t.DRAIN, True)  # a is still in flight
    rec("DrainFirst", 0, t.drain_first)
    rec("Broadcast")
    rec("StartStep", 0, t.start_step)
    if forge == "admit":
        rec("EndStep", 0, t.end_step)
        rec("FirstStep", request="b")  # the drain holds admission: b never runs before the window
        return log
    rec("Deliver", request="a")  # a's last token
    rec("EndStep", 0, t.end_step)
    rec("Observe", 0, t.observe)
    rec("AllReduce", 0, t.all_reduce, 0, t.DRAIN, False)
    rec("OpenWindow", 0, t.open_window)
    rec("EnterPause", 0, t.enter_pause, holder=0, holder_state="inside")
    rec("LeavePause", 0, t.leave_pause, t.DRAIN, holder=0, holder_state="idle")
    rec("CloseWindow", 0, t.close_window)
    rec("Barrier", 0, t.barrier)
    rec("StartStep", 0, t.start_step)
    rec("EndStep", 0, t.end_step)
    rec("FirstStep", request="b")
    rec("Deliver", request="b")
    rec("Observe", 0, t.observe)
    return log


def test_a_drain_trace_with_a_request_in_flight_is_accepted(tmp_path, tlc_ready):
    """The trace sees the drain: the first decision is DrainFirst because ``a`` is in flight (its FirstStep record),
    and the window opens at the decision after ``a`` was delivered."""
    trace = _drain_trace().trace()
    result = validate(trace, TLA_DIR, tmp_path)
    assert result.accepted, describe_rejection(trace, result)


# The audit's forged logs (issue 40, point 2): each is a behaviour the code never has, which the trace spec accepted.
FORGED = {
    "a drain opens its window with a request in flight": lambda: _drain_trace("window-in-flight"),
    "a drain admits a new request into its batch": lambda: _drain_trace("admit"),
}


@pytest.mark.parametrize("forgery", sorted(FORGED))
def test_a_forged_drain_is_rejected(forgery, tmp_path, tlc_ready):
    log = FORGED[forgery]()
    result = validate(log.trace(), TLA_DIR, tmp_path)
    forged = next(n for n, e in enumerate(log.events)  # the first record the code never writes
                  if e.action == "AllReduce" and e.state.tp_pause == DRAIN and not e.state.draining
                  or e.action == "FirstStep" and e.request == "b")  # fmt: skip
    assert not result.accepted and result.matched == forged, describe_rejection(log.trace(), result)


def test_a_second_all_reduce_record_of_one_iteration_is_rejected(tmp_path, tlc_ready):
    """A rank records its part of a group step once: a second ``AllReduce`` record in the same iteration (the trace
    spec once took it as a lagging rank catching up, lagging or not) is refused."""
    log = _drain_trace()
    k = next(n for n, e in enumerate(log.events) if e.action == "AllReduce")
    events = [*log.events[: k + 1], log.events[k], *log.events[k + 1 :]]
    assert validate(log.trace(), TLA_DIR, tmp_path / "as-recorded").accepted
    result = validate(log.trace(events), TLA_DIR, tmp_path / "forged")
    assert not result.accepted and result.matched == k + 1


def test_a_late_broadcast_record_outside_the_body_is_rejected(tmp_path, tlc_ready):
    """A peer records its part of a broadcast late (after the driver took its next payload) but before its own next
    step: once it has idled and observed, a ``Broadcast`` record of it, with nothing in hand, is refused."""
    from cbpause.tlc.traces import Trace

    events = _group_iteration_trace(late=True)
    k = next(n for n, e in enumerate(events) if e.action == "Broadcast" and e.rank == 1)
    observe = next(n for n, e in enumerate(events) if e.action == "Observe" and e.rank == 1 and n > k)
    forged = events[:k] + events[k + 1 : observe + 1] + [events[k]] + events[observe + 1 :]
    assert validate(Trace(events, [], 2), TLA_DIR, tmp_path / "as-recorded").accepted
    result = validate(Trace(forged, [], 2), TLA_DIR, tmp_path / "forged")
    assert not result.accepted and result.matched == observe  # the moved record is the first one refused


def test_a_trace_is_checked_against_every_invariant_the_spec_s_models_check():
    """One home for the list: every invariant (and action property) a PauseProtocol model checks, outside the
    witnesses, is one TLC checks on every replayed state of a trace (``cbpause.tlc.traces.TRACE_INVARIANTS``)."""
    from cbpause.tlc.manifest import Cfg
    from cbpause.tlc.traces import TRACE_INVARIANTS, TRACE_PROPERTIES

    checked = set()
    for cfg in TLA_DIR.glob("MCPauseProtocol_*.cfg"):  # (the Entry models add a ghost counter)
        checked |= {n for n in Cfg.read(cfg).names("INVARIANT") if not n.endswith("Witness") and n != "IndInv"}
        checked |= {n for n in Cfg.read(cfg).names("PROPERTY") if n.endswith("Inv")}
    assert checked, "no model read"
    assert checked <= set(TRACE_INVARIANTS) | set(TRACE_PROPERTIES), checked - set(TRACE_INVARIANTS)


@pytest.mark.parametrize("recorded", [True, False])
def test_a_peer_idles_once_its_copy_of_a_cancelled_request_left_its_scheduler(recorded, tmp_path, tlc_ready):
    """A request cancelled at once: the payload carries it and its cancellation to both ranks; the peer's scheduler
    drops its copy and the peer idles before the driver's output of it is recorded (a real TP=2 trace had that order
    and was rejected).  The peer's ``PeerDrop`` record makes its Idle a step of the spec; without it the Idle of a
    rank whose batch has work is refused."""
    log = _Log(2)
    t, rec = log.t, log.rec
    rec("Submit", 0, request="req_0", argument=1)
    rec("Drain", 0, request="req_0")
    for r in (0, 1):
        rec("Observe", r, t.observe)
    for r in (0, 1):
        rec("AllReduce", r, t.all_reduce, 0, 0)
    for r in (0, 1):
        rec("NoPause", r, t.no_pause)
    rec("Broadcast", 1)
    if recorded:
        rec("PeerDrop", 1, request="req_0")
    rec("Idle", 1, t.idle)
    rec("Broadcast", 0)
    rec("Deliver", 0, request="req_0")
    rec("Idle", 0, t.idle)
    result = validate(log.trace(), TLA_DIR, tmp_path)
    assert result.accepted == recorded, describe_rejection(log.trace(), result)
