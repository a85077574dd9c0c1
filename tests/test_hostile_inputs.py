"""Hostile users, third round (issue 26): inputs that killed the loop or went stale silently, and waits inside one's
own pause that never ended.  On the real CPU loop (tiny Llama).  Each test failed on main before its fix."""

from __future__ import annotations

import math
import queue
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.testing import batching_config, greedy_config, run_thread  # noqa: E402

from .conftest import MAX_NEW, WAIT, results, submit  # noqa: E402

pytestmark = pytest.mark.layer("loop")


@pytest.fixture
def manager(plain_manager):
    plain_manager.start()
    return plain_manager


def serves(manager, n: int = 2) -> None:
    outs = results(manager, submit(manager, n))
    assert all(o.status == RequestStatus.FINISHED and len(o.generated_tokens) == MAX_NEW for o in outs), outs


# ------------------------------------------------------------------------------------------ point 5


@pytest.mark.parametrize("how", ["request_id_iter", "iter"])
def test_the_iterators_inside_ones_own_pause_raise_instead_of_waiting_for_ever(manager, how):
    rid = submit(manager, 1)[0]
    outs = []

    def iterate():
        with manager.pause(timeout=WAIT):
            iterator = manager.request_id_iter(rid) if how == "request_id_iter" else iter(manager)
            for out in iterator:  # what was queued before the pause comes out; then it raises
                outs.append(out)

    thread, box = run_thread(iterate, name="iterates-inside")
    thread.join(WAIT)
    assert not thread.is_alive(), "the iterator waited for ever inside its own pause"
    error = box.get("error")
    finished = any(o.is_finished() for o in outs)
    if how == "request_id_iter" and finished:  # the request had finished before the pause: the iterator ended
        assert error is None
    else:
        assert isinstance(error, RuntimeError) and "inside a pause" in str(error), error
    if not finished:  # outside the pause the same iterator streams the rest
        assert list(manager.request_id_iter(rid))[-1].is_finished()
    serves(manager)


def test_request_id_iter_outside_a_pause_still_streams_to_the_end(manager):
    rid = submit(manager, 1)[0]
    outs = list(manager.request_id_iter(rid))
    assert outs and outs[-1].is_finished() and len(outs[-1].generated_tokens) == MAX_NEW


# ------------------------------------------------------------------------------------------ point 7


@pytest.mark.parametrize(
    "version", [torch.tensor([1, 2]), float("nan"), [1, 2]], ids=["tensor", "nan", "unhashable"]
)
def test_a_version_without_a_total_bool_equality_is_refused_and_the_loop_lives(manager, version):
    ids = submit(manager, 2)
    with manager.pause(timeout=WAIT):
        manager.set_weight_version(1)
        with pytest.raises(TypeError):
            manager.set_weight_version(version)
        assert manager.weight_version == 1  # unchanged
    outs = results(manager, ids)
    assert all(o.status == RequestStatus.FINISHED for o in outs)
    serves(manager)


def test_equal_versions_of_another_object_add_no_span(manager):
    ids = submit(manager, 1)
    with manager.pause(timeout=WAIT):
        manager.set_weight_version(10**6)
    with manager.pause(timeout=WAIT):
        manager.set_weight_version(int("1000000"))  # equal, not the same object
        manager.set_weight_version(1e6)  # equal too
    (out,) = results(manager, ids)
    versions = [v for _, v in out.weight_versions]
    assert versions.count(10**6) <= 1 and not any(isinstance(v, float) and math.isnan(v) for v in versions)


# ------------------------------------------------------------------------------------------ point 8


@pytest.mark.parametrize("value", [None, 0, 1, [], "no"])
def test_weights_changed_takes_a_bool_only(manager, value):
    with pytest.raises(TypeError, match="weights_changed must be True or False"):
        with manager.pause(timeout=WAIT, weights_changed=value):
            pytest.fail("entered")
    state = manager.background_thread_status.state
    assert state.count == 0, state
    serves(manager)


# ------------------------------------------------------------------------------------------ point 9


