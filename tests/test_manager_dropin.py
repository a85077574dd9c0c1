"""PauseProtocol swapped into transformers' own ContinuousBatchingManager keeps upstream's pause behaviours.

A tiny random Llama built from a config (no download) drives the real continuous-batching loop on CPU.
Each behaviour runs with upstream's BackgroundThreadStatus too, as the reference.  A forward pre-hook
records any forward step that starts while a test's holder is inside a pause (R-EXCLUSION), and can hold a
forward step (a gate) or make it fail, so interleavings are forced with events.
"""


import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus  # noqa: E402

from cbpause import PauseProtocol  # noqa: E402
from cbpause import testing as kit  # noqa: E402
from cbpause.testing import JOIN_TIMEOUT, run_thread  # noqa: E402

from .conftest import MAX_NEW, WAIT, overlapping_holders, results, submit  # noqa: E402

pytestmark = pytest.mark.layer("loop")


@pytest.fixture(scope="module")
def model():
    return kit.tiny_llama()


@pytest.fixture(params=["cbpause", "upstream"])
def manager(request, model):
    gen, cb = kit.greedy_config(MAX_NEW), kit.batching_config()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.background_thread_status = (
        PauseProtocol(peer_park_timeout=WAIT) if request.param == "cbpause" else BackgroundThreadStatus()
    )
    with kit.probed(manager, model, JOIN_TIMEOUT):
        yield manager


def test_pauses_during_generation_lose_nothing(manager):
    manager.start()
    ids = submit(manager)
    for _ in range(5):
        with manager.pause():
            manager.probe.inside += 1
            manager.probe.inside -= 1
    outs = results(manager, ids)
    assert all(o is not None and len(o.generated_tokens) == MAX_NEW for o in outs)
    assert manager.probe.violations == 0
    manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not manager.is_running()


def test_several_holders_and_direct_entry(manager):
    manager.start()
    ids = submit(manager)
    probe = manager.probe
    thread, box, leave_second, _ = overlapping_holders(manager)
    # The first holder left; the second keeps the loop paused (probe.inside is still 1).
    assert probe.inside == 1
    leave_second.set()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive() and "error" not in box
    assert all(len(o.generated_tokens) == MAX_NEW for o in results(manager, ids))
    assert probe.violations == 0


def test_stop_from_inside_a_pause_raises(manager):
    manager.start()
    with manager.pause():
        with pytest.raises(RuntimeError, match="inside a pause"):
            manager.stop(block=True)
    manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not manager.is_running()


def test_stop_from_another_thread_waits_for_the_pause(manager):
    manager.start()
    submit(manager)
    probe = manager.probe
    with manager.pause():
        probe.inside += 1
        stopper, box = run_thread(lambda: manager.stop(block=True, timeout=WAIT), name="stopper")
        # The loop cannot exit while we are inside: it is parked in its pause window.
        assert manager.is_running()
        probe.inside -= 1
    stopper.join(WAIT + JOIN_TIMEOUT)
    assert not stopper.is_alive() and "error" not in box
    assert not manager.is_running() and probe.violations == 0


def test_interrupted_waiter_drops_its_request(manager):
    manager.start()
    ids = submit(manager)
    reached, release = manager.probe.hold_next()
    assert reached.wait(WAIT)  # the loop is inside a forward step: a pause must wait
    manager._wake_up_loop.clear()
    # pause() sets the wake-up event once it has asked and is about to wait
    assert kit.call_interrupted(lambda: kit.enter_and_leave(manager.pause()), manager._wake_up_loop, WAIT)
    release.set()
    assert not manager.background_thread_status.is_pause_requested(local=True)
    # Nothing is lost, and the next pause still works.
    with manager.pause():
        pass
    assert all(len(o.generated_tokens) == MAX_NEW for o in results(manager, ids))


