"""PauseProtocol with real threads: upstream's pause behaviours we keep, and D1-D4 fixed.

The regression tests for D1, D2 and D4 run against upstream's ``BackgroundThreadStatus`` too (when
transformers is installed), where they must fail: ``xfail(strict=True)`` proves the tests detect the
defects.  Interrupts are real SIGINTs delivered to the waiting (main) thread with ``signal.pthread_kill``
(``cbpause.testing.Interrupter``).
Every thread is joined with a timeout; interleavings are forced with events in the loop's hooks.
"""

import functools
import math
import threading
from decimal import Decimal
from fractions import Fraction

import pytest

from cbpause import PauseProtocol, PeerParkTimeout
from cbpause.testing import HANG_S, JOIN_TIMEOUT, FakeLoop, Group, Interrupter, call_interrupted, run_thread

pytestmark = pytest.mark.layer("core")

try:
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus
except Exception:  # noqa: BLE001 - transformers (and torch) are optional for these tests
    BackgroundThreadStatus = None

WAIT = HANG_S  # bound on every wait for an event that must happen: a hang, not slowness
UPSTREAM_HANG_S = 2.0  # how long a strict xfail waits for what upstream's defect keeps from ever happening


def bound(make) -> float:
    """The wait for what must happen: ``WAIT`` for cbpause; for upstream, whose defect keeps it from ever happening
    (a strict xfail), a short one, which slowness cannot turn into a pass."""
    return WAIT if make is ours else UPSTREAM_HANG_S


def ours():
    return PauseProtocol(peer_park_timeout=5.0)


# Upstream's object needs transformers: those cases are the loop layer's (nox -s loop), ours the core's.
_UPSTREAM = [pytest.mark.layer("loop")] + (
    [pytest.mark.skip(reason="transformers is not installed")] if BackgroundThreadStatus is None else []
)
IMPLS = [pytest.param(ours, id="cbpause"), pytest.param(BackgroundThreadStatus, id="upstream", marks=_UPSTREAM)]


def upstream_fails(defect: str):
    """Parametrize over both; upstream must fail (strict xfail)."""
    xfail = pytest.mark.xfail(strict=True, reason=f"upstream transformers has {defect}")
    upstream = pytest.param(BackgroundThreadStatus, id="upstream", marks=[*_UPSTREAM, xfail])
    params = [pytest.param(ours, id="cbpause"), upstream]
    return pytest.mark.parametrize("make", params)


def started(make, **kw) -> FakeLoop:
    loop = FakeLoop(make(), **kw).start()
    assert loop.stepped.wait(WAIT), "the loop never stepped"
    return loop


# --------------------------------------------------------------------------------------------- kept behaviour


@pytest.mark.parametrize("make", IMPLS)
def test_pause_stops_the_loop_and_resume_restarts_it(make):
    loop = started(make)
    status = loop.status
    for _ in range(5):
        status.acquire_pause(loop.wake)
        loop.holders_inside += 1
        assert status.is_pause_requested(local=True)
        loop.holders_inside -= 1
        loop.stepped.clear()
        status.release_pause()
        assert loop.stepped.wait(WAIT), "the loop did not resume after the pause"
    assert loop.stop()
    assert loop.violations == []


@pytest.mark.parametrize("make", IMPLS)
def test_several_holders_keep_the_loop_paused_until_the_last_leaves(make):
    loop = started(make)
    status = loop.status
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    release_second = threading.Event()

    def second():
        status.acquire_pause(loop.wake)
        second_in.set()
        release_second.wait(WAIT)
        status.release_pause()

    status.acquire_pause(loop.wake)
    first_in.set()
    holder, box = run_thread(second)
    assert second_in.wait(WAIT), "a second holder on a paused loop must enter directly"
    steps = loop.steps
    status.release_pause()
    first_out.set()
    loop.stepped.clear()
    assert loop.steps == steps and not status.is_pause_requested(local=True)
    release_second.set()
    holder.join(JOIN_TIMEOUT)
    assert not holder.is_alive() and "error" not in box
    assert loop.stepped.wait(WAIT)
    assert loop.stop()