def test_max_new_tokens_none_in_the_generation_config_stops_at_eos_as_upstream(cpu_model):
    """Upstream reads None as "no limit, stop at the end-of-sequence token".  The end token is the greedy model's
    third token, so the request ends there."""
    first = cbt.init_continuous_batching(cpu_model, greedy_config(8), batching_config())
    first.start()
    try:
        (out,) = results(first, submit(first, 1))
    finally:
        first.stop(block=True, timeout=WAIT)
    eos = out.generated_tokens[2]
    config = greedy_config(8)
    config.max_new_tokens, config.eos_token_id = None, eos
    manager = cbt.init_continuous_batching(cpu_model, config, batching_config())
    manager.start()
    try:
        (out,) = results(manager, submit(manager, 1))
    finally:
        manager.stop(block=True, timeout=WAIT)
    assert out.status == RequestStatus.FINISHED, out.error
    assert out.generated_tokens[-1] == eos and len(out.generated_tokens) <= 3


# ------------------------------------------------------------------------------------------ point 11


def test_a_full_input_queue_inside_ones_own_pause_is_refused_at_once(cpu_model):
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config(max_queue_size=2))
    manager.start()
    try:
        with manager.pause(timeout=WAIT):
            ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
            with pytest.raises(queue.Full, match="inside a pause"):
                manager.add_request([1, 2, 3])  # at once, not after 10 s under the submit lock
        outs = results(manager, ids)
        assert all(o.status == RequestStatus.FINISHED for o in outs)
        serves(manager)
    finally:
        manager.stop(block=True, timeout=WAIT)
    assert manager._live_ids == set()


# ------------------------------------------------------------------------------------------ point 4


def final(manager, request_id: str):
    """The last output of ``request_id``, reading past another request's stream."""
    for _ in range(10_000):
        out = manager.get_result(timeout=WAIT)
        assert out is not None, f"no output within {WAIT} s"
        if out.request_id == request_id and out.is_finished():
            return out
    pytest.fail(f"no final output for {request_id}")


@pytest.mark.parametrize("while_paused", ["queue", "reject"])
def test_a_holder_that_dies_waiting_for_a_drain_is_released_during_the_drain(cpu_model, caplog, while_paused):
    """A thread asks for a drain and ends while a long request is in flight.  A drain never parks the loop, which
    used to look for dead holders only when parked: admission stayed closed until the long request ended.  Now the
    first drain step releases the hold, and a short request is served while the long one still runs."""
    import logging

    config = batching_config(num_blocks=256)
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), config, while_paused=while_paused)
    manager.start()
    status = manager.background_thread_status
    try:
        long_id = manager.add_request([1, 2, 3], max_new_tokens=600, streaming=True)
        first = manager.get_result(long_id, timeout=WAIT)  # it is in flight: a drain has something to wait for
        assert first is not None and not first.is_finished()
        with caplog.at_level(logging.ERROR, logger="cbpause"):
            thread, box = run_thread(lambda: status.request_pause(manager._wake_up_loop, mode="drain"), "dies")
            thread.join(WAIT)
            assert not thread.is_alive() and "error" not in box
            with status._lock:
                released = status._condition.wait_for(lambda: status.state.count == 0, WAIT)
        assert released, "the dead holder was not released during the drain"
        assert any("dies" in r.getMessage() and "without leaving" in r.getMessage() for r in caplog.records)
        short = final(manager, manager.add_request([4, 5, 6]))  # admission is open again (reject: no raise)
        assert short.status == RequestStatus.FINISHED
        assert long_id in manager._live_ids, "the long request ended first: this run shows nothing"
    finally:
        manager.stop(block=True, timeout=WAIT, hard_stop=True)


# ------------------------------------------------------------------------------------------ point 6


def reject_manager(cpu_model):
    manager = cbt.init_continuous_batching(
        cpu_model, greedy_config(4), batching_config(num_blocks=512), while_paused="reject"
    )
    manager.start()
    return manager


