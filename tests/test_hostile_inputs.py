"""Hostile users, third round (issue 26): inputs that killed the loop or went stale silently, and waits inside one's
own pause that never ended.  On the real CPU loop (tiny Llama).  Each test failed on main before its fix."""

from __future__ import annotations

import math
import queue

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.generation.continuous_batching.requests import RequestStatus  # noqa: E402

from cbpause.integrations import transformers as cbt  # noqa: E402
from cbpause.testing import batching_config, greedy_config, run_thread  # noqa: E402

from .conftest import MAX_NEW, WAIT, results, submit  # noqa: E402


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
