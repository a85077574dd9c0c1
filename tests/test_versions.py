"""Weight versions on every token, and prefix blocks kept only when no holder changed the weights (R-VERSIONS, D6).

Each test holds the loop right after a forward step (:class:`~cbpause.testing.StepGate`), so that it knows how
many tokens every request has when a window opens: the spans of each output must start exactly there.
"""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from cbpause.testing import StepGate  # noqa: E402

from .conftest import MAX_NEW, WAIT, results, submit  # noqa: E402

pytestmark = pytest.mark.layer("loop")


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


def test_a_version_whose_check_outlasts_the_pause_is_refused_not_set_after_the_window(plain_manager):
    """A hostile review: set_weight_version checked that a pause was held, then ran the version's own ``__hash__``
    and set it; from a thread beside the holder, the set landed after the holder had left and the window had closed,
    while the loop stepped.  The set is now made with the window held open (``PauseProtocol.while_held``), or
    refused."""
    import threading

    from cbpause.testing import run_thread

    hashing, go_on = threading.Event(), threading.Event()

    class GatedVersion(int):
        def __hash__(self) -> int:
            hashing.set()
            go_on.wait(WAIT)
            return int.__hash__(self)

    manager = plain_manager
    manager.start()
    with manager.pause():
        manager.set_weight_version(1)
        thread, box = run_thread(lambda: manager.set_weight_version(GatedVersion(2)), "setter")
        assert hashing.wait(WAIT), "the setter never reached the version's check"
    go_on.set()  # the window has closed: the setter's check ends now
    thread.join(WAIT)
    assert not thread.is_alive()
    assert isinstance(box.get("error"), RuntimeError) and "pause ended" in str(box["error"]), box
    assert manager.weight_version == 1


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_spans_start_exactly_at_the_first_token_of_each_version(plain_manager, mode):
    """Two updates while three requests run: every output's spans cover its tokens, each starting at the token
    count the request had when the window opened.  A retracted request's recomputed prefix keeps its labels.

    R-KV-VERSIONS: in keep mode every token attends to the KV computed before any version was set (its prompt's),
    so its ``kv_versions`` stay at the first version; a retract recomputes the KV with the new weights, so after it
    they follow the weight versions."""
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
        expected_kv = [(0, None)] if mode == "keep" else out.weight_versions
        assert out.kv_versions == expected_kv, out.kv_versions
        assert len(out.generated_tokens) == MAX_NEW
    later = results(manager, submit(manager, 1))[0]
    assert later.weight_versions == later.kv_versions == [(0, 2)]


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


def test_the_forgetting_s_verdict_read_as_a_window_opens_still_holds_as_it_closes(plain_manager, monkeypatch):
    """Issue 38: the loop reads ``nothing_to_forget`` as its window opens (its caches warm from the step) and acts on
    it as the window closes.  Whatever the window's holders do (submit, cancel, set a version, nest a second pause,
    say the weights stayed), the verdict read again at the close is the one read at the opening; windows of both
    verdicts are seen (a window after new requests were admitted has something to forget, a steady one nothing)."""
    from cbpause.integrations import weights

    manager = plain_manager
    original, changed = weights.nothing_to_forget, weights.window_changed_weights
    opened: list = []
    compared: list[tuple[bool, bool]] = []

    def at_open(processor) -> bool:
        verdict = original(processor)
        opened.append((processor, verdict))
        return verdict

    def at_close(versions, pauses_taken) -> bool:
        processor, verdict = opened[-1]  # (the forgetting's own call comes after this)
        compared.append((verdict, original(processor)))
        return changed(versions, pauses_taken)

    monkeypatch.setattr(weights, "nothing_to_forget", at_open)
    monkeypatch.setattr(weights, "window_changed_weights", at_close)
    manager.start()
    ids = submit(manager, 3, list(range(1, 40)))
    for i in range(30):
        with contextlib.ExitStack() as stack:
            stack.enter_context(manager.pause(timeout=WAIT, weights_changed=i % 3 != 0))
            kind = i % 5
            if kind == 1:
                ids.append(manager.add_request(list(range(1, 40)), max_new_tokens=MAX_NEW))
            elif kind == 2 and ids:
                manager.cancel_request(ids.pop(0))
            elif kind == 3:
                manager.set_weight_version(i)
            elif kind == 4:
                stack.enter_context(manager.pause(timeout=0))  # this thread's pauses nest: a second hold
    manager.stop(block=True, timeout=WAIT)
    assert len(compared) >= 30, compared
    assert all(at_opening == at_closing for at_opening, at_closing in compared), compared
    assert {verdict for verdict, _ in compared} == {True, False}, compared


class _State:
    """The fields of transformers' RequestState that WeightVersions reads."""

    def __init__(self, request_id: str) -> None:
        self.request_id, self.initial_tokens, self._true_initial_tokens, self.generated_tokens = request_id, [1], 0, []


def test_a_step_launched_before_a_window_is_labelled_with_the_version_that_computed_it():
    """Async batching reads a step's tokens back one iteration later, after a window that may have set a new version:
    the tokens carry the version of the step that computed them (R-VERSIONS), and the KV label follows."""
    from cbpause.integrations.weights import WeightVersions

    versions, state = WeightVersions(), _State("r")
    versions.launch()  # step 1 (async: not read back yet)
    versions.read_back()  # (the bootstrap's read-back is of nothing)
    versions.launch()  # step 2, launched with the version of before the window
    versions.set(1)  # the window, between the launch and the read-back
    versions.read_back()
    state.generated_tokens.append(7)
    versions.note(state)
    versions.launch()  # step 3, after the window
    versions.read_back()
    state.generated_tokens.append(8)
    versions.note(state)
    assert versions.spans("r", finished=True) == ([(0, None), (1, 1)], [(0, None)])


