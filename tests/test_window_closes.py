"""R-WINDOW-CLOSES (spec section 5, issue 25): once a holder has left an open window, or given up on it, the window
admits no newcomer, so holders that take turns cannot keep the loop paused for ever.

Protocol-level tests run the drop-in API on a :class:`~cbpause.testing.FakeLoop`; the real-loop tests run
transformers' loop on a tiny random Llama: two threads that chain keep pauses on one rank do not stop generation,
and a retract holder gets in while keep holders keep arriving.
"""

from __future__ import annotations

import threading

import pytest

from cbpause import PauseProtocol
from cbpause.testing import HANG_S, JOIN_TIMEOUT, FakeLoop, run_thread, wait_for_queued

pytestmark = pytest.mark.layer("loop")

WAIT = HANG_S  # bound on every wait for an event that must happen: a hang, not slowness


def started() -> FakeLoop:
    loop = FakeLoop(PauseProtocol(peer_park_timeout=5.0)).start()
    assert loop.stepped.wait(WAIT), "the loop never stepped"
    return loop


def closing_window(loop: FakeLoop):
    """Holder A (this thread) pauses; B arrives on the open window and enters directly (it is not closing yet); A
    leaves, which makes the window closing.  Returns B's thread and box and the event that lets B leave."""
    status = loop.status
    b_in, b_leave = threading.Event(), threading.Event()

    def b():
        status.acquire_pause(loop.wake, timeout=WAIT)
        b_in.set()
        b_leave.wait(WAIT)
        status.release_pause()

    status.acquire_pause(loop.wake, timeout=WAIT)
    assert not status.state.closing and status.metrics().open_window_entries == 1
    thread, box = run_thread(b, "holder-b")
    assert b_in.wait(WAIT), "a holder arriving at an open window that is not closing enters directly"
    status.release_pause()
    s = status.state
    assert s.paused and s.closing and s.inside == 1, s
    metrics = status.metrics()
    assert metrics.window_closing and metrics.open_window_entries == 2 and metrics.open_window_s is not None
    return thread, box, b_leave


def test_a_newcomer_is_queued_at_a_closing_window_waits_from_its_close_and_enters_after_one_step():
    """A pause that arrives at a closing window is queued (P-QUEUE-PAUSE, issue 40), and the close itself makes it
    waiting, counted, before anyone who asks later: its entry no longer rests on winning the lock after the close
    (weak fairness suffices; TLC checks QueuedEntersProp with it).  It enters the next window after one forward
    step (R-BOUNDED-ENTRY: the rest of the window, which has no step, plus one; before issue 25 it entered the
    closing window at once)."""
    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    with pytest.raises(TimeoutError, match="closing"):  # queued; with no time left it leaves the queue, nothing held
        status.acquire_pause(loop.wake, timeout=0)
    assert status.state.count == 1 and status.metrics().holders_queued == 0
    entered_at: dict = {}

    def c():
        status.acquire_pause(loop.wake, timeout=WAIT)
        entered_at["steps"] = loop.steps
        status.release_pause()

    c_thread, c_box = run_thread(c, "holder-c")
    assert wait_for_queued(status, WAIT), "C was not queued at the closing window"
    m = status.metrics()
    assert (m.holders_queued, m.holders_waiting, m.holders_inside, status.state.count) == (1, 0, 1, 1)
    steps_at_close = loop.steps  # the loop is parked in the window: this does not change until B leaves
    b_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    assert status.metrics().holders_queued == 0  # the close took C out of the queue, waiting or inside already
    c_thread.join(JOIN_TIMEOUT)
    assert not c_thread.is_alive() and "error" not in c_box, c_box
    assert entered_at["steps"] - steps_at_close == 1
    assert status.state.count == 0 and not status.state.closing
    assert loop.stop() and loop.violations == []


