"""Weight versions on every token, and prefix blocks kept only when no holder changed the weights (R-VERSIONS, D6).

Each test holds the loop right after a forward step (:class:`~cbpause.testing.StepGate`), so that it knows how
many tokens every request has when a window opens: the spans of each output must start exactly there.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.testing import StepGate  # noqa: E402

from .conftest import MAX_NEW, WAIT, results, submit  # noqa: E402


def window_after_a_step(manager, version, mode: str = "keep") -> dict[str, int]:
    """Hold the loop after its next forward step, pause it in ``mode`` there and set ``version``; returns how many
    tokens each request in flight had."""
    status = manager.background_thread_status
    gate = StepGate(status, "end_step")
    assert gate.reached.wait(WAIT), "the loop never stepped"
    hold = status.request_pause(mode=mode)
    gate.release()
    status.enter_pause(hold, timeout=WAIT)
    scheduler = manager.batch_processor.scheduler
    states = {**scheduler.active_requests, **scheduler.waiting_requests}
    counts = {i: len(s.generated_tokens) + len(s.initial_tokens) - (s._true_initial_tokens or len(s.initial_tokens))
              for i, s in states.items()}  # fmt: skip
    manager.set_weight_version(version)
    assert manager.weight_version == version
    status.leave_pause(hold)
    return counts


def test_set_weight_version_only_inside_a_pause_and_only_hashable(plain_manager):
    manager = plain_manager
    manager.start()
    with pytest.raises(RuntimeError, match="outside a pause"):
        manager.set_weight_version(1)
    with manager.pause():
        with pytest.raises(TypeError):
            manager.set_weight_version(["not", "hashable"])
        manager.set_weight_version(("step", 1))
    assert manager.weight_version == ("step", 1)
    (out,) = results(manager, submit(manager, 1))
    assert out.weight_versions == [(0, ("step", 1))]


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_spans_start_exactly_at_the_first_token_of_each_version(plain_manager, mode):
    """Two updates while three requests run: every output's spans cover its tokens, each starting at the token
    count the request had when the window opened.  A retracted request's recomputed prefix keeps its labels."""
    manager = plain_manager
    ids = submit(manager, 3)
    gate = StepGate(manager.background_thread_status, "end_step")
    manager.start()
    assert gate.reached.wait(WAIT)
    gate.release()
    first = window_after_a_step(manager, 1, mode)
    second = window_after_a_step(manager, 2, mode)
    outs = results(manager, ids)
    for out in outs:
        i = out.request_id
        assert 0 < first[i] < second[i] < MAX_NEW, (first, second)
        assert out.weight_versions == [(0, None), (first[i], 1), (second[i], 2)], out.weight_versions
        assert len(out.generated_tokens) == MAX_NEW
    later = results(manager, submit(manager, 1))[0]
    assert later.weight_versions == [(0, 2)]


def cached_prefix_blocks(manager) -> int:
    """The blocks kept for prefix sharing, once the loop went past its last window (a request too short to
    complete a block went through it)."""
    results(manager, [manager.add_request([1, 2, 3], max_new_tokens=1)])
    return sum(len(a.ledger.hash_to_block) for a in manager.batch_processor.cache.cache_allocators.values())


def test_prefix_blocks_survive_only_a_window_whose_holders_left_the_weights_alone(plain_manager):
    manager = plain_manager
    manager.start()
    prompt = list(range(1, 70))
    results(manager, [manager.add_request(list(prompt), max_new_tokens=MAX_NEW)])
    kept = cached_prefix_blocks(manager)
    assert kept > 0
    with manager.pause(weights_changed=False):
        pass
    (again,) = results(manager, [manager.add_request(list(prompt), max_new_tokens=MAX_NEW)])
    assert cached_prefix_blocks(manager) >= kept, "a window that changed nothing must keep the shared prefixes"
    with manager.pause(weights_changed=False), manager.pause(weights_changed=True):
        pass  # one holder of the window may have changed the weights: forgotten
    assert cached_prefix_blocks(manager) == 0
    results(manager, [manager.add_request(list(prompt), max_new_tokens=MAX_NEW)])
    with manager.pause(weights_changed=False):
        manager.set_weight_version("new")  # a new version is a change, whatever the holder said
    assert cached_prefix_blocks(manager) == 0