@pytest.mark.parametrize("make", IMPLS)
def test_stop_from_another_thread_waits_for_the_pause(make):
    loop = started(make)
    status = loop.status
    status.acquire_pause(loop.wake)
    stopper, box = run_thread(lambda: loop.stop(timeout=WAIT), name="stopper")
    # The stop is requested but the loop stays parked while we are inside.
    assert loop.thread.is_alive()
    status.release_pause()
    stopper.join(JOIN_TIMEOUT)
    assert box.get("result") is True


@pytest.mark.parametrize("make", IMPLS)
def test_pause_raises_when_loop_dies_with_the_error_as_cause(make):
    boom = ValueError("boom in forward")
    in_step, go = threading.Event(), threading.Event()

    def failing_step(loop):
        if loop.steps == 3:
            in_step.set()
            go.wait(WAIT)
            raise boom

    loop = FakeLoop(make(), hooks={"step": failing_step}).start()
    assert in_step.wait(WAIT)
    loop.wake.clear()
    holder, box = run_thread(lambda: loop.status.acquire_pause(loop.wake))
    assert loop.wake.wait(WAIT)  # the holder's request is pending
    go.set()
    holder.join(JOIN_TIMEOUT)
    assert not holder.is_alive()
    assert isinstance(box.get("error"), RuntimeError)
    assert box["error"].__cause__ is boom
    loop.thread.join(JOIN_TIMEOUT)
    with pytest.raises(RuntimeError) as info:
        loop.status.acquire_pause(loop.wake)
    assert info.value.__cause__ is boom


@pytest.mark.parametrize("make", IMPLS)
def test_interrupted_waiter_drops_its_request(make):
    """Upstream's behaviour: the request is dropped and the interrupt propagates (here via SIGINT)."""
    status = make()
    status.clear()  # a running loop that never reaches its all-reduce: the waiter waits
    requested = threading.Event()  # acquire_pause sets the loop's wake-up event once it has asked
    assert call_interrupted(lambda: status.acquire_pause(requested), requested, WAIT)
    assert not status.is_pause_requested(local=True)
    assert not status.is_pause_requested()


# ------------------------------------------------------------------------------------------------ defects


@upstream_fails("D1")
def test_d1_withdrawn_request_does_not_park_the_loop(make):
    """The loop read a pending request; then the only requester gets SIGINT and withdraws."""
    withdrawn = threading.Event()
    fired = []

    def interrupt_requester(loop):
        if loop.last_observed and not fired:
            fired.append(interrupter.fire())
            assert withdrawn.wait(WAIT)

    with Interrupter() as interrupter:
        loop = FakeLoop(make(), hooks={"observed": interrupt_requester}).start()
        assert loop.stepped.wait(WAIT)
        with pytest.raises(KeyboardInterrupt):
            try:
                loop.status.acquire_pause(loop.wake)
            finally:
                withdrawn.set()
    assert fired == [True]
    loop.stepped.clear()
    resumed = loop.stepped.wait(bound(make))
    stopped = loop.stop(hard=True, timeout=bound(make))
    assert resumed and stopped, "the loop parked with nobody to release it (D1)"


@upstream_fails("D2")
def test_d2_stray_release_raises_and_changes_nothing(make):
    loop = started(make)
    status = loop.status
    with pytest.raises(RuntimeError):
        status.release_pause()
    # The next pause still works.
    holder, box = run_thread(lambda: (status.acquire_pause(loop.wake), status.release_pause()))
    holder.join(bound(make))
    entered = not holder.is_alive() and "error" not in box
    stopped = loop.stop(hard=True, timeout=bound(make))
    assert entered and stopped, "after a stray release the next pause waits for ever (D2)"


@upstream_fails("D4")
def test_d4_pause_from_the_loop_thread_raises_at_once(make):
    outcome = {}

    def pause_from_loop(loop):
        if loop.steps == 2 and not outcome:
            try:
                loop.status.acquire_pause(loop.wake)
                outcome["entered"] = True
            except RuntimeError as exc:
                outcome["error"] = exc

    loop = FakeLoop(make(), hooks={"step": pause_from_loop}).start()
    assert loop.stepped.wait(WAIT)
    stopped = loop.stop(hard=True, timeout=bound(make))
    assert stopped and isinstance(outcome.get("error"), RuntimeError), "pause() from the loop thread deadlocks (D4)"
    assert loop.steps > 2  # generation went on