def test_a_thread_inside_a_closing_window_pauses_again_at_once():
    """Nested pauses of one thread: the inner one is no newcomer (it would otherwise wait for itself)."""
    loop = started()
    status = loop.status
    b_in, b_left, leave_b = threading.Event(), threading.Event(), threading.Event()

    def b():
        status.acquire_pause(loop.wake, timeout=WAIT)
        b_in.set()
        leave_b.wait(WAIT)
        status.release_pause()
        b_left.set()

    status.acquire_pause(loop.wake, timeout=WAIT)  # A, this thread
    thread, box = run_thread(b, "holder-b")
    assert b_in.wait(WAIT)
    leave_b.set()
    assert b_left.wait(WAIT)
    assert status.state.closing  # B left: closing, and A still inside
    status.acquire_pause(loop.wake, timeout=WAIT)  # nested: enters at once (a wait for the next window would hang)
    assert status.state.inside == 2
    status.release_pause()
    status.release_pause()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box
    assert status.state.count == 0
    assert loop.stop() and loop.violations == []


def test_a_thread_whose_own_request_keeps_a_closing_window_open_is_refused_a_second_pause_at_once():
    """Hostile review of issue 40: a thread that requested a pause (two-call API, not entered) keeps the closing window
    open; its second pause, queued behind that window with no timeout, waited for itself for ever.  It is refused at
    once, nothing changed, and the first request still enters and leaves."""
    loop = started()
    status = loop.status
    a_in, a_leave = threading.Event(), threading.Event()

    def a():
        status.acquire_pause(loop.wake, timeout=WAIT)
        a_in.set()
        a_leave.wait(WAIT)
        status.release_pause()

    thread, box = run_thread(a, "holder-a")
    assert a_in.wait(WAIT)
    first = status.request_pause(loop.wake)  # this thread: requested on the open window, not entered
    a_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box
    s = status.state
    assert s.paused and s.closing and s.waiting == 1, s  # kept open by this thread's own request
    with pytest.raises(RuntimeError, match="wait for itself"):
        status.acquire_pause(loop.wake)  # no timeout: before the fix, a hang
    with pytest.raises(RuntimeError, match="wait for itself"):
        status.request_pause(loop.wake)
    assert status.state == s and status.metrics().holders_queued == 0
    status.enter_pause(first, timeout=WAIT)
    status.leave_pause(first)
    assert status.state.count == 0 and not status.state.closing
    assert loop.stop() and loop.violations == []


def test_a_holder_that_gives_up_on_an_open_window_closes_it_to_newcomers():
    """An interrupt or timeout of a waiting holder is a drop too: a holder that asks and gives up again and again
    would otherwise hold the window open as well as one inside (TLC found it, issue 25)."""
    loop = started()
    status = loop.status
    a = status.acquire_pause(loop.wake, timeout=WAIT)
    hold = status.request_pause()  # a window is open: it could enter, but withdraws instead
    status.interrupt(hold)
    assert status.state.closing and status.state.paused
    status.leave_pause(a)
    assert not status.state.closing and not status.state.paused
    assert loop.stop() and loop.violations == []


def test_request_pause_waits_for_a_closing_window_with_a_timeout():
    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    with pytest.raises(TimeoutError):
        status.request_pause(timeout=0.01)
    assert status.state.count == 1
    b_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box
    hold = status.request_pause(loop.wake, timeout=WAIT)  # the window closed: asks at once
    status.enter_pause(hold, timeout=WAIT)
    status.leave_pause(hold)
    assert loop.stop() and loop.violations == []


def _consistent(status) -> None:
    """The rank's count is its registered holds waiting or inside (after the catch-up a reader makes), and no hold
    is both queued and counted."""
    with status._lock:
        queued = status._queued_now()
        s = status.state
        holds = [h for h in status._holds if h.state in ("waiting", "inside")]
        assert (s.count, s.waiting + s.inside) == (len(holds), len(holds)), (s, holds)
        assert queued == 0 or s.closing, (queued, s)


def test_an_exception_after_any_call_of_the_close_that_admits_a_queued_holder_loses_nothing():
    """Hostile review of issue 40: CPython delivers an asynchronous exception (Ctrl-C, SetAsyncExc) after any call,
    and one that landed inside the close's conversion of the queued holds left a hold waiting uncounted, which then
    entered the closing window (count -1).  Here a profile hook raises after the k-th C call that rank.py makes
    while the last holder leaves, for every k: whatever it cut, the counts agree, the queued holder gets in once,
    and everything ends clean."""
    k = 1
    while _close_cut_after_call(k):
        k += 1
    assert k > 3  # the conversion is cut before the store, after it, and inside the catch-up


