"""transformers' own pause scenarios, with ``PauseProtocol()`` used exactly as they use ``BackgroundThreadStatus()``.

The pattern of transformers' unit tests: a status object, built and never ``clear()``ed, and a plain thread as
the loop that calls only ``is_pause_requested``, ``pause_and_wait``, ``request_stop``, ``record_fatal_error``
and ``mark_as_stopped`` (and reads ``local_status``); the pausing side is transformers' real
``ContinuousBatchingManager.pause()`` and ``stop()``, on a manager with just what those two read.  No
explicit-API call and no cbpause helper touches the status object.  Every scenario runs on both
implementations, and a third time on cbpause's own manager built the same way (``cbpause-manager``); where
upstream's class is defective the case is a strict xfail that names the defect.
"""

from __future__ import annotations

import threading
import types

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.continuous_api import (  # noqa: E402
    BackgroundThreadStatus,
    ContinuousBatchingManager,
)

from cbpause import PauseProtocol  # noqa: E402
from cbpause.testing import JOIN_TIMEOUT, call_interrupted, enter_and_leave, run_thread  # noqa: E402

DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED = 0, 1, 2, 3

# transformers' pause() has no timeout: a scenario that hangs fails here instead of freezing the run.
pytestmark = pytest.mark.layer("loop")


# "cbpause-manager": cbpause's own manager, built as transformers' pause tests build theirs (with __new__, only what
# pause() and stop() read set), over a PauseProtocol (issue 26, point 15).
@pytest.fixture(params=["cbpause", "upstream", "cbpause-manager"])
def impl(request):
    return request.param


def new_status(impl: str):
    return BackgroundThreadStatus() if impl == "upstream" else PauseProtocol()