# ----------------------------------------------------------------------------------------- ours: new API


def test_pause_timeout_withdraws_the_request():
    status = ours()
    status.clear()  # running, but no loop thread reaches the all-reduce
    with pytest.raises(TimeoutError):
        status.acquire_pause(None, timeout=0.01)
    assert status.state.count == 0 and not status.is_pause_requested(local=True)


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, "1", True])
def test_invalid_timeouts_raise_value_error(bad):
    status = ours()
    status.clear()
    with pytest.raises(ValueError):
        status.acquire_pause(None, timeout=bad)
    assert status.state.count == 0


@pytest.mark.parametrize("bad", [0, 3, -1, 7, True])
def test_invalid_stop_status_raises_value_error(bad):
    status = ours()
    status.clear()
    with pytest.raises(ValueError):
        status.request_stop(bad, 0)
    assert status.local_status == status.DONT_STOP


def test_a_pause_before_the_loop_starts_waits_for_it_and_stops_refuse():
    """As upstream's: the object accepts a request before any loop ran (refusing a manager that is not running
    is the manager's job); a stopping or stopped loop refuses at once."""
    status = ours()
    with pytest.raises(TimeoutError):
        status.acquire_pause(None, timeout=0.01)  # accepted, then withdrawn: no loop came
    status.clear()  # nothing ran yet: changes nothing
    status.request_stop(status.HARD_STOP, 0)
    with pytest.raises(RuntimeError, match="is stopping"):
        status.acquire_pause(None)
    status.mark_as_stopped()
    with pytest.raises(RuntimeError, match="stopped"):
        status.acquire_pause(None)
    assert status.state.count == 0


def test_a_loop_picks_up_a_pause_asked_before_it_started():
    status = ours()
    hold = status.request_pause()
    loop = FakeLoop(status)
    loop.start()  # clear() keeps the request
    status.enter_pause(hold, timeout=WAIT)
    assert status.state.phase == "window"
    status.leave_pause(hold)
    assert loop.stop()


def test_release_from_another_thread_than_the_holder_raises():
    loop = started(ours)
    status = loop.status
    status.acquire_pause(loop.wake)
    other, box = run_thread(status.release_pause)
    other.join(JOIN_TIMEOUT)
    assert isinstance(box.get("error"), RuntimeError)
    assert status.state.inside == 1
    status.release_pause()
    assert loop.stop()


def test_clear_with_holders_inside_raises_and_changes_nothing():
    loop = started(ours)
    status = loop.status
    status.acquire_pause(loop.wake)
    before = status.state
    with pytest.raises(RuntimeError):
        status.clear()
    assert status.state == before
    status.release_pause()
    assert loop.stop()


def test_metrics_snapshot():
    loop = started(ours)
    status = loop.status
    for _ in range(3):
        status.acquire_pause(loop.wake)
        m = status.metrics()
        assert m.holders_inside == 1 and m.holders_waiting == 0
        status.release_pause()
    m = status.metrics()
    assert m.pauses_taken == 3 and m.windows_opened == 3 and m.holders_inside == 0
    assert m.last_paused_s is not None and m.total_paused_s >= m.last_paused_s >= 0
    assert m.last_entry_latency_s is not None and m.last_entry_latency_s >= 0
    assert loop.stop()


# ---------------------------------------------------------------------------- several ranks, explicit API