def _close_cut_after_call(k: int) -> bool:
    """One run of the test above, cut at the ``k``-th call; whether the cut fired (else every point was tried)."""
    import sys

    from cbpause.core import rank

    loop = started()
    status = loop.status
    b_in, b_go, cut = threading.Event(), threading.Event(), threading.Event()
    calls = [0]

    def profile(frame, event, arg):
        if event == "c_return" and frame.f_code.co_filename == rank.__file__:
            calls[0] += 1
            if calls[0] == k:
                sys.setprofile(None)
                cut.set()
                raise KeyboardInterrupt(f"after call {k}")

    def b():
        status.acquire_pause(loop.wake, timeout=WAIT)
        b_in.set()
        b_go.wait(WAIT)
        sys.setprofile(profile)
        try:
            status.release_pause()
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        if status.held_by():  # the cut came before the leave: leave again
            status.release_pause()

    status.acquire_pause(loop.wake, timeout=WAIT)
    b_thread, b_box = run_thread(b, "holder-b")
    assert b_in.wait(WAIT)
    status.release_pause()  # the window is closing
    c_thread, c_box = run_thread(lambda: enter_and_leave_once(status, loop), "holder-c")
    assert wait_for_queued(status, WAIT)
    b_go.set()
    for thread, box in ((b_thread, b_box), (c_thread, c_box)):
        thread.join(JOIN_TIMEOUT)
        assert not thread.is_alive() and "error" not in box, (k, box)
    _consistent(status)
    assert status.state.count == 0 and not status.state.paused and status.metrics().holders_queued == 0, k
    assert loop.stop() and loop.violations == [], k
    return cut.is_set()


def enter_and_leave_once(status, loop) -> None:
    status.acquire_pause(loop.wake, timeout=WAIT)
    status.release_pause()


@pytest.mark.parametrize("api", ["acquire_pause", "request_pause"])
@pytest.mark.parametrize("stop", ["flush", "hard"])
def test_a_stop_asked_while_a_holder_is_queued_refuses_it_at_once(stop, api):
    """Hostile review of issue 40: a holder queued at a closing window ignored a stop until the window closed (then
    entered a window opened after the stop, or got a waiting hold of a stopping loop).  As before the queue, a stop
    takes it out of the queue and its call raises RuntimeError, nothing held."""
    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    call = getattr(status, api)
    c_thread, c_box = run_thread(lambda: call(loop.wake, timeout=WAIT), "holder-c")
    assert wait_for_queued(status, WAIT)
    status.request_stop(status.FLUSH_AND_STOP if stop == "flush" else status.HARD_STOP)
    c_thread.join(JOIN_TIMEOUT)
    assert not c_thread.is_alive() and isinstance(c_box.get("error"), RuntimeError), c_box
    assert "stopping" in str(c_box["error"]) and status.metrics().holders_queued == 0
    assert status.state.count == 1  # B alone
    b_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    assert status.state.count == 0
    loop.stop()


def test_a_queued_hold_withdrawn_by_another_thread_before_its_own_wakes_is_never_entered():
    """Hostile review of issue 40: the close made a one-call hold waiting; before its thread took the lock back,
    another thread withdrew it (``held_by``, ``interrupt``); its thread then entered the idle hold (count -1, the loop
    failed).  Now its call raises RuntimeError, and the counts stay right.  A trace hook holds the thread between
    its wake-up and its taking the lock back, as the OS scheduler may."""
    import sys

    from cbpause.core import condition

    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    wait_code = condition.SafeCondition.wait.__code__
    lines = open(condition.__file__).read().splitlines()
    first = wait_code.co_firstlineno
    gate_line = [n for n in range(first, first + 40) if "if not lock._is_owned():" in lines[n - 1]][1]
    armed, at_gate, go = threading.Event(), threading.Event(), threading.Event()

    def tracer(frame, event, arg):
        if frame.f_code is not wait_code:
            return None

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == gate_line and armed.is_set():
                armed.clear()
                at_gate.set()
                go.wait(WAIT)
            return local

        return local

    def c():
        sys.settrace(tracer)
        try:
            return status.acquire_pause(loop.wake, timeout=WAIT)
        finally:
            sys.settrace(None)

    c_thread, c_box = run_thread(c, "holder-c")
    assert wait_for_queued(status, WAIT)
    armed.set()
    b_leave.set()  # B leaves: the window closes, C's hold is waiting
    assert at_gate.wait(WAIT), "C never woke"
    (hold,) = status.held_by(c_thread)
    status.interrupt(hold)
    d = status.request_pause(loop.wake)  # the next window opens for D
    status.enter_pause(d, timeout=WAIT)
    go.set()
    c_thread.join(JOIN_TIMEOUT)
    assert not c_thread.is_alive() and isinstance(c_box.get("error"), RuntimeError), c_box
    assert "withdrawn" in str(c_box["error"])
    assert (status.state.count, status.state.inside) == (1, 1)  # D alone
    status.leave_pause(d)
    thread.join(JOIN_TIMEOUT)
    assert status.state.count == 0 and loop.stop() and loop.violations == []