def test_pause_raises_with_the_fatal_error_as_cause(manager):
    manager.start()
    ids = submit(manager)
    release, thread, box = kit.pending_pause(manager, manager.probe, WAIT)
    boom = RuntimeError("boom in forward")
    manager.probe.fail_with = boom
    release.set()  # the held forward step now fails
    thread.join(JOIN_TIMEOUT)
    assert isinstance(box.get("error"), RuntimeError) and box["error"].__cause__ is boom
    # Every request gets a terminal output (failed).
    outs = results(manager, ids)
    assert all(o is not None and o.error is not None for o in outs)
    manager.join(0, JOIN_TIMEOUT)
    with pytest.raises(RuntimeError):
        with manager.pause():
            pass


def test_pause_raises_when_never_started_or_stopped(manager):
    with pytest.raises(RuntimeError):
        with manager.pause():
            pass
    manager.start()
    manager.stop(block=True, timeout=JOIN_TIMEOUT)
    with pytest.raises(RuntimeError):
        with manager.pause():
            pass


def test_pause_raises_when_hard_stopped_while_waiting(manager):
    manager.start()
    submit(manager)
    release, thread, box = kit.pending_pause(manager, manager.probe, WAIT)
    stopper, _ = run_thread(lambda: manager.stop(block=True, hard_stop=True, timeout=WAIT), name="stopper")
    release.set()
    thread.join(JOIN_TIMEOUT)
    stopper.join(JOIN_TIMEOUT)
    assert isinstance(box.get("error"), RuntimeError)
    assert not manager.is_running()


def test_holders_whose_pauses_overlap_cannot_starve_a_stop(manager, request):
    """Two holders hand the window to each other (one leaves only while the other is inside, then pauses again at
    once), and a third thread asks for a blocking flush stop: the stop completes and every request has its one
    output.  Upstream admits new pauses under a stop, so its window never closes (R-STOP-RETURNS)."""
    upstream = manager.background_thread_status.__class__ is BackgroundThreadStatus
    if upstream:
        request.applymarker(pytest.mark.xfail(strict=True, reason="upstream admits new pauses under a stop: "
                                              "overlapping holders keep the stop from completing"))  # fmt: skip
    # The stop must complete: WAIT for cbpause; upstream's never does (the strict xfail), so a short wait there.
    stop_s = 3.0 if upstream else WAIT
    manager.start()
    ids = submit(manager)
    cond = threading.Condition()
    inside, turn, done, refused = [False, False], [0], [False], []
    started = threading.Event()

    def holder(me: int) -> None:
        other = 1 - me
        while True:
            try:
                with manager.pause():
                    with cond:
                        inside[me] = True
                        started.set()
                        cond.notify_all()
                        # Leave only while the other holder is inside: the window never empties.
                        cond.wait_for(lambda: done[0] or refused or (inside[other] and turn[0] == me), WAIT)
                        inside[me], turn[0] = False, other
                        cond.notify_all()
            except RuntimeError as error:  # no new pause once the stop is asked: the hand-over ends
                with cond:
                    refused.append(error)
                    cond.notify_all()
                return
            if done[0]:
                return

    holders = [run_thread(lambda i=i: holder(i), name=f"holder-{i}")[0] for i in (0, 1)]
    assert started.wait(WAIT)
    try:
        stopper, box = run_thread(lambda: manager.stop(block=True, timeout=stop_s), name="stopper")
        stopper.join(stop_s + JOIN_TIMEOUT)
        assert not stopper.is_alive() and "error" not in box
        assert not manager.is_running(), "the flush stop did not complete while holders kept pausing"
        assert refused and "stopping" in str(refused[0])
    finally:
        with cond:
            done[0] = True
            cond.notify_all()
        for t in holders:
            t.join(JOIN_TIMEOUT)
        manager.stop(block=True, timeout=JOIN_TIMEOUT)
    assert not any(t.is_alive() for t in holders)
    assert all(len(o.generated_tokens) == MAX_NEW for o in results(manager, ids))
