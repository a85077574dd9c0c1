"""What a pause means for the KV cache: the model it was built for (dtype, device), and the blocks the loop shares
between requests (D6, issue 14).

Part of the integration (with :mod:`cbpause.integrations.transformers` and :mod:`~cbpause.integrations.admission`,
the only code of cbpause that knows transformers' internals).

transformers' prefix sharing (``ContinuousBatchingConfig.allow_block_sharing``, on by default) keeps the KV
blocks of earlier prompts, indexed by a hash of their tokens, and hands them to any later request whose prompt
starts with the same tokens.  The hash says nothing of the weights: after a pause that updated the weights in
place, a new request would read KV computed with the old ones, and silently generate what the old model would
have (D6, upstream's too).  So, at the end of every pause window (every rank passes there, at the same point of
its iteration, so the ranks of a TP group stay in step), :func:`forget_shared_prefixes`:

* returns the cached blocks that no request holds to the pool, forgetting their hashes;
* forgets the hashes of the blocks that requests in flight still hold (they keep reading them: that is the
  ``keep`` behaviour of a pause), so that no new request matches them;
* marks those requests as written with earlier weights, so that the blocks they complete later (whose KV
  attends over the old) are never offered for sharing either.

Holders cannot say yet that they left the weights alone (issue 14's ``weights_changed=False``): that needs the
group to agree through its all-reduce, or the ranks' caches would diverge.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_model_unchanged", "forget_shared_prefixes", "never_share_stale_blocks"]


def never_share_stale_blocks(processor: Any) -> None:
    """Wrap the cache's ``mark_complete_blocks`` on the instance: blocks that a request written with earlier weights
    completes are not registered for sharing.  Idempotent (a reused processor keeps its wrapper)."""
    cache = processor.cache
    if hasattr(cache, "_cbpause_stale"):
        return
    cache._cbpause_stale = set()  # ids of the requests in flight at the last pause window (ids are unique in flight)
    mark = cache.mark_complete_blocks

    def mark_complete_blocks(state: Any, complete_blocks: dict[str, int]) -> None:
        if state.request_id not in cache._cbpause_stale:
            mark(state, complete_blocks)

    cache.mark_complete_blocks = mark_complete_blocks


def forget_shared_prefixes(processor: Any) -> None:
    """At the end of a pause window: no request admitted from now on reads KV computed before it (see above)."""
    cache, scheduler = processor.cache, processor.scheduler
    if not cache.allow_block_sharing:
        return
    cache.evict_cached_blocks()  # unreferenced hashed blocks back to the pool, their hashes forgotten
    for allocator in cache.cache_allocators.values():
        ledger = allocator.ledger
        # What remains hashed is held by requests in flight: unhashed, a block goes back to the pool on release.
        ledger.hash_to_block.clear()
        ledger.block_to_hash.clear()
    # Replaced, not grown: a request that finished since the last window holds nothing any more.  Waiting ones
    # too: a retracted or offloaded request may hold old KV.
    cache._cbpause_stale = {*scheduler.active_requests, *scheduler.waiting_requests}


def check_model_unchanged(processor: Any) -> None:
    """At the resume: a holder that moved the model to another dtype or device inside the pause gets a clear error
    (the loop's fatal error, every request in flight failed with it) instead of a low-level one from the first
    kernel that mixes the model with the KV cache, which keeps the dtype and device it was built with."""
    cache, model = processor.cache, getattr(processor, "_cbpause_model", None)
    if model is None:
        return
    if (model.dtype, model.device) != (cache.dtype, cache.device):
        raise RuntimeError(
            f"the model was moved to {model.dtype} on {model.device} inside a pause, but the KV cache of this loop is "
            f"{cache.dtype} on {cache.device}: change dtype or device only while the manager is stopped (stop(), "
            "then start() builds a new cache), or move the model back before the pause ends"
        )