# ------------------------------------------------------------------------------------------------ the real loop


def test_on_the_real_loop_a_holder_queued_at_a_closing_window_enters_within_one_forward_step(cpu_model):
    """Issue 40, point 3, on transformers' loop with requests generating: the queued holder enters the window after
    the closing one within one forward step of the close, counted by a forward hook."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, probed

    from .conftest import MAX_NEW, results, submit

    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config())
    with probed(manager, cpu_model):
        probe, status = manager.probe, manager.background_thread_status
        manager.start()
        ids = submit(manager, 2)
        assert probe.wait_steps(2, WAIT), "the loop did not step"
        first_in, first_leave, second_in, second_leave = (threading.Event() for _ in range(4))
        entered_at: dict = {}

        def hold(inside: threading.Event, leave: threading.Event) -> None:
            with manager.pause(timeout=WAIT):
                inside.set()
                leave.wait(WAIT)

        def queued() -> None:
            with manager.pause(timeout=WAIT):
                entered_at["forwards"] = probe.forwards

        a = run_thread(lambda: hold(first_in, first_leave), "holder-a")
        assert first_in.wait(WAIT)
        b = run_thread(lambda: hold(second_in, second_leave), "holder-b")
        assert second_in.wait(WAIT)  # entered the open window directly
        first_leave.set()
        a[0].join(JOIN_TIMEOUT)
        assert status.state.closing
        c = run_thread(queued, "holder-c")
        assert wait_for_queued(status, WAIT), "C was not queued at the closing window"
        at_close = probe.forwards  # parked: no step until B leaves
        second_leave.set()
        for thread, box in (b, c):
            thread.join(JOIN_TIMEOUT)
            assert not thread.is_alive() and "error" not in box, box
        assert 0 <= entered_at["forwards"] - at_close <= 1
        assert all(len(o.generated_tokens) == MAX_NEW for o in results(manager, ids))
        manager.stop(block=True, timeout=WAIT)




def _chain(manager, stop: threading.Event, entries: list[int], me: int, hold_s: float) -> None:
    """Keep pausing in keep, each pause held ``hold_s`` (a workload, not a synchronisation), until ``stop``."""
    while not stop.is_set():
        with manager.pause(timeout=WAIT):
            entries[me] += 1
            stop.wait(hold_s)


def test_two_threads_chaining_keep_pauses_do_not_stop_generation_and_stronger_holders_get_in(cpu_model):
    """Two threads pause the real loop in turn, each re-asking the moment it leaves, so that their pauses overlap
    (before issue 25 the window they shared never closed and no request made progress).  Requests submitted meanwhile
    complete while the chain goes on, and a retract, a drain and an abort holder each enter while the keep holders
    keep arriving (issue 26, point 2: a stronger mode no longer waits behind weaker holders)."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config

    from .conftest import MAX_NEW, results, submit

    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config())
    manager.start()
    stop = threading.Event()
    entries = [0, 0]
    chain = [run_thread(lambda i=i: _chain(manager, stop, entries, i, 0.01), f"chain-{i}") for i in range(2)]
    try:
        status = manager.background_thread_status
        windows_before = status.metrics().windows_opened
        ids = submit(manager, 3)
        outs = results(manager, ids)  # bounded: fails if the chain keeps the loop paused
        assert all(len(o.generated_tokens) == MAX_NEW for o in outs)
        entered = []
        for mode in ("retract", "drain", "abort"):  # each stronger than the chain's keep (issue 26, point 2)
            ids = submit(manager, 2)
            with manager.pause(mode=mode, timeout=WAIT):  # while keep holders keep arriving
                entered.append(mode)
            results(manager, ids)
        assert not stop.is_set() and all(t.is_alive() for t, _ in chain), "the chain must still be running"
        assert min(entries) > 0 and status.metrics().windows_opened > windows_before
    finally:
        stop.set()
        for thread, _ in chain:
            thread.join(JOIN_TIMEOUT)
        manager.stop(block=True, timeout=WAIT)
    assert entered == ["retract", "drain", "abort"]
    assert all(not t.is_alive() and "error" not in box for t, box in chain), [box for _, box in chain]
    assert manager._live_ids == set()