def test_tp_every_rank_pauses_in_the_same_window():
    group = Group(2, peer_park_timeout=WAIT).start()
    inside = threading.Barrier(3)

    def holder(r):
        p = group.ranks[r]
        p.acquire_pause(None)
        try:
            inside.wait(WAIT)  # both holders inside at once: the windows overlap
            assert all(q.state.phase in ("window", "peer", "barrier", "decided") for q in group.ranks)
        finally:
            p.release_pause()

    threads = [run_thread(lambda r=r: holder(r)) for r in range(2)]
    inside.wait(WAIT)
    for th, box in threads:
        th.join(JOIN_TIMEOUT)
        assert "error" not in box, box
    group.ranks[0].request_stop(PauseProtocol.HARD_STOP, 0)
    assert group.join()
    assert group.errors == [None, None]
    assert group.windows[0] == group.windows[1] >= 1


def test_d3_rank_parked_for_a_peer_leaves_with_an_error():
    """Rank 0's holder pauses; rank 1's pauser never comes: rank 1 fails after its bound, no hang."""
    group = Group(2, peer_park_timeout=0.2).start()
    p0 = group.ranks[0]
    p0.acquire_pause(None)
    # Rank 1 gives up on its own; its peers' barrier is then broken and the group stops.
    group.threads[1].join(JOIN_TIMEOUT)
    assert not group.threads[1].is_alive()
    assert isinstance(group.errors[1], PeerParkTimeout)
    assert isinstance(group.ranks[1].fatal_error, PeerParkTimeout)
    p0.release_pause()
    assert group.join()
    assert group.errors[0] is not None  # the broken barrier: a clear error, not a hang


def test_d3_late_local_holder_joins_the_peer_pause():
    group = Group(2, peer_park_timeout=WAIT).start()
    p0, p1 = group.ranks
    p0.acquire_pause(None)
    # Rank 1 is parked for rank 0's pause; its holder arrives late and enters.
    p1.acquire_pause(None)
    assert p1.state.phase == "window"
    p1.release_pause()
    p0.release_pause()
    p0.request_stop(PauseProtocol.HARD_STOP, 0)
    assert group.join()
    assert group.errors == [None, None]


def test_a_stray_observer_thread_does_not_become_the_loop():
    """Another thread reads is_pause_requested() before the loop's first iteration: pause() still works."""
    loop = FakeLoop(ours())
    loop.status.clear()
    loop.status.is_pause_requested()  # the main thread looks first
    loop.thread.start()
    assert loop.stepped.wait(WAIT)
    loop.status.acquire_pause(loop.wake)  # no D4 error: the loop's update_with_tp_status settled it
    loop.status.release_pause()
    assert loop.stop()


@pytest.mark.parametrize("bad", [-1, 4, 1.5, "2", True, None])
def test_update_with_invalid_tp_status_raises_value_error(bad):
    status = ours()
    status.clear()
    before = status.state
    with pytest.raises(ValueError):
        status.update_with_tp_status(bad)
    assert status.state == before


def test_update_with_lower_tp_status_raises_value_error():
    status = ours()
    status.clear()
    status.update_with_tp_status(PauseProtocol.FLUSH_AND_STOP)
    with pytest.raises(ValueError, match="lower stop status"):
        status.update_with_tp_status(PauseProtocol.DONT_STOP)
    assert status.tp_status == PauseProtocol.FLUSH_AND_STOP


# ------------------------------------------------------------------------------------- explicit holder API


def test_a_hold_belongs_to_the_protocol_not_to_the_thread():
    """Requested on one thread, entered on a second, left on a third: the loop resumes."""
    loop = started(ours)
    p = loop.status
    hold = p.request_pause(loop.wake)
    entered, box = run_thread(lambda: p.enter_pause(hold, timeout=WAIT))
    entered.join(JOIN_TIMEOUT)
    assert "error" not in box and hold.state == "inside" and p.state.inside == 1
    loop.stepped.clear()
    leaver, box = run_thread(lambda: p.leave_pause(hold), name="leaver")
    leaver.join(JOIN_TIMEOUT)
    assert "error" not in box and hold.state == "idle" and p.state.count == 0
    assert loop.stepped.wait(WAIT), "the loop did not resume"
    assert loop.stop()


