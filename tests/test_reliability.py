"""Every misuse of docs/reliability.md on the real loop: a clear error, nothing changed, nothing lost.

Each test names its row of the bad-input table.  After the misuse the manager must still pause, and every
request must still get its one terminal output.  The 60-second soak (``python -m cbpause.apps.soak``) runs last.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from cbpause.apps import soak  # noqa: E402
from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.testing import JOIN_TIMEOUT, batching_config, greedy_config, run_thread  # noqa: E402

from .conftest import MAX_NEW, PROMPT, WAIT  # noqa: E402

pytestmark = pytest.mark.layer("system")


@pytest.fixture
def manager(plain_manager):
    return plain_manager


def still_usable(manager, n=3):
    """The protocol is unchanged: a pause works, the requests all come back finished."""
    ids = [manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW) for _ in range(n)]
    with manager.pause(timeout=WAIT):
        pass
    outs = {}
    for _ in ids:
        out = manager.get_result(timeout=WAIT)
        outs[out.request_id] = out
    assert sorted(outs) == sorted(ids)
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs.values())
    state = manager.background_thread_status.state
    assert state.count == 0 and state.inside == 0


def test_release_without_acquire(manager):
    manager.start()
    with pytest.raises(RuntimeError, match="without a matching acquire_pause"):
        manager.background_thread_status.release_pause()
    still_usable(manager)


def test_double_release(manager):
    """A drop-in release inside ``with manager.pause()``: the with block owns its pause (``request_and_enter_pause``,
    not the drop-in's ``acquire_pause``), so the stray release raises at once and changes nothing; the block's own
    release at its end is then the only one (before issue 38 the stray one released the pause mid-block and the
    block's end raised)."""
    manager.start()
    status = manager.background_thread_status
    with manager.pause(timeout=WAIT):
        with pytest.raises(RuntimeError, match="without a matching acquire_pause"):
            status.release_pause()
        assert status.state.inside == 1  # still paused: the loop does not step under the block
    assert status.state.count == 0
    still_usable(manager)


def test_release_from_another_thread_than_the_one_that_acquired(manager):
    manager.start()
    inside, leave = threading.Event(), threading.Event()

    def holder():
        with manager.pause(timeout=WAIT):
            inside.set()
            leave.wait(WAIT)

    thread, box = run_thread(holder)
    assert inside.wait(WAIT)
    with pytest.raises(RuntimeError, match="without a matching acquire_pause"):
        manager.background_thread_status.release_pause()
    assert manager.background_thread_status.state.inside == 1  # the holder is still inside
    leave.set()
    thread.join(JOIN_TIMEOUT)
    assert "error" not in box
    still_usable(manager)


def test_stop_inside_a_pause(manager):
    manager.start()
    with manager.pause(timeout=WAIT):
        with pytest.raises(RuntimeError, match="inside a pause"):
            manager.stop(block=True)
    still_usable(manager)


def test_pause_on_a_never_started_or_stopped_manager(manager):
    with pytest.raises(RuntimeError, match="no generation loop is running"):
        with manager.pause(timeout=WAIT):
            pass
    manager.start()
    manager.stop(block=True, timeout=WAIT)
    with pytest.raises(RuntimeError, match="no generation loop is running") as info:
        with manager.pause(timeout=WAIT):
            pass
    assert info.value.__cause__ is None  # stopped, not crashed: no fatal error to chain


def test_invalid_stop_status(manager):
    manager.start()
    for bad in (0, 3, 7, -1, True):
        with pytest.raises(ValueError, match="Invalid stop status"):
            manager.background_thread_status.request_stop(bad, 0)
    still_usable(manager)


def test_negative_or_nan_timeouts(manager):
    manager.start()
    for bad in (-1, -0.5, float("nan"), "1"):
        with pytest.raises(ValueError, match="timeout must be"):
            with manager.pause(timeout=bad):
                pass
    with pytest.raises(ValueError, match="peer_park_timeout"):
        cbt.init_continuous_batching(
            manager.model, greedy_config(MAX_NEW), batching_config(), peer_park_timeout=float("nan")
        )
    still_usable(manager)


def test_clear_while_holders_are_inside_or_the_loop_runs(manager):
    manager.start()
    status = manager.background_thread_status
    with pytest.raises(RuntimeError, match="while the generation loop runs"):
        status.clear()
    with manager.pause(timeout=WAIT):
        with pytest.raises(RuntimeError, match="let them leave first"):
            status.clear()
    still_usable(manager)


@pytest.mark.extended  # a minute and more; CI runs the soak briefly (tests/test_sessions.py): nox -s system
def test_soak_60_seconds_loses_nothing_and_never_hangs(capsys, tlc_ready):
    """60 seconds of soak, and on (``--each``) until every kind of event below has happened: a loaded machine takes
    fewer actions in a minute, and a kind drawn rarely may not have come yet."""
    assert soak.main(["--seconds", "60", "--seed", "7", "--trace-sample", "5", "--each"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("soak: seconds=")
    fields = dict(kv.split("=") for kv in last.split()[1:])
    assert fields["lost"] == "0" and fields["duplicated"] == "0" and fields["hangs"] == "0"
    assert fields["traced"] == "5" and fields["rejected"] == "0"  # five of its traces passed TLC
    for name in ("pauses", "interrupts", "timeouts", "stops", "errors_injected", "misuse", "requests", "deaths",
                 "collected", "handovers", "stops_with_timeout"):
        assert int(fields[name]) > 0, name  # the soak did exercise every kind of event


def test_soak_trace_sample_refuses_a_missing_spec_before_it_starts(tmp_path, capsys):
    assert soak.main(["--seconds", "1", "--trace-sample", "2", "--tla-dir", str(tmp_path)]) == 2
    assert "no PauseProtocol.tla" in capsys.readouterr().err


# ------------------------------------------------------- bad requests are refused at the door (issue 13, 5)

BAD_REQUESTS = [
    ("strings", ["a", "b"], {}, TypeError, "integer token id"),
    ("floats", [1.0, 2.5], {}, TypeError, "integer token id"),
    ("a string prompt", "hello", {}, TypeError, "sequence of token ids"),
    ("booleans", [True, False], {}, TypeError, "integer token id"),
    ("an out-of-vocabulary id", [1, 10_000], {}, ValueError, "not a token id"),
    ("a negative id", [1, -3], {}, ValueError, "not a token id"),
    ("an empty prompt", [], {}, ValueError, "empty"),
    ("max_new_tokens=0", PROMPT, {"max_new_tokens": 0}, ValueError, "at least 1"),
    ("max_new_tokens=-3", PROMPT, {"max_new_tokens": -3}, ValueError, "at least 1"),
    ("max_new_tokens=2.5", PROMPT, {"max_new_tokens": 2.5}, TypeError, "an integer"),
    ("a float tensor", "float tensor", {}, TypeError, "1-D integer tensor"),
]


@pytest.mark.parametrize(("what", "prompt", "kwargs", "error", "match"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_is_refused_at_the_door_and_the_loop_serves_the_others(manager, what, prompt, kwargs, error,
                                                                             match):  # fmt: skip
    """Upstream accepts these and later fails the loop, every good request in flight with it, or finishes them
    silently; here add_request raises and enqueues nothing."""
    if prompt == "float tensor":
        prompt = torch.tensor([1.0, 2.0])
    manager.start()
    with pytest.raises(error, match=match):
        manager.add_request(prompt, **kwargs)
    assert manager.input_queue.empty()
    still_usable(manager)


def test_numpy_and_tensor_prompts_are_token_ids(manager):
    np = pytest.importorskip("numpy")
    manager.start()
    ids = [manager.add_request(np.array(PROMPT), max_new_tokens=np.int64(MAX_NEW)),
           manager.add_request(torch.tensor(PROMPT), max_new_tokens=MAX_NEW)]  # fmt: skip
    outs = [manager.get_result(request_id=None, timeout=WAIT) for _ in ids]
    assert sorted(o.request_id for o in outs) == sorted(ids)
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs)


def test_get_result_from_inside_ones_own_pause_raises_instead_of_waiting_for_ever(manager):
    manager.start()
    with manager.pause(timeout=WAIT):
        manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW)
        with pytest.raises(RuntimeError, match="inside a pause would wait for ever"):
            manager.get_result()
        assert manager.get_result(timeout=0.05) is None  # a bounded wait is allowed: nothing comes meanwhile
    assert manager.get_result(timeout=WAIT).status == RequestStatus.FINISHED
    still_usable(manager)


def test_a_second_manager_on_a_model_driven_by_a_running_one_is_refused(manager):
    """Two loops on one model: a holder of one would see the other's forward steps (R-EXCLUSION)."""
    manager.start()
    second = cbt.init_continuous_batching(manager.model, greedy_config(MAX_NEW), batching_config())
    with pytest.raises(RuntimeError, match="already driven by another running"):
        second.start()
    assert not second.is_running()
    still_usable(manager)
    manager.stop(block=True, timeout=WAIT)
    second.start()  # the first has stopped: the model is free
    try:
        still_usable(second)
    finally:
        second.stop(block=True, timeout=WAIT)


LONG = list(range(1, 50)) * 60  # 2,940 tokens: more than the 2,048 the test cache holds per request


def test_a_prompt_too_long_for_the_cache_is_refused_at_the_door_once_the_cache_exists(manager):
    manager.start()
    still_usable(manager, n=1)  # the loop has built its cache
    with pytest.raises(ValueError, match="cannot fit the KV cache"):
        manager.add_request(LONG, max_new_tokens=MAX_NEW)
    assert manager.input_queue.empty()
    still_usable(manager)


def test_a_prompt_too_long_for_the_cache_sent_before_it_exists_fails_alone(manager):
    """Upstream: "No requests can be scheduled" becomes the loop's fatal error, failing every request in flight."""
    manager.start()  # the loop builds its cache on its own thread: these may come first
    bad = manager.add_request(LONG, max_new_tokens=MAX_NEW)
    good = manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW)
    outs = {}
    for _ in range(2):
        out = manager.get_result(timeout=WAIT)
        outs[out.request_id] = out
    assert outs[bad].status == RequestStatus.FAILED and "cannot fit the KV cache" in outs[bad].error
    assert outs[good].status == RequestStatus.FINISHED
    assert manager.background_thread_status.fatal_error is None
    still_usable(manager)


def test_a_request_id_in_flight_is_refused_and_free_again_once_delivered(manager):
    """Upstream: the duplicate makes the scheduler fail the loop (IndexError) and loses a request."""
    manager.start()
    with manager.pause(timeout=WAIT):  # the first stays in flight meanwhile
        assert manager.add_request(list(PROMPT), request_id="mine", max_new_tokens=MAX_NEW) == "mine"
        with pytest.raises(ValueError, match="already in use"):
            manager.add_request(list(PROMPT), request_id="mine", max_new_tokens=MAX_NEW)
        assert manager.input_queue.qsize() == 1
        with pytest.raises(TypeError, match="request_id must be a string"):
            manager.add_request(list(PROMPT), request_id=7, max_new_tokens=MAX_NEW)
    assert manager.get_result(timeout=WAIT).request_id == "mine"
    assert manager.add_request(list(PROMPT), request_id="mine", max_new_tokens=MAX_NEW) == "mine"  # free again
    assert manager.get_result(timeout=WAIT).status == RequestStatus.FINISHED
    still_usable(manager)


def test_generated_request_ids_skip_the_ids_a_caller_chose(manager):
    manager.start()
    with manager.pause(timeout=WAIT):
        taken = f"req_{manager._request_counter}"  # the id the next generated one would have had
        manager.add_request(list(PROMPT), request_id=taken, max_new_tokens=MAX_NEW)
        generated = manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW)
        assert generated != taken
    outs = {manager.get_result(timeout=WAIT).request_id for _ in range(2)}
    assert outs == {taken, generated}
    still_usable(manager)


def test_a_model_change_the_step_survives_is_caught_before_any_of_its_tokens_is_read_back():
    """The check after a window runs once the next forward step is launched (issue 38: on a GPU it overlaps the
    step).  A change the forward step does not trip over (a parameter it never reads, moved to float64) still ends
    the loop with the check's error, and the step computed after the window hands no token to any request: the
    batch is never read back, and each request fails with exactly the tokens it had before the window (one in
    flight, and one queued in the pause, which makes sure a step follows the window)."""
    from cbpause.testing import tiny_llama

    model = tiny_llama("cpu", 0)
    model.unused = torch.nn.Linear(2, 2)  # in the snapshot of the loop's layout; no forward step reads it
    manager = cbt.init_continuous_batching(model, greedy_config(480), batching_config())
    manager.start()
    try:
        request = manager.add_request(list(PROMPT), max_new_tokens=480, streaming=True)
        first = manager.get_result(request_id=request, timeout=WAIT)
        assert first is not None and first.status != RequestStatus.FAILED
        processor = manager.batch_processor
        read_back = []
        with manager.pause(timeout=WAIT):
            model.unused.to(torch.float64)
            queued = manager.add_request(list(PROMPT), max_new_tokens=4)
            state = processor.scheduler.active_requests[request]  # 480 tokens: still in flight
            before = {request: list(state.generated_tokens), queued: []}
            original = processor.update_batch
            processor.update_batch = lambda: (read_back.append(1), original())[1]
        manager._generation_thread.join(WAIT)
        assert not manager._generation_thread.is_alive()
        error = manager.background_thread_status.fatal_error
        assert error is not None and "'unused.weight' became torch.float64" in str(error)
        assert read_back == []  # the step after the window was launched, and its tokens never read back
        last = {}
        while (out := manager.get_result(timeout=0)) is not None:
            last[out.request_id] = out
        assert {i: list(o.generated_tokens) for i, o in last.items()} == before
        assert all(o.status == RequestStatus.FAILED for o in last.values())
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=WAIT)


def test_a_model_moved_in_a_pause_of_an_idle_loop_fails_it_at_once(manager):
    """Found by review: with the check after the next step's launch, an idle loop (no request after the window)
    served on, and the moved model was reported only at its next request, or never before a ``stop()``.  A window
    with no step after it checks at once: the loop ends with the clear error and the next pause is refused."""
    manager.start()
    model = manager.model
    try:
        with manager.pause(timeout=WAIT):
            model.to(torch.float64)
        manager._generation_thread.join(WAIT)
        assert not manager._generation_thread.is_alive()
        error = manager.background_thread_status.fatal_error
        assert error is not None and "inside a pause" in str(error) and "float64" in str(error)
        with pytest.raises(RuntimeError):
            with manager.pause(timeout=WAIT):
                pass
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=WAIT)
        model.to(torch.float32)