def test_a_sigint_while_waiting_for_a_closing_window_leaves_nothing_held():
    """Ctrl-C on a main thread that waits for a closing window to close (it has asked for nothing yet): the
    KeyboardInterrupt propagates, and the rank's counts are those of the holder inside."""
    from cbpause.testing import call_interrupted

    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    ready = threading.Event()
    ready.set()  # the SIGINT may land before the wait or in it: either way nothing is asked
    interrupted = call_interrupted(lambda: status.acquire_pause(loop.wake, timeout=WAIT), ready, WAIT)
    assert interrupted
    s = status.state
    assert s.count == 1 and s.inside == 1 and s.closing, s
    b_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box
    assert status.state.count == 0
    assert loop.stop() and loop.violations == []


def test_a_stronger_pause_from_a_thread_inside_raises_at_once():
    """R-NO-SELF-WAIT: inside a keep pause, the same thread asks for abort: it could only enter the next window,
    which its own pause keeps closed, so it raises at once and holds nothing (it used to wait for ever).  The same
    check covers a second asyncio task on the thread: the thread, not the task, holds the pause."""
    loop = started()
    status = loop.status
    status.acquire_pause(loop.wake, timeout=WAIT)  # keep: the drop-in loop agrees every window in keep
    for mode in ("retract", "drain", "abort"):
        with pytest.raises(RuntimeError, match="would wait for the next window"):
            status.acquire_pause(loop.wake, mode=mode)  # no timeout: before the fix, for ever
    hold = status.request_pause(mode="abort")  # the explicit API: any thread may end a hold, so its wait waits
    with pytest.raises(TimeoutError):
        status.enter_pause(hold, timeout=0.05)
    assert hold.state == "idle"
    s = status.state
    assert s.count == 1 and s.inside == 1, s
    status.acquire_pause(loop.wake, mode="keep", timeout=WAIT)  # a covered mode nests at once
    status.release_pause()
    status.release_pause()
    assert status.state.count == 0
    assert loop.stop() and loop.violations == []


def test_a_hold_queued_at_a_closing_window_can_be_withdrawn_by_another_thread():
    """P-LEAVE-QUEUE from another thread (``interrupt`` of a queued hold, issue 57): a server's keeper of torn weights
    keeps its window from closing, so a pause queued there would wait for ever; withdrawn, its call raises at once,
    nothing held, and the window is as it was."""
    loop = started()
    status = loop.status
    thread, box, b_leave = closing_window(loop)
    holds: list = []

    def c():
        status.request_and_enter_pause(loop.wake, timeout=WAIT, into=holds)

    c_thread, c_box = run_thread(c, "holder-c")
    assert wait_for_queued(status, WAIT), "C was not queued at the closing window"
    assert holds and holds[0].state == "queued"  # the caller has the hold while it is queued
    status.interrupt(holds[0])
    c_thread.join(JOIN_TIMEOUT)
    assert not c_thread.is_alive() and isinstance(c_box.get("error"), RuntimeError), c_box
    assert holds[0].state == "idle" and status.metrics().holders_queued == 0
    s = status.state
    assert s.paused and s.closing and s.count == 1, s
    with pytest.raises(RuntimeError, match="needs a hold that is waiting"):
        status.interrupt(holds[0])  # idle now: nothing to withdraw
    b_leave.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box, box
    assert loop.stop() and loop.violations == []