ASYNC_ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (async batching needs one)")


@pytest.mark.cuda
@ASYNC_ON_CUDA
def test_async_batching_never_labels_a_token_computed_before_a_window_with_its_version():
    """On CUDA with async batching (batch k+1 launched before batch k's tokens are read back): at a window, the step
    in flight was computed with the old weights, so each request's first token of the new version comes one token
    after the count read back when the window opened."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    manager = cbt.init_continuous_batching(tiny_llama("cuda"), greedy_config(MAX_NEW),
                                           batching_config(use_async_batching=True))  # fmt: skip
    try:
        ids = submit(manager, 3)
        gate = StepGate(manager.background_thread_status, "end_step")
        manager.start()
        assert gate.reached.wait(WAIT)
        gate.release()
        counts = window_after_a_step(manager, 1)
        outs = results(manager, ids)
    finally:
        manager.stop(block=True, timeout=WAIT)
    for out in outs:
        first = counts[out.request_id]
        assert 0 < first < MAX_NEW
        assert out.weight_versions == [(0, None), (first + 1, 1)], (first, out.weight_versions)
        assert out.kv_versions == [(0, None)]


def _old_forget(processor) -> None:
    """``forget_shared_prefixes`` as it was before its fast path (issue 38): the specification the fast one keeps."""
    cache, scheduler = processor.cache, processor.scheduler
    if not cache.allow_block_sharing:
        return
    cache.evict_cached_blocks()
    for allocator in cache.cache_allocators.values():
        allocator.ledger.hash_to_block.clear()
        allocator.ledger.block_to_hash.clear()
    waiting = scheduler.waiting_requests
    cache._cbpause_stale = {*scheduler.active_requests, *(i for i, s in waiting.items() if s.is_cpu_offloaded)}


def _fake_processor(allocators: list, active: list, waiting: dict, stale: set, sharing: bool, marked: bool = True):
    """A processor with upstream's ledgers and cache eviction, and what the forgetting reads of the scheduler;
    ``marked``: a block may have been hashed since the last forgetting (always, where a ledger holds one)."""
    from types import SimpleNamespace

    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger

    freed: list = []
    marked = marked or any(hashed for hashed, _ in allocators)
    pool = SimpleNamespace(free_blocks=lambda index, blocks: freed.append((index, list(blocks))))
    cache = SimpleNamespace(allow_block_sharing=sharing, cache_allocators={}, _cbpause_stale=set(stale),
                            _cbpause_marked=marked, pool=pool)  # fmt: skip
    cache.evict_cached_blocks = lambda: PagedAttentionCache.evict_cached_blocks(cache)
    for index, (hashed, cached) in enumerate(allocators):
        ledger = BlockLedger()
        for block in hashed:
            ledger.register_new_hash(block, 1000 + block)
        for block in cached:
            ledger.cached_blocks[block] = None
        cache.cache_allocators[f"a{index}"] = SimpleNamespace(index=index, ledger=ledger)
    scheduler = SimpleNamespace(active_requests={i: None for i in active},
                                waiting_requests={i: SimpleNamespace(is_cpu_offloaded=o) for i, o in waiting.items()})
    return SimpleNamespace(cache=cache, scheduler=scheduler), freed


def _what_it_left(processor, freed: list) -> tuple:
    cache = processor.cache
    ledgers = [(dict(a.ledger.hash_to_block), dict(a.ledger.block_to_hash), list(a.ledger.cached_blocks))
               for a in cache.cache_allocators.values()]  # fmt: skip
    return ledgers, freed, cache._cbpause_stale


def test_the_forgetting_s_fast_path_leaves_what_the_whole_forgetting_did():
    """Issue 38: ``forget_shared_prefixes`` skips its work where it would change nothing (nothing hashed, no request
    waiting, the requests in flight those marked at the last window).  Over random ledgers and schedulers, it leaves
    exactly what the forgetting without the fast path left: the same hashes, the same blocks back to the pool, the
    same requests marked."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cbpause.integrations.weights import forget_shared_prefixes

    ids = st.sampled_from(["r0", "r1", "r2", "r3"])
    blocks = st.sets(st.integers(0, 7), max_size=4)
    ledger = blocks.flatmap(lambda hashed: st.tuples(st.just(hashed), st.sets(st.sampled_from(sorted(hashed)))
                                                     if hashed else st.just(set())))  # fmt: skip

    @settings(max_examples=300, deadline=None)
    @given(st.lists(ledger, min_size=1, max_size=2), st.lists(ids, unique=True), st.dictionaries(ids, st.booleans()),
           st.sets(ids), st.booleans(), st.booleans())  # fmt: skip
    def check(allocators, active, waiting, stale, sharing, marked):
        waiting = {i: o for i, o in waiting.items() if i not in active}
        old, new = (_fake_processor(allocators, active, waiting, stale, sharing, marked) for _ in range(2))
        _old_forget(old[0])
        forget_shared_prefixes(new[0])
        assert _what_it_left(*new) == _what_it_left(*old)

    check()
    # The fast path is taken, and taken only where nothing changes: a second forgetting with nothing new.
    processor, freed = _fake_processor([({1, 2}, {2})], ["r0", "r1"], {}, set(), True)
    forget_shared_prefixes(processor)
    assert freed == [(0, [2])] and processor.cache._cbpause_stale == {"r0", "r1"}
    assert not processor.cache._cbpause_marked  # the ledgers are empty now
    marked = processor.cache._cbpause_stale
    forget_shared_prefixes(processor)
    assert processor.cache._cbpause_stale is marked  # not rebuilt
