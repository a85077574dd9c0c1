"""Pause modes on the real loop (spec R-MODES, issue 14): keep, retract, drain, abort, and how they combine.

The interleavings are forced: a :class:`~cbpause.testing.StepGate` holds the loop right after a forward step (every
request has a token and more to come), and the holders use the explicit API (``request_pause`` returns at once,
``enter_pause`` waits), so that each test knows which requests are in flight when the group decides the mode.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from cbpause.integrations.modes import ABORTED_BY_PAUSE  # noqa: E402
from cbpause.testing import StepGate, run_thread  # noqa: E402

from .conftest import MAX_NEW, WAIT, results, submit  # noqa: E402

pytestmark = pytest.mark.layer("loop")


def held_after_a_step(manager, n: int = 3) -> tuple[list[str], StepGate]:
    """Submit ``n`` requests and hold the loop right after its next forward step; start it if it is not running."""
    gate = StepGate(manager.background_thread_status, "end_step")
    ids = submit(manager, n)
    if not manager.is_running():
        manager.start()
    assert gate.reached.wait(WAIT), "the loop never stepped"
    return ids, gate


def held_mid_drain(manager):
    """Requests in flight, a holder asking for a drain, and the loop held right after it decided to drain first;
    returns the request ids, the hold and the gate that holds the loop."""
    ids, gate = held_after_a_step(manager)
    drain_gate = StepGate(manager.background_thread_status, "drain_first")
    hold = manager.background_thread_status.request_pause(mode="drain")
    gate.release()
    assert drain_gate.reached.wait(WAIT), "a drain with requests in flight must step the batch first"
    return ids, hold, drain_gate


def enter(status, hold) -> None:
    status.enter_pause(hold, timeout=WAIT)


def tokens(outputs) -> list[list[int]]:
    return [list(o.generated_tokens) for o in outputs]


def nothing_left(manager) -> None:
    """Every request got exactly one terminal output: none is in flight, none is left in the queue."""
    assert manager._live_ids == set()
    assert manager.output_router.output_queue.empty()


def test_an_unknown_mode_raises_and_changes_nothing(plain_manager):
    manager = plain_manager
    manager.start()
    status = manager.background_thread_status
    for bad in ("Keep", "", None, 0, 5, True):
        with pytest.raises(ValueError, match="mode must be one of"):
            with manager.pause(mode=bad):
                pass
        with pytest.raises(ValueError, match="mode must be one of"):
            status.request_pause(mode=bad)
    assert status.state.count == 0
    (out,) = results(manager, submit(manager, 1))
    assert len(out.generated_tokens) == MAX_NEW


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_keep_and_retract_give_the_tokens_of_an_unpaused_run(plain_manager, mode):
    """With the weights unchanged and greedy decoding, a request paused in keep (its KV kept) or in retract (its KV
    freed and recomputed from its prompt and the tokens it had) generates what it would have without the pause."""
    manager = plain_manager
    manager.start()
    unpaused = tokens(results(manager, submit(manager, 3)))
    ids, gate = held_after_a_step(manager)
    status = manager.background_thread_status
    scheduler = manager.batch_processor.scheduler
    hold = status.request_pause(mode=mode)
    gate.release()
    enter(status, hold)
    if mode == "retract":  # inside: no request holds KV; each waits, first in line, with the tokens it had
        assert not scheduler.active_requests
        assert list(scheduler.waiting_requests_order)[: len(ids)] == ids
        assert all(scheduler.waiting_requests[i]._true_initial_tokens == 5 for i in ids)
    else:
        assert sorted(scheduler.active_requests) == sorted(ids)
    status.leave_pause(hold)
    outs = results(manager, ids)
    assert all(o.status == RequestStatus.FINISHED and list(o.prompt_ids) == [1, 2, 3, 4, 5] for o in outs)
    assert tokens(outs) == unpaused
    nothing_left(manager)


def test_abort_ends_every_request_before_the_holder_enters_and_later_ones_run(plain_manager):
    manager = plain_manager
    ids, gate = held_after_a_step(manager)
    status = manager.background_thread_status
    # As transformers' offloading leaves it under cache pressure: lifted only when a request of the batch finishes,
    # which none will (found by the bench: the loop then idled for ever with every later request waiting).
    manager.batch_processor.scheduler.block_new_requests = True
    hold = status.request_pause(mode="abort")
    queued = submit(manager, 1)  # in the input queue when the group decides: aborted too
    gate.release()
    enter(status, hold)
    aborted = results(manager, ids + queued)  # all delivered before the holder got in
    for out in aborted:
        assert out.status == RequestStatus.FAILED and out.error.startswith(ABORTED_BY_PAUSE), out
    assert all(1 <= len(o.generated_tokens) < MAX_NEW for o in aborted[:-1])  # partial tokens kept
    assert not manager.batch_processor.scheduler.has_pending_requests()
    later = submit(manager, 2)  # submitted inside the pause: they wait and run after it
    status.leave_pause(hold)
    assert all(len(o.generated_tokens) == MAX_NEW for o in results(manager, later))
    nothing_left(manager)


def test_drain_finishes_the_batch_first_and_admits_nothing_meanwhile(plain_manager):
    manager = plain_manager
    status = manager.background_thread_status
    ids, hold, drain_gate = held_mid_drain(manager)
    late = submit(manager, 1)  # submitted while the loop drains: not admitted
    drain_gate.release()
    enter(status, hold)
    scheduler = manager.batch_processor.scheduler
    assert not scheduler.active_requests  # the batch is empty while the holder is inside
    drained = results(manager, ids)
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in drained)
    assert manager.output_router.output_queue.empty()  # the late request has not run
    status.leave_pause(hold)
    assert len(results(manager, late)[0].generated_tokens) == MAX_NEW
    nothing_left(manager)


def test_a_request_accepted_during_a_drain_is_finished_by_a_flush_stop_asked_then(plain_manager):
    """Found by issue 40's hostile review of a loop that left new requests in its queue during a drain (where the
    spec then had them): the drain's last observation took nothing, and the flush stop that followed the window
    exited with the request still queued and failed it.  The loop takes its queue in a drain too (its scheduler
    holds what it takes, TLA+ ``Admits``): a flush finishes every request accepted before it."""
    manager = plain_manager
    status = manager.background_thread_status
    ids, hold, drain_gate = held_mid_drain(manager)
    late = submit(manager, 1)  # accepted during the drain
    manager.stop(block=False)  # a flush, asked during the drain
    loop = manager._generation_thread
    drain_gate.release()
    enter(status, hold)
    status.leave_pause(hold)
    loop.join(WAIT)
    assert not loop.is_alive()
    outs = results(manager, ids + late)
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs), outs
    nothing_left(manager)


def test_a_drain_that_times_out_withdraws_and_nothing_is_lost(plain_manager):
    manager = plain_manager
    status = manager.background_thread_status
    ids, hold, drain_gate = held_mid_drain(manager)
    with pytest.raises(TimeoutError):  # the loop is held mid-drain: the window cannot open in time
        status.enter_pause(hold, timeout=0.05)
    assert hold.state == "idle" and status.state.count == 0
    drain_gate.release()
    late = submit(manager, 1)
    outs = results(manager, ids + late)  # the drain ended with its holder: admission resumed
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs)
    nothing_left(manager)


def test_a_stronger_mode_waits_for_the_next_window_and_a_holder_inside_sees_no_change(plain_manager):
    """Holder A is inside a keep window; holder B asks for abort: B does not enter A's window (A's requests stay in
    flight under it), and enters the next one, in abort."""
    manager = plain_manager
    ids, gate = held_after_a_step(manager)
    status = manager.background_thread_status
    scheduler = manager.batch_processor.scheduler
    a = status.request_pause(mode="keep")
    gate.release()
    enter(status, a)
    b = status.request_pause(mode="abort")
    with pytest.raises(TimeoutError):  # the open window is keep: B cannot enter it
        status.enter_pause(b, timeout=0)
    b = status.request_pause(mode="abort")
    thread, box = run_thread(lambda: enter(status, b))
    assert sorted(scheduler.active_requests) == sorted(ids) and b.state == "waiting"  # A sees its requests kept
    status.leave_pause(a)
    thread.join(WAIT)
    assert not thread.is_alive() and box.get("error") is None, box
    assert b.state == "inside" and status.state.tp_pause == 4
    outs = results(manager, ids)
    assert all(o.status == RequestStatus.FAILED and o.error.startswith(ABORTED_BY_PAUSE) for o in outs)
    status.leave_pause(b)
    nothing_left(manager)


@pytest.mark.parametrize("mode", ["keep", "retract", "drain", "abort"])
def test_each_mode_through_the_managers_pause_loses_and_duplicates_nothing(plain_manager, mode):
    manager = plain_manager
    manager.start()
    ids = submit(manager, 4)
    with manager.pause(mode=mode, timeout=WAIT):
        assert manager.background_thread_status.state.tp_pause >= 1
        more = submit(manager, 2)
    outs = results(manager, ids + more)
    for out in outs:
        finished = out.status == RequestStatus.FINISHED and len(out.generated_tokens) == MAX_NEW
        assert finished or (mode == "abort" and out.error.startswith(ABORTED_BY_PAUSE)), out
    assert all(o.status == RequestStatus.FINISHED for o in outs[len(ids) :])
    nothing_left(manager)


def test_reject_admission_raises_a_retryable_error_while_paused_and_enqueues_nothing(cpu_model):
    from cbpause import LoopPausedError
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config

    with pytest.raises(ValueError, match="while_paused"):
        cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), while_paused="drop")
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(), while_paused="reject")
    manager.start()
    try:
        status = manager.background_thread_status
        waiting = status.request_pause()  # asked, not yet (or just) entered: already refused
        with pytest.raises(LoopPausedError, match="retry"):
            manager.add_request([1, 2, 3], max_new_tokens=2)
        status.enter_pause(waiting, timeout=WAIT)
        with pytest.raises(RuntimeError):  # a RuntimeError, as upstream's refusals are
            manager.add_request([1, 2, 3], max_new_tokens=2)
        assert manager._live_ids == set() and manager.input_queue.empty()
        status.leave_pause(waiting)
        (out,) = results(manager, [manager.add_request([1, 2, 3], max_new_tokens=2)])  # retried: accepted
        assert len(out.generated_tokens) == 2
        nothing_left(manager)
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_a_drain_interrupted_mid_way_withdraws_and_the_loop_admits_again(plain_manager):
    manager = plain_manager
    status = manager.background_thread_status
    ids, hold, drain_gate = held_mid_drain(manager)
    status.interrupt(hold)  # P-INTERRUPT in the middle of the drain (a SIGINT while waiting does the same)
    drain_gate.release()
    late = submit(manager, 1)
    outs = results(manager, ids + late)
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs)
    with manager.pause(mode="drain", timeout=WAIT):  # and the next drain works
        assert not manager.batch_processor.scheduler.active_requests
    nothing_left(manager)


@pytest.mark.parametrize("hard", [False, True])
def test_a_stop_during_a_drain_or_an_abort_ends_everything_once(plain_manager, hard):
    """A flush stop asked while a drain is under way: the drain completes, its holder gets its window, then the loop
    flushes and exits; a hard stop with an abort asked: the loop exits before any window, the holder is told, every
    request gets one terminal output."""
    manager = plain_manager
    ids, gate = held_after_a_step(manager)
    status = manager.background_thread_status
    hold = status.request_pause(mode="abort" if hard else "drain")
    manager.stop(block=False, hard_stop=hard)  # asked before the loop's next observation: both reach one decision
    loop = manager._generation_thread
    gate.release()
    if hard:
        with pytest.raises(RuntimeError, match="stopped before it could pause"):
            status.enter_pause(hold, timeout=WAIT)
    else:
        enter(status, hold)
        status.leave_pause(hold)
    loop.join(WAIT)
    assert not loop.is_alive()
    outs = results(manager, ids)
    if not hard:
        assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs)
    assert all(o.status in (RequestStatus.FINISHED, RequestStatus.FAILED) for o in outs)
    assert not manager.is_running()
    nothing_left(manager)