class PlainLoop:
    """A generation loop as transformers' unit tests write one: it polls for a pause between (simulated)
    forward steps and exits when a stop is asked.

    ``hold_next_step()`` holds the loop in its next step; ``fail_next_step`` makes that step raise (the loop then
    does what transformers' ``_handle_critical_error`` does); ``peer_pause`` makes the loop open a window first,
    before any request of this rank (a peer asked); ``hard_stop_on_request`` makes it hard-stop itself instead
    of pausing once it sees a request.
    """

    def __init__(self, status, wake: threading.Event, *, peer_pause: bool = False,
                 hard_stop_on_request: bool = False, go: threading.Event | None = None):  # fmt: skip
        self.status, self.wake = status, wake
        self.peer_pause, self.hard_stop_on_request = peer_pause, hard_stop_on_request
        self.windows = 0  # pause_and_wait() calls that returned
        self.parking = threading.Event()  # set just before the loop's first pause_and_wait()
        self.resumed = threading.Event()  # set once that call returned
        self.window_ended = threading.Semaphore(0)  # released each time a pause_and_wait() call returns
        self.go = go  # if given: the loop waits for it before its first poll
        self.saw_request = threading.Event()
        self.fail_next_step: Exception | None = None
        self.before_exit: threading.Event | None = None  # if set: the loop waits for it before mark_as_stopped
        self._hold: tuple[threading.Event, threading.Event] | None = None
        self.thread = threading.Thread(target=self.run, name="plain-loop", daemon=True)

    def hold_next_step(self) -> tuple[threading.Event, threading.Event]:
        """(reached, release): the loop sets ``reached`` inside its next step and waits for ``release``."""
        self._hold = (threading.Event(), threading.Event())
        return self._hold

    def _window(self) -> None:
        self.parking.set()
        self.status.pause_and_wait()
        self.windows += 1
        self.resumed.set()
        self.window_ended.release()

    def _step(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold[0].set()
            hold[1].wait(JOIN_TIMEOUT)
        error, self.fail_next_step = self.fail_next_step, None
        if error is not None:
            raise error
        self.wake.wait(0.002)  # the loop's wait for work, as upstream's loop waits on its wake-up event
        self.wake.clear()

    def run(self) -> None:
        status = self.status
        try:
            if self.go is not None:
                self.go.wait(JOIN_TIMEOUT)
            if self.peer_pause:
                self._window()
            while status.local_status == DONT_STOP:
                if status.is_pause_requested():
                    self.saw_request.set()
                    if self.hard_stop_on_request:
                        status.request_stop(HARD_STOP, 0)
                        break
                    self._window()
                else:
                    self._step()
        except Exception as error:  # transformers' _handle_critical_error
            status.request_stop(HARD_STOP, 0)
            status.record_fatal_error(error)
        finally:
            if self.before_exit is not None:
                self.before_exit.wait(JOIN_TIMEOUT)
            status.mark_as_stopped()


def minimal_manager(status, cls: type = ContinuousBatchingManager) -> ContinuousBatchingManager:
    """transformers' real manager (or ``cls``) with only what ``pause()``, ``stop()`` and ``is_running()`` read."""
    manager = cls.__new__(cls)
    manager.background_thread_status = status
    manager._generation_thread = None
    manager._wake_up_loop = threading.Event()
    manager.batch_processor = object()  # stop() warns without one
    manager.distributed_helper = types.SimpleNamespace(global_rank=0)
    manager._original_attn_impl = None
    manager.model = types.SimpleNamespace()
    return manager


def start_loop(manager, **options) -> PlainLoop:
    """A plain loop on ``manager``'s status, started as ``manager.start()`` would (without its ``clear()``)."""
    loop = PlainLoop(manager.background_thread_status, manager._wake_up_loop, **options)
    manager._generation_thread = loop.thread
    loop.thread.start()
    return loop


@pytest.fixture
def setup(impl):
    """A status of ``impl``, a manager over it, and a factory that starts a plain loop as ``manager.start()``
    would (without its ``clear()``).  On the way out every loop is stopped and must have ended."""
    status = new_status(impl)
    if impl == "cbpause-manager":
        from cbpause.integrations.transformers import PausableContinuousBatchingManager

        manager = minimal_manager(status, PausableContinuousBatchingManager)
    else:
        manager = minimal_manager(status)
    loops: list[PlainLoop] = []

    def start(**options) -> PlainLoop:
        loops.append(start_loop(manager, **options))
        return loops[-1]

    yield status, manager, start
    for loop in loops:
        if loop.thread.is_alive():
            status.request_stop(HARD_STOP, 0)
            if loop.before_exit is not None:
                loop.before_exit.set()
            loop.thread.join(JOIN_TIMEOUT)
        assert not loop.thread.is_alive(), "a loop thread did not end"


def stop_and_join(manager, loop: PlainLoop) -> None:
    manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not loop.thread.is_alive() and not manager.is_running()


def test_a_loop_that_polls_sees_a_request_made_before_its_first_poll(setup):
    """The protocol accepts a request before the loop's first observation, and the loop picks it up."""
    status, manager, start = setup
    go = threading.Event()
    loop = start(go=go)
    holder, box = run_thread(lambda: enter_and_leave(manager.pause()))
    assert manager._wake_up_loop.wait(JOIN_TIMEOUT)  # the request is in; the loop has not polled yet
    go.set()
    holder.join(JOIN_TIMEOUT)
    assert not holder.is_alive() and "error" not in box
    assert loop.window_ended.acquire(timeout=JOIN_TIMEOUT)
    for _ in range(3):  # and the loop keeps picking requests up
        with manager.pause():
            assert loop.saw_request.is_set()
            windows = loop.windows
        assert loop.window_ended.acquire(timeout=JOIN_TIMEOUT)
        assert loop.windows == windows + 1
    stop_and_join(manager, loop)
    assert status.local_status == STOPPED


def test_a_peer_initiated_pause_is_entered_directly(setup):
    """The loop opens a window a peer asked for; a local pause() enters it without the loop going round."""
    status, manager, start = setup
    loop = start(peer_pause=True)
    assert loop.parking.wait(JOIN_TIMEOUT)
    with manager.pause():
        assert not loop.resumed.is_set() and not loop.saw_request.is_set()
    assert loop.resumed.wait(JOIN_TIMEOUT)
    assert not loop.saw_request.is_set()  # entered through the peer's window, not through a poll
    stop_and_join(manager, loop)


def test_a_real_sigint_during_the_wait_withdraws_the_request_and_the_loop_resumes(setup):
    """The main thread waits for a pause on a loop held in a step and gets a real SIGINT."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a SIGINT reaches the main thread only")
    status, manager, start = setup
    loop = start()
    reached, release = loop.hold_next_step()
    assert reached.wait(JOIN_TIMEOUT)
    manager._wake_up_loop.clear()
    try:
        interrupted = call_interrupted(lambda: enter_and_leave(manager.pause()), manager._wake_up_loop, JOIN_TIMEOUT)
    finally:
        release.set()
    assert interrupted
    assert not status.is_pause_requested(local=True)
    # The loop resumes: it takes steps again, and never opens a window for the withdrawn request.
    reached, release = loop.hold_next_step()
    assert reached.wait(JOIN_TIMEOUT)
    release.set()
    assert loop.windows == 0 and not loop.saw_request.is_set()
    with manager.pause():  # and the next pause works
        pass
    stop_and_join(manager, loop)


@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("timeout", [None, 0.0, 5.0])
def test_stop_from_inside_a_pause_raises(setup, block, timeout):
    status, manager, start = setup
    loop = start()
    with manager.pause():
        with pytest.raises(RuntimeError, match="from inside a pause"):
            manager.stop(block=block, timeout=timeout)
        assert status.local_status == DONT_STOP  # the refused stop changed nothing
    assert manager.is_running()
    with manager.pause():
        pass
    stop_and_join(manager, loop)


def test_a_blocking_stop_from_another_thread_waits_for_the_holder(setup):
    status, manager, start = setup
    loop = start()
    with manager.pause():
        windows = loop.windows
        stopper, box = run_thread(lambda: manager.stop(block=True, timeout=JOIN_TIMEOUT), name="stopper")
        stopper.join(0.2)
        assert stopper.is_alive(), "stop(block=True) returned while a holder was inside the pause"
        assert loop.thread.is_alive() and loop.windows == windows
    stopper.join(JOIN_TIMEOUT)
    assert not stopper.is_alive() and "error" not in box
    assert not loop.thread.is_alive() and not manager.is_running()
    assert status.local_status == STOPPED


def test_a_fatal_error_while_a_pause_is_pending_makes_pause_raise_with_it(setup):
    status, manager, start = setup
    loop = start()
    loop.before_exit = threading.Event()  # hold the loop between record_fatal_error and mark_as_stopped
    reached, release = loop.hold_next_step()
    assert reached.wait(JOIN_TIMEOUT)
    fault = RuntimeError("injected fault in the forward step")
    loop.fail_next_step = fault
    manager._wake_up_loop.clear()
    holder, box = run_thread(lambda: enter_and_leave(manager.pause()))
    assert manager._wake_up_loop.wait(JOIN_TIMEOUT)  # the request is in
    release.set()
    holder.join(JOIN_TIMEOUT)
    assert not holder.is_alive()
    error = box.get("error")
    assert isinstance(error, RuntimeError) and error.__cause__ is fault
    assert status.local_status == HARD_STOP and status.fatal_error is fault
    loop.before_exit.set()
    loop.thread.join(JOIN_TIMEOUT)
    assert not loop.thread.is_alive() and status.local_status == STOPPED
    assert loop.windows == 0


def test_a_loop_that_hard_stops_after_seeing_the_request_makes_pause_raise(setup):
    status, manager, start = setup
    loop = start(hard_stop_on_request=True)
    holder, box = run_thread(lambda: enter_and_leave(manager.pause()))
    holder.join(JOIN_TIMEOUT)
    assert not holder.is_alive(), "pause() still waits on a loop that is gone"
    assert isinstance(box.get("error"), RuntimeError)
    assert loop.saw_request.is_set() and loop.windows == 0
    loop.thread.join(JOIN_TIMEOUT)
    assert status.local_status == STOPPED


def test_pause_on_a_manager_never_started_or_already_stopped_raises_at_once(setup):
    status, manager, start = setup
    with pytest.raises(RuntimeError, match="no generation loop is running"):
        enter_and_leave(manager.pause())
    loop = start()
    stop_and_join(manager, loop)
    with pytest.raises(RuntimeError, match="no generation loop is running"):
        enter_and_leave(manager.pause())
    assert not status.is_pause_requested()


def test_a_stray_release_raises_and_the_next_pause_works(setup, impl, request):
    if impl == "upstream":
        request.applymarker(pytest.mark.xfail(strict=True, reason="D2: upstream's stray release_pause() drives its "
                                              "count negative and raises nothing"))  # fmt: skip
    status, manager, start = setup
    loop = start()
    with pytest.raises(RuntimeError):
        status.release_pause()
    with manager.pause():
        assert loop.saw_request.is_set()
    stop_and_join(manager, loop)


@pytest.mark.layer("verify")
@pytest.mark.parametrize("scenario", ["pauses", "fatal", "hard_stop"])
def test_a_plain_loops_trace_is_a_behaviour_of_the_spec(scenario, tmp_path, tlc_ready):
    """The compositions a plain loop's calls stand for (its unreported all-reduces included) pass TLC."""
    from cbpause import TraceRecorder
    from cbpause.tlc.traces import describe_rejection, validate

    from .conftest import TLA_DIR

    recorder = TraceRecorder()
    status = PauseProtocol(trace=recorder)
    manager = minimal_manager(status)
    loop = start_loop(manager, hard_stop_on_request=scenario == "hard_stop")
    try:
        if scenario == "pauses":
            for _ in range(2):
                enter_and_leave(manager.pause())
            stop_and_join(manager, loop)
        elif scenario == "fatal":
            reached, release = loop.hold_next_step()
            assert reached.wait(JOIN_TIMEOUT)
            loop.fail_next_step = RuntimeError("injected")
            manager._wake_up_loop.clear()
            holder, box = run_thread(lambda: enter_and_leave(manager.pause()))
            assert manager._wake_up_loop.wait(JOIN_TIMEOUT)
            release.set()
            holder.join(JOIN_TIMEOUT)
            assert isinstance(box.get("error"), RuntimeError)
        else:
            with pytest.raises(RuntimeError):
                enter_and_leave(manager.pause())
        loop.thread.join(JOIN_TIMEOUT)
    finally:
        status.request_stop(HARD_STOP, 0)
        loop.thread.join(JOIN_TIMEOUT)
    assert not loop.thread.is_alive()
    actions = {e.action for e in recorder.events}
    assert {"Observe", "AllReduce", "NoPause"} <= actions
    result = validate(recorder, TLA_DIR, tmp_path)
    assert result.accepted, describe_rejection(recorder, result)


def test_local_status_reads_stopped_only_once_the_loop_says_so(impl):
    """Issue 26, point 14: a loop that asked a hard stop and recorded a fatal error still runs (its exit path) until
    it calls mark_as_stopped(); transformers' object shows HARD_STOP until then, and so does cbpause's."""
    status = new_status(impl)
    status.request_stop(HARD_STOP, 0)
    status.record_fatal_error(RuntimeError("boom"))
    assert status.local_status == HARD_STOP
    status.mark_as_stopped()
    assert status.local_status == STOPPED


def test_local_status_after_a_fatal_error_without_a_stop(impl):
    status = new_status(impl)
    status.record_fatal_error(RuntimeError("boom"))
    shown = status.local_status
    status.request_stop(FLUSH_AND_STOP, 0)  # the exit path asks (transformers' _handle_critical_error does not)
    assert status.local_status == max(shown, FLUSH_AND_STOP) < STOPPED
    status.mark_as_stopped()
    assert status.local_status == STOPPED


def test_cbpause_manager_built_as_transformers_tests_build_one_stops_from_another_thread_while_paused():
    """Issue 26, point 15: transformers' pause tests build the manager with ``__new__`` and set only what upstream's
    ``pause()`` and ``stop()`` read; cbpause's manager built so (its ``__init__`` never run) must stop from another
    thread while a holder is inside, once the holder leaves (its stop state has class defaults)."""
    from cbpause.integrations.transformers import PausableContinuousBatchingManager

    status = PauseProtocol()
    manager = minimal_manager(status, PausableContinuousBatchingManager)
    loop = start_loop(manager)
    try:
        with manager.pause(timeout=JOIN_TIMEOUT):
            stopper, box = run_thread(lambda: manager.stop(block=True, timeout=JOIN_TIMEOUT), name="stopper")
            stopper.join(0.2)
            assert stopper.is_alive(), "stop(block=True) returned while a holder was inside the pause"
        stopper.join(JOIN_TIMEOUT)
        assert not stopper.is_alive() and "error" not in box, box.get("error")
        assert not loop.thread.is_alive() and not manager.is_running()
        assert status.local_status == STOPPED and manager.batch_processor is None
    finally:
        status.request_stop(HARD_STOP, 0)
        loop.thread.join(JOIN_TIMEOUT)