def test_add_requests_is_all_or_nothing_when_a_pause_comes_while_it_enqueues(cpu_model):
    """A pause asked after the 100th of 400 enqueues: the batch, admitted as one, goes in whole (it used to raise
    after a prefix, with no ids), and every request gets its output."""
    from cbpause import LoopPausedError

    manager = reject_manager(cpu_model)
    status = manager.background_thread_status
    enqueue, holds = manager.enqueue, []

    def enqueue_then_pause(*args, **kwargs):
        if len(manager._live_ids) == 100 and not holds:
            holds.append(status.request_pause(manager._wake_up_loop))  # a pause asked mid-batch
        return enqueue(*args, **kwargs)

    try:
        manager.enqueue = enqueue_then_pause
        prompts = [[1 + i % 7, 2, 3] for i in range(400)]
        ids = manager.add_requests(prompts)
        assert len(ids) == 400 == len(set(ids)) and holds
        with pytest.raises(LoopPausedError):  # the next batch meets the pause at the door: nothing goes in
            manager.add_requests([[1, 2]] * 5)
        assert len(manager._live_ids) <= 400
        status.interrupt(holds[0])
        outs = results(manager, ids)
        assert all(o.status == RequestStatus.FINISHED for o in outs)
        assert manager._live_ids == set()
    finally:
        del manager.enqueue
        manager.stop(block=True, timeout=WAIT)


def test_add_requests_with_a_bad_request_enqueues_nothing(cpu_model):
    manager = reject_manager(cpu_model)
    try:
        with pytest.raises(ValueError):
            manager.add_requests([[1, 2], [3, 4], [10**9]])
        assert manager._live_ids == set() and manager.input_queue.qsize() == 0
        serves_ids = manager.add_requests([[1, 2], [3, 4]])
        assert all(o.status == RequestStatus.FINISHED for o in results(manager, serves_ids))
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_add_requests_skips_a_caller_chosen_id_in_flight(manager):
    with manager.pause(timeout=WAIT):  # keeps the chosen request in flight
        manager.add_request([1, 2, 3], request_id="req_1")
        ids = manager.add_requests([[4, 5]] * 3)
    assert "req_1" not in ids and len(set(ids)) == 3
    outs = results(manager, ["req_1", *ids])
    assert all(o.status == RequestStatus.FINISHED for o in outs)


def test_the_documented_retry_recipe_gets_every_output_while_another_thread_pauses(cpu_model):
    """docs/integration.md's retry loop, while a thread keeps pausing: every id comes back with its output."""
    from cbpause import LoopPausedError

    manager = reject_manager(cpu_model)
    stop, refused = threading.Event(), []

    def keep_pausing():  # pauses with gaps: back-to-back pauses admit nothing in reject mode (docs/integration.md)
        while not stop.wait(0.005):  # the gap
            with manager.pause(timeout=WAIT):
                stop.wait(0.005)  # a workload inside the pause, not a synchronisation

    pauser, box = run_thread(keep_pausing, name="pauser")
    try:
        prompts = [[1 + i % 5, 2, 3] for i in range(50)]
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                ids = manager.add_requests(prompts)
                break
            except LoopPausedError:
                refused.append(1)
                time.sleep(0.005)  # the recipe's back-off
        else:
            pytest.fail(f"refused {len(refused)} times in {WAIT} s")
        outputs = {}
        while len(outputs) < len(ids):  # the recipe's collection
            out = manager.get_result(timeout=WAIT)
            assert out is not None, f"no output within {WAIT} s"
            outputs[out.request_id] = out
    finally:
        stop.set()
        pauser.join(WAIT)
        manager.stop(block=True, timeout=WAIT)
    assert not pauser.is_alive() and "error" not in box
    assert sorted(outputs) == sorted(ids) and all(o.status == RequestStatus.FINISHED for o in outputs.values())


# ------------------------------------------------------------------------------------------ point 13