@pytest.mark.parametrize("how", ["to", "load_state_dict(assign=True)"])
def test_a_model_moved_to_another_dtype_inside_a_pause_fails_the_loop_with_a_clear_error(manager, how):
    """Upstream: the next forward step fails with index_copy_'s dtype error.  Stop and start builds a new cache.
    Replacing the parameters (``assign=True``) is seen as well as converting them in place (``.to()``)."""
    manager.start()
    model = manager.model
    try:
        with manager.pause(timeout=WAIT):
            pass  # the check at the resume has found the model's first parameter once
        with manager.pause(timeout=WAIT):
            if how == "to":
                model.to(torch.float64)
            else:
                model.load_state_dict({k: v.double() for k, v in model.state_dict().items()}, assign=True)
        out = manager.get_result(timeout=WAIT) if manager.add_request(list(PROMPT), max_new_tokens=MAX_NEW) else None
        assert out is None or out.status == RequestStatus.FAILED
        thread_done = manager._generation_thread
        thread_done.join(WAIT)
        error = manager.background_thread_status.fatal_error
        assert error is not None and "inside a pause" in str(error) and "float64" in str(error)
        manager.stop(block=True, timeout=WAIT)
        manager.start()  # a new cache, of the new dtype
        still_usable(manager)
    finally:
        if manager.is_running():
            manager.stop(block=True, timeout=WAIT)
        model.to(torch.float32)
