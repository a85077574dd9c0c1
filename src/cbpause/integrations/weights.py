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

The forgetting is skipped after a window in which every holder that entered said it left the weights alone
(``pause(weights_changed=False)``) and the weight version did not change (:func:`window_changed_weights`); the
ranks of a TP group agree on it through one MAX all-reduce at the barrier, so that their caches stay alike.

:class:`WeightVersions` labels every generated token with the weight version in force at the step that produced it
(``manager.set_weight_version(v)`` inside a pause; R-VERSIONS): each output carries ``weight_versions``, a list of
``(first_token_index, version)`` spans over its generated tokens.
"""

from __future__ import annotations

import logging
import zlib
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PartialSync",
    "MAX_STALE_RESTARTS", "STALE", "VersionedManager", "WeightVersions", "checked_staleness", "check_model_unchanged",
    "forget_shared_prefixes", "nothing_to_forget", "set_new_version", "agree_versions", "barrier_digest", "ModelLayout",
    "version_digest", "window_changed_weights", "engine_name",
]  # fmt: skip


logger = logging.getLogger("cbpause")

# The error of a request ended by the staleness bound (``max_staleness=``, ``on_stale="abort"``, or ``"restart"`` once
# its restarts are spent): its output's error starts with it.
STALE = "stale: its oldest token is more than max_staleness weight versions behind"
# How many times ``on_stale="restart"`` restarts one request by default (``max_stale_restarts=``): a request that
# needs more forward steps than the updates leave it would otherwise be restarted at every window for ever (issue 40).
MAX_STALE_RESTARTS = 3


FORK_MARK = "__child#"  # transformers names a child it forks for num_return_sequences "<parent>__child#<i>"


def generated_count(state: Any) -> int:
    """The tokens a request generated so far, those a retract (soft reset) moved into its prompt included."""
    moved = len(state.initial_tokens) - state._true_initial_tokens if state._true_initial_tokens else 0
    return moved + len(state.generated_tokens)


class WeightVersions:
    """The weight version in force (``current``, ``None`` until a holder sets one) and each request's spans.

    Two labels per generated token (R-VERSIONS, R-KV-VERSIONS): ``weight_versions``, the version of the weights that
    computed it, and ``kv_versions``, the oldest version among the KV it attended to (the version in force when the
    request's KV, as it holds it now, started being computed: after a keep pause it is older than the token's own;
    after a retract the KV is recomputed and it is the new version).  The loop calls ``launch()`` as it starts a
    forward step and ``read_back()`` as it reads a step's tokens back: a token is labelled with the version of the
    step that computed it, not the version in force when it is read (with async batching, transformers' default
    with CUDA graphs, a step launched before a window is read back after it).  ``note(state)`` runs for every
    request of the step read back.  A retracted request's recomputed prefix produces no token and keeps its labels.
    Holders change ``current`` only inside a pause, when no step runs.
    """

    def __init__(self, max_staleness: int | None = None, on_stale: str = "restart",
                 max_stale_restarts: int = MAX_STALE_RESTARTS) -> None:  # fmt: skip
        self.max_staleness, self.on_stale = max_staleness, on_stale  # R-STALENESS (checked_staleness)
        self.max_stale_restarts = max_stale_restarts  # R-STALENESS's budget: restarts per request, then STALE
        self.restarts: dict[str, int] = {}  # request id -> times the bound restarted it (dropped with its output)
        self.stale = 0  # requests the bound restarted or ended so far
        self.current: Hashable = None
        self.changed = False  # the version changed since the last window's end (read and reset there)
        # set_weight_version was called since the TP group's last barrier, to any version, the same one included: part
        # of what the ranks compare there (R-TP-PARTIAL-WRITE: a write that landed on one rank only and set the
        # version in force, a retry's or None, leaves the labels equal and the weights not)
        self.set_since_barrier = False
        self.unchanged_entries = 0  # holders that entered the current window saying the weights stay as they are
        self.entries_seen = 0  # the protocol's pauses_taken at the last window's end
        self.launched: deque = deque()  # the version of each step launched and not read back yet, oldest first
        self.reading: Hashable = None  # the version of the step being read back
        # request id -> [weight spans, tokens seen, kv spans, its state object, the version its KV started with]
        self._records: dict[str, list] = {}
        # While a traced step is read back: (request id, weight label, kv label) of each new token (a trace's Land)
        self.landing: list | None = None

    def set(self, version: Hashable) -> None:
        """``TypeError``, with nothing changed, for a version that is unhashable or whose equality is not a total,
        plain-bool one (a tensor, whose ``!=`` the loop could not evaluate; NaN, which differs from itself)."""
        self.check(version)
        self.assign(version)

    @staticmethod
    def check(version: Hashable) -> None:
        """What :meth:`set` refuses (the holder's own code runs here: ``__hash__``, ``__eq__``)."""
        hash(version)
        same = _equal(version, version)
        if same is not True:
            raise TypeError(f"a weight version must equal itself with a plain bool (an int, a str, a tuple of "
                            f"them...): {version!r} does not")  # fmt: skip

    def assign(self, version: Hashable) -> bool:
        """:meth:`set` for a checked ``version``; whether it changed the version in force."""
        self.set_since_barrier = True
        if _equal(version, self.current):
            return False
        self.current, self.changed = version, True
        return True

    def launch(self) -> None:
        """A forward step starts, with the weights of ``current``."""
        self.launched.append(self.current)

    def read_back(self) -> None:
        """The tokens of the oldest step launched are read back: they are labelled with its version."""
        self.reading = self.launched.popleft() if self.launched else self.current

    def note(self, state: Any) -> None:
        version = self.reading
        record = self._records.get(state.request_id)
        if record is None:
            record = self._records[state.request_id] = [[], 0, [], state, version]
        elif record[3] is not state:  # a soft-reset copy (a retract): its KV is computed again from this step on
            record[3], record[4] = state, version
        n = generated_count(state)
        if n > record[1]:
            _extend(record[0], record[1], version)
            _extend(record[2], record[1], record[4])
            record[1] = n
            if self.landing is not None:  # with the stream position it was drawn at (-1: not sampled per request)
                draw = getattr(state, "_cbpause_landed", None)
                self.landing.append((state.request_id, version, record[4], -1 if draw is None else draw))

    def behind(self, state: Any, holds_kv: bool) -> int:
        """How many versions the oldest label of ``state``'s tokens, or of the KV it holds, is behind ``current``
        (R-STALENESS); 0 when ``current`` or all of those are not integers (``None`` before any version included)."""
        record = self._records.get(state.request_id)
        if record is None or not _integer(self.current):
            return 0
        olds = [v for _, v in record[0]]
        if holds_kv and record[3] is state:
            olds.append(record[4])
        olds = [v for v in olds if _integer(v)]
        return self.current - min(olds) if olds else 0

    def forget(self, request_id: str) -> None:
        """Drop the labels of ``request_id``: it restarts from its prompt, its tokens discarded."""
        self._records.pop(request_id, None)

    def spans(self, request_id: str, finished: bool) -> tuple[list[tuple[int, Hashable]], list[tuple[int, Hashable]]]:
        """The weight and KV spans of ``request_id`` so far (forgotten once its terminal output is out)."""
        if finished:
            self.restarts.pop(request_id, None)
        record = self._records.pop(request_id, None) if finished else self._records.get(request_id)
        return ([], []) if record is None else (list(record[0]), list(record[2]))


def _integer(version: Hashable) -> bool:
    return isinstance(version, int) and not isinstance(version, bool)


def set_new_version(versions: WeightVersions, before: Hashable) -> bool:
    """Whether the window that just closed set a weight version other than ``before`` (the one in force as it
    opened)."""
    return _equal(versions.current, before) is not True


def checked_staleness(max_staleness: object, on_stale: object,
                      max_stale_restarts: object = MAX_STALE_RESTARTS) -> tuple[int | None, str, int]:  # fmt: skip
    """``init_continuous_batching``'s ``max_staleness`` (``None``, or an integer >= 0), ``max_stale_restarts`` (an
    integer >= 0: how many times one request may be restarted) and ``on_stale``
    (``"restart"`` or ``"abort"``): ``TypeError`` or ``ValueError`` otherwise, before anything is built."""
    if max_staleness is not None:
        if not _integer(max_staleness):
            raise TypeError(f"max_staleness must be None or an integer, not {max_staleness!r}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be at least 0, not {max_staleness}")
    if on_stale not in ("restart", "abort"):
        raise ValueError(f"on_stale must be 'restart' or 'abort', not {on_stale!r}")
    if not _integer(max_stale_restarts):
        raise TypeError(f"max_stale_restarts must be an integer, not {max_stale_restarts!r}")
    if max_stale_restarts < 0:
        raise ValueError(f"max_stale_restarts must be at least 0, not {max_stale_restarts}")
    return max_staleness, on_stale, max_stale_restarts


def _extend(spans: list, first: int, version: Hashable) -> None:
    """Tokens from ``first`` on carry ``version``: a new span unless the last one has it (versions are replaced only
    by unequal ones, so identity is equality here)."""
    if not spans or spans[-1][1] is not version:
        spans.append((first, version))


def check_weights_changed(weights_changed: object) -> None:
    """``pause(weights_changed=...)`` takes a bool only: None or 0 read as "unchanged" would serve KV computed with
    the old weights after a real change (issue 26, point 8)."""
    if not isinstance(weights_changed, bool):
        raise TypeError(f"weights_changed must be True or False, not {weights_changed!r}: nothing was paused")


def _equal(a: object, b: object) -> bool | None:
    """``a == b`` when that is a plain bool, else None (a comparison that raises or answers otherwise)."""
    try:
        same = a == b
    except Exception:
        return None
    return same if isinstance(same, bool) else None


class VersionedManager:
    """The weight-version calls of :class:`~cbpause.integrations.transformers.PausableContinuousBatchingManager`."""

    versions: WeightVersions  # (not each output's weight_versions spans: the book they are read from)
    background_thread_status: Any

    @property
    def weight_version(self) -> Hashable:
        """The version of the weights the loop generates with (R-VERSIONS): ``None`` until a holder sets one."""
        return self.versions.current

    def set_weight_version(self, version: Hashable) -> None:
        """Inside a pause: declare the weights the loop resumes with (any hashable).  Every token generated from the
        resume on is labelled with it (each output's ``weight_versions``: ``(first_token_index, version)`` spans).
        ``RuntimeError`` outside a pause (no holder inside), ``TypeError`` for an unhashable version or one whose
        equality is not a plain bool, total on it (a tensor, NaN); nothing changes on either.  Under tensor parallelism
        every rank sets the same version (one whose ``repr`` is the same in every process): ranks that differ take the
        driver's at the window's barrier, with an error logged on each (:func:`agree_versions`)."""
        status = self.background_thread_status
        if not (status.state.paused and status.state.inside):  # (before the holder's code runs in check)
            raise RuntimeError("set_weight_version() outside a pause: call it inside `with manager.pause():`")
        self.versions.check(version)
        try:  # the set with the window held open: a hostile review set a version after the window had closed
            changed = status.while_held(lambda: self.versions.assign(version))
        except RuntimeError:
            raise RuntimeError("set_weight_version() outside a pause: call it inside `with manager.pause():` (the "
                               "pause ended while the version was being checked)") from None  # fmt: skip
        if changed:  # RequestVersions' Update (a trace's record; nothing without a recorder)
            status.record_labels("Update", version=version)


@dataclass(frozen=True)
class PartialSync:
    """The weight version of an engine whose update failed half-way: some parameters are the new policy's, the others
    the old one's.  ``sync`` names the update: TRL's sync number (:class:`~cbpause.integrations.trl.PauseWeightSync`),
    or the version a server's write was to set (``cbpause serve``, a write cut at its deadline).  Tokens sampled after
    it are labelled with it, never with a policy's version, until a full update sets one."""

    sync: Any


def window_changed_weights(versions: WeightVersions, pauses_taken: int) -> bool:
    """At the end of a window, before the barrier: whether this rank's window may have changed the weights (a holder
    entered without saying ``weights_changed=False``, or the version changed).  ``pauses_taken`` is the protocol's
    count of entries so far.  (The integration then agrees on it with its peers through a MAX all-reduce.)"""
    entered = pauses_taken - versions.entries_seen
    changed = versions.changed or entered > versions.unchanged_entries
    versions.entries_seen, versions.unchanged_entries, versions.changed = pauses_taken, 0, False
    return changed


def nothing_to_forget(processor: Any) -> bool:
    """Whether :func:`forget_shared_prefixes` would change nothing now: prefix sharing is off, or no block was hashed
    since the last forgetting (upstream hashes blocks only in the wrap that ``upstream.never_share_stale_blocks``
    puts on the cache, which says so), no request waits, and the requests in flight are those marked at the last
    window (a steady decode).

    The loop reads it as its window opens, rather than on the resume's path (issue 38), and before it waits for the
    device to finish the last step, which the read overlaps on a GPU: what it reads stays as it is until the window
    closes, since only the loop's own thread hashes blocks and moves requests between the scheduler's queues, and
    the loop is parked in the window (the window's holders reach the scheduler only through the manager's queues,
    which the loop drains at its next group step)."""
    cache = processor.cache
    if not cache.allow_block_sharing:
        return True
    scheduler = processor.scheduler
    return (
        not cache._cbpause_marked
        and not scheduler.waiting_requests
        and cache._cbpause_stale == scheduler.active_requests.keys()
    )


def forget_shared_prefixes(processor: Any) -> None:
    """At the end of a pause window: no request admitted from now on reads KV computed before it (see above)."""
    if nothing_to_forget(processor):
        return
    cache, scheduler = processor.cache, processor.scheduler
    active = scheduler.active_requests
    cache.evict_cached_blocks()  # unreferenced hashed blocks back to the pool, their hashes forgotten
    for allocator in cache.cache_allocators.values():
        ledger = allocator.ledger
        # What remains hashed is held by requests in flight: unhashed, a block goes back to the pool on release.
        ledger.hash_to_block.clear()
        ledger.block_to_hash.clear()
    cache._cbpause_marked = False
    # Replaced, not grown: a request that finished since the last window holds nothing any more.  A waiting request
    # offloaded to the CPU holds old KV too; a retracted one holds none.
    stale = set(active)
    waiting = scheduler.waiting_requests
    if waiting:
        stale.update(i for i, s in waiting.items() if s.is_cpu_offloaded)
    cache._cbpause_stale = stale


def version_digest(version: Hashable) -> int:
    """A digest of a weight version that every process computes alike (from its ``repr``: ints, strs, tuples...)."""
    return zlib.crc32(repr(version).encode()) & 0x7FFFFFFF


def barrier_digest(versions: WeightVersions) -> int:
    """What a rank sends to the TP window's barrier (:func:`agree_versions`): a digest of its version in force and of
    whether it set one since the last barrier (a write that sets the same version on one rank only still differs)."""
    return version_digest((versions.current, versions.set_since_barrier))


def agree_versions(versions: WeightVersions, helper: Any, top: int, bottom: int, changed: bool) -> bool:
    """At a TP window's barrier, after the all-reduce of the ranks' :func:`barrier_digest` (MAX ``top``, MIN
    ``bottom``): when the ranks hold different versions, or some set one in the window and others did not, every rank
    logs an error naming its own and takes ``PartialSync`` of the driver's (broadcast from it), so that the group
    labels every token alike and never with a policy's version: such ranks may hold different weights (a write that
    landed on some ranks only: an update from disk that failed on one rank of a served TP engine, a sync that failed
    half-way on one rank), and a label must not claim a policy the engine may not hold (issue 26, point 12; issue
    42).  A full update that sets one version on every rank ends it.  Returns ``changed``, or True when the versions
    differed (the KV of before may be stale)."""
    versions.set_since_barrier = False
    if top == bottom:
        return changed
    driver = helper.tp_broadcast_object_from_rank_0(versions.current)
    logger.error(
        "the ranks of this TP group hold different weight versions after a pause, or set one on some ranks only "
        "(this rank: %r, the driver: %r): "
        "their weights may differ, so every rank labels its tokens PartialSync(%r) until an update sets one version "
        "on every rank (set_weight_version() with the same value on each rank, after each copied its shard)",
        versions.current, driver, driver,
    )  # fmt: skip
    label = driver if isinstance(driver, PartialSync) else PartialSync(driver)
    if not _equal(label, versions.current):
        versions.current, versions.changed = label, True
    return True


class ModelLayout:
    """What the loop was built for: each parameter's dtype and device, by name (:attr:`dtypes`), and a snapshot of
    the module tree (each module's children and parameters, the objects themselves, with each parameter's dtype and
    device) that :meth:`unchanged` compares in one pass of identity tests: a few microseconds, where a walk of
    ``named_parameters()`` costs tens (the resume pays it after every window that may have changed the weights)."""

    __slots__ = ("dtypes", "_places", "_params")

    def __init__(self, model: Any):
        self.dtypes = {name: (p.dtype, p.device) for name, p in model.named_parameters()}
        modules = list(model.modules())
        params = [(m._parameters, name, p) for m in modules for name, p in m._parameters.items() if p is not None]
        # (the dict that holds it, its key, the object): every child module and every parameter, where it hangs
        self._places = [(m._modules, name, child) for m in modules for name, child in m._modules.items()] + params
        self._params = [(p, p.dtype, p.device) for _, _, p in params]

    def unchanged(self) -> bool:
        """Whether every module and parameter of the snapshot is still in place, with its dtype and device (a module
        or parameter swapped, or ``.to()``, ``.half()``, ``load_state_dict(assign=True)``, all show here)."""
        for place, name, obj in self._places:
            if place.get(name) is not obj:
                return False
        for param, dtype, device in self._params:
            if param.dtype is not dtype or param.device != device:
                return False
        return True


# Where the model changed, and what to do instead, by whether the check is start()'s of a kept batch processor.
_MOVED = {
    False: ("inside a pause", "change dtype or device only while the manager is stopped (stop(), then start() builds "
            "a new cache), or move the model back before the pause ends"),
    True: ("since this manager was stopped with keep_for_next_session=True", "its kept cache was built for the model "
           "as it was: move the model back, or call model.destroy_cached_continuous_batching_manager() and build a "
           "new manager (or stop without keep_for_next_session before changing dtype or device)"),
}


def check_model_unchanged(processor: Any, kept: bool = False) -> None:
    """After a window, before any token of a later step is read back: a holder that moved the model to another dtype
    or device inside the pause gets a clear error (the loop's fatal error, every request in flight failed with it)
    instead of a low-level one from the first kernel that mixes the model with the KV cache, which keeps the dtype
    and device it was built with (where it runs: ``LoopIteration._loop_body``).

    The module tree is compared with the snapshot taken when the loop was built (:class:`ModelLayout`); only a
    difference pays for the full check: every parameter against the layout (a module swapped for one of another
    dtype, a ``float64`` ``lm_head``: issue 26, point 13), and the model's dtype and device against the cache's.  A
    difference that passes (parameters replaced by others of the same dtype and device) becomes the new snapshot.
    It runs after every window, whether or not its holders said they changed the weights: a holder that said
    ``weights_changed=False`` can still move the model, and the snapshot makes the check as cheap either way.

    ``kept``: the check ``start()`` makes of a batch processor kept for this session
    (``stop(keep_for_next_session=True)``), whose cache was built for the model as it was then: the same errors, raised
    there before anything starts, with what to do instead."""
    when, remedy = _MOVED[kept]
    cache, model = processor.cache, getattr(processor, "_cbpause_model", None)
    layout = getattr(processor, "_cbpause_layout", None)
    if model is None or layout is None or layout.unchanged():
        return
    for name, param in model.named_parameters():
        was = layout.dtypes.get(name)
        if was is not None and (param.dtype, param.device) != was:
            raise RuntimeError(
                f"the model's parameter {name!r} became {param.dtype} on {param.device} {when}, where the loop was "
                f"built with {was[0]} on {was[1]}: {remedy}"
            )
    if (model.dtype, model.device) != (cache.dtype, cache.device):
        raise RuntimeError(
            f"the model was moved to {model.dtype} on {model.device} {when}, but the KV cache of this loop is "
            f"{cache.dtype} on {cache.device}: {remedy}"
        )
    processor._cbpause_layout = ModelLayout(model)


# What wraps a parameter's name on the trainer's side and not on the engine's: DDP and FSDP1 (``module.``),
# ``torch.compile`` (``_orig_mod.``), activation checkpointing (``_checkpoint_wrapped_module.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
WRAPPER_INFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def engine_name(name: str) -> str:
    """The engine's name of the trainer's parameter ``name``: the wrappers' prefixes stripped."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    for infix in WRAPPER_INFIXES:
        name = name.replace(infix, "")
    return name