def test_a_float64_lm_head_swapped_in_inside_a_pause_fails_the_loop_with_a_clear_error(cpu_model):
    """The resume check read only the first parameter: a float64 ``lm_head`` killed the loop with torch's raw dtype
    error.  Now the check names the parameter; stop() and start() serve again once it is put back."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config())
    manager.start()
    head = cpu_model.lm_head
    try:
        with manager.pause(timeout=WAIT):
            cpu_model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.float64)
        rid = manager.add_request([1, 2, 3])
        manager._generation_thread.join(WAIT)
        (out,) = results(manager, [rid])  # failed, with the loop's error: nothing lost
        assert out.status == RequestStatus.FAILED
        error = manager.background_thread_status.fatal_error
        assert error is not None and "'lm_head.weight'" in str(error) and "float64" in str(error), error
    finally:
        cpu_model.lm_head = head
        manager.stop(block=True, timeout=WAIT)
    manager.start()
    try:
        serves(manager)
    finally:
        manager.stop(block=True, timeout=WAIT)


def test_a_step_that_fails_on_a_model_changed_inside_the_pause_says_so_with_the_kernel_s_error_as_cause(cpu_model):
    """Requests in flight across a pause whose holder swapped in a float64 ``lm_head``: the first step after the
    window fails in torch's kernel before the model check runs (the check comes once the step is launched, issue 38).
    The loop's fatal error is still the check's, which names the parameter, the kernel's error its cause; every
    request gets its failed output."""
    manager = cbt.init_continuous_batching(cpu_model, greedy_config(MAX_NEW), batching_config())
    manager.start()
    head = cpu_model.lm_head
    try:
        ids = [manager.add_request([1, 2, 3], max_new_tokens=MAX_NEW) for _ in range(2)]
        with manager.pause(timeout=WAIT):
            cpu_model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.float64)
        manager._generation_thread.join(WAIT)
        assert not manager._generation_thread.is_alive()
        outs = {out.request_id: out for out in results(manager, ids)}
        error = manager.background_thread_status.fatal_error
        assert error is not None and "'lm_head.weight'" in str(error) and "float64" in str(error), error
        assert error.__cause__ is not None and "lm_head" not in str(error.__cause__), error.__cause__
        assert all(out.status == RequestStatus.FAILED for out in outs.values()), outs
    finally:
        cpu_model.lm_head = head
        manager.stop(block=True, timeout=WAIT)


# ------------------------------------------------------------------------------------------ point 10


def test_a_retracted_request_keeps_its_timestamps_created_time_and_lifespan(plain_manager):
    """Retract replaces a request by transformers' soft-reset copy, which restarted its created time and lifespan and
    dropped the timestamps of the tokens it had generated.  Three requests are retracted after a step."""
    from cbpause.testing import StepGate

    manager = plain_manager
    gate = StepGate(manager.background_thread_status, "end_step")
    created = {}
    ids = []
    for prompt in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        ids.append(manager.add_request(prompt, max_new_tokens=MAX_NEW, record_timestamps=True))
    for state in list(manager.input_queue.queue):
        created[state.request_id] = state.created_time
    manager.start()
    assert gate.reached.wait(WAIT), "the loop never stepped"
    status = manager.background_thread_status
    hold = status.request_pause(mode="retract")
    gate.release()
    status.enter_pause(hold, timeout=WAIT)
    started = {i: s.lifespan[0] for i, s in manager.batch_processor.scheduler.waiting_requests.items()}
    status.leave_pause(hold)
    outs = results(manager, ids)
    for out in outs:
        assert out.status == RequestStatus.FINISHED and len(out.generated_tokens) == MAX_NEW
        assert out.timestamps is not None and len(out.timestamps) == len(out.generated_tokens), out.timestamps
        assert out.created_time == created[out.request_id]
        assert out.lifespan[0] == started[out.request_id] and out.lifespan[0] >= 0 and out.lifespan[1] > 0
        assert out.timestamps == sorted(out.timestamps) and out.timestamps[0] >= out.lifespan[0]


def test_a_drop_in_all_reduce_deferred_under_explicit_steps_changes_nothing_when_refused():
    """Issue 27: the drop-in adapter owns its deferred all-reduce; a loop that mixes the APIs keeps the contract
    (the probe raises ``Wrong`` or ``Silent`` otherwise)."""
    from cbpause.apps import hostile

    hostile.PROBES["deferred_all_reduce_under_explicit_steps"]()


def test_the_weight_sync_refuses_every_misuse_and_holds_nothing():
    """Issue 28: TRL's weight transfer misused, interrupted mid-copy, used on a stopped loop (the probe raises
    ``Wrong`` or ``Silent`` otherwise)."""
    pytest.importorskip("trl")
    from cbpause.apps import hostile

    hostile.PROBES["weight_sync_misuse"]()


def test_every_request_made_stale_in_every_mode_restarts_and_is_delivered_once():
    """Issue 28: ``max_staleness=0`` under windows of every mode while requests keep coming."""
    from cbpause.apps import hostile

    hostile.PROBES["stale_requests_in_every_mode"]()


def test_leases_under_races():
    """The hostile probe of issue 29: leases racing their expiry, concurrent resumes, bad lease ids."""
    pytest.importorskip("fastapi")
    from cbpause.apps import hostile

    hostile.PROBES["leases_under_races"]()