def test_misused_holds_raise_and_change_nothing():
    loop = started(ours)
    p, other = loop.status, ours()
    hold = p.request_pause(loop.wake)
    with pytest.raises(ValueError, match="PauseHold of this protocol"):
        other.enter_pause(hold)
    with pytest.raises(RuntimeError, match="needs a hold that is inside"):
        p.leave_pause(hold)  # still waiting
    p.enter_pause(hold, timeout=WAIT)
    with pytest.raises(RuntimeError, match="needs a hold that is waiting"):
        p.interrupt(hold)  # already inside
    before = p.state
    p.leave_pause(hold)
    with pytest.raises(RuntimeError, match="needs a hold that is inside"):
        p.leave_pause(hold)  # D2 for holds: a second leave changes nothing
    assert p.state == before._replace(count=0, inside=0, paused=False) or p.state.count == 0
    assert loop.stop()


def test_an_interrupted_or_timed_out_hold_is_withdrawn():
    p = ours()
    p.clear()  # running, but no loop reaches its all-reduce: the window never opens
    hold = p.request_pause()
    p.interrupt(hold)
    assert hold.state == "idle" and p.state.count == 0
    hold = p.request_pause()
    with pytest.raises(TimeoutError):
        p.enter_pause(hold, timeout=0.01)
    assert hold.state == "idle" and p.state.count == 0

    class Raising:
        def set(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        p.request_pause(Raising())  # the caller never gets the hold: the request must not stay
    assert p.state.count == 0


def test_request_pause_from_the_loop_thread_raises():
    outcome = {}

    def from_loop(loop):
        if loop.steps == 2 and not outcome:
            try:
                loop.status.request_pause()
            except RuntimeError as error:
                outcome["error"] = error

    loop = FakeLoop(ours(), hooks={"step": from_loop}).start()
    assert loop.stepped.wait(WAIT)
    assert loop.stop(hard=True)
    assert "own thread" in str(outcome.get("error")) and loop.status.state.count == 0


@pytest.mark.parametrize("timeout", [Decimal("0.01"), Fraction(1, 100), 0, 0.01, "numpy.float32"])
def test_every_real_number_of_seconds_is_a_timeout(timeout):
    """Whatever a threading wait accepts: numpy scalars, Decimal, Fraction (issue 13, point 6)."""
    if timeout == "numpy.float32":
        timeout = pytest.importorskip("numpy").float32(0.01)
    status = ours()
    status.clear()  # running, but no loop reaches the all-reduce: the wait runs out
    with pytest.raises(TimeoutError):
        status.acquire_pause(None, timeout=timeout)
    assert status.state.count == 0


@pytest.mark.parametrize("huge", [math.inf, 1e300, threading.TIMEOUT_MAX * 2])
def test_infinite_or_huge_timeouts_mean_no_timeout_on_any_thread(huge):
    """threading's waits raise OverflowError above TIMEOUT_MAX: such a timeout means none, on a worker thread
    too (the main thread's wait wakes in slices anyway)."""
    loop = FakeLoop(ours()).start()
    status = loop.status

    def pause_and_leave():
        status.acquire_pause(loop.wake, timeout=huge)
        status.release_pause()

    thread, box = run_thread(pause_and_leave, name="worker")
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    assert loop.stop()
    assert PauseProtocol(peer_park_timeout=huge).peer_park_timeout_s is None


@pytest.mark.parametrize("withdrawn", [False, True], ids=["window", "withdrawn"])
@pytest.mark.parametrize("barrier", [False, True], ids=["barrier_apart", "barrier_in_the_call"])
def test_a_loop_without_peers_takes_the_barrier_in_the_window_s_own_call(withdrawn, barrier):
    """``pause_window(barrier=True)`` (issue 38: a lock and a call fewer on the resume's path): the window (open and
    close, or skip for a withdrawn request), then P-BARRIER under the same lock; without it the loop is left at the
    barrier, as before."""
    from cbpause import TraceRecorder
    from cbpause.core import transitions as t

    recorder = TraceRecorder()
    p = PauseProtocol(trace=recorder)
    hold = p.request_pause()
    decided, go = threading.Event(), threading.Event()

    def loop() -> None:
        p.observe()
        p.all_reduce(p.DONT_STOP, t.KEEP)
        decided.set()
        assert go.wait(WAIT)
        p.pause_window(barrier=barrier)

    thread, box = run_thread(loop, name="loop")
    assert decided.wait(WAIT)
    if withdrawn:
        p.interrupt(hold)
        go.set()
    else:
        go.set()
        p.enter_pause(hold, timeout=WAIT)
        p.leave_pause(hold)
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    actions = [e.action for e in recorder.events]
    window = "SkipWindow" if withdrawn else "CloseWindow"
    if barrier:
        assert p.state.phase == "body" and actions[-2:] == [window, "Barrier"], actions
        with pytest.raises(RuntimeError, match="not enabled"):
            p.barrier()  # taken already
    else:
        assert p.state.phase == "barrier" and actions[-1] == window, actions
        p.barrier()
        assert p.state.phase == "body"


def test_a_steady_window_without_peers_replays_its_close_and_barrier_from_a_memo():
    """The hot ``close_window(barrier=True)`` (issue 38): the second of two alike windows replays the pair from its
    memo and ends where the first did; a close without the barrier is never remembered (its phase, ``barrier``,
    wakes those who wait for it, which a replay would not)."""
    from cbpause.core import transitions as t

    p = PauseProtocol()
    ends: list = []
    remembered: list = []
    slow: list[bool] = []
    close_window_slow = p._close_window_slow
    p._close_window_slow = lambda barrier: (slow.append(barrier), close_window_slow(barrier))[1]

    def holder(asked: threading.Event) -> None:
        hold = p.request_pause()
        asked.set()
        p.enter_pause(hold, timeout=WAIT)
        p.leave_pause(hold)

    def loop() -> None:  # memos are kept off the main thread only
        for barrier in (False, True):
            for _ in range(2):
                asked = threading.Event()
                thread, box = run_thread(functools.partial(holder, asked))
                assert asked.wait(WAIT)
                p.observe()
                p.all_reduce(p.DONT_STOP, t.KEEP)
                p.pause_window(barrier=barrier)
                thread.join(JOIN_TIMEOUT)
                assert not thread.is_alive() and "error" not in box, box
                if not barrier:
                    assert p.state.phase == "barrier"
                    p.barrier()
                ends.append(p.state)
                p.start_step()
                p.end_step()
            remembered.append([m for m in p._memo_close_window if isinstance(m, t.RankState)])

    thread, box = run_thread(loop, name="loop")
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    assert [len(r) for r in remembered] == [0, 2], remembered
    assert slow == [True], slow  # the second window with the barrier replayed the pair (pause_window's tail)
    assert all(s.phase == "body" for s in ends) and ends[2] is ends[3], ends


def test_a_pause_from_a_signal_handler_on_the_loop_s_thread_is_refused_at_any_line():
    """A signal handler runs on the main thread, between any two bytecodes of it: when the main thread is the loop,
    a pause asked there is the loop's own (D4), and it lands inside the protocol's own transitions too.  Each is the
    D4 refusal, before the lock, and the loop goes on with nothing changed."""
    import signal

    status = ours()
    loop = FakeLoop(status)
    outcomes: list[BaseException | str] = []

    def handler(signum, frame):
        try:
            status.request_and_enter_pause(loop.wake, timeout=HANG_S)
            outcomes.append("entered")
        except BaseException as error:  # noqa: BLE001 -- every outcome is checked below
            outcomes.append(error)

    def step(loop):
        if loop.steps == 1:  # the loop's thread is known from its first look at the pause request on
            signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
        if len(outcomes) >= 200 and status.local_status == status.DONT_STOP:
            signal.setitimer(signal.ITIMER_REAL, 0)
            loop.work = 3
            status.request_stop(status.FLUSH_AND_STOP, 0)

    loop.hooks["step"] = step
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        status.clear()
        loop.run()  # on this, the main, thread
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    refused = [o for o in outcomes if isinstance(o, RuntimeError) and "own thread" in str(o)]
    assert len(refused) == len(outcomes) >= 200, [o for o in outcomes if o not in refused][:3]
    assert loop.error is None and not loop.violations and status.state.count == 0
