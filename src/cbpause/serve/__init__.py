"""``cbpause serve``: the OpenAI requests RL rollout clients send, on a cbpause manager, with pauses leased over HTTP.

The serving layer.  :func:`build_app` assembles transformers serve's app (:mod:`cbpause.integrations.serving`, the
only module that knows its internals) with the OpenAI routes (:mod:`.openai`: per-request sampling, token ids,
log-probabilities), the control routes (:mod:`.control`), the leases (:mod:`.leases`), the KV cache's size
(:mod:`.capacity`) and the metrics (:mod:`.metrics`).  ``python -m cbpause.serve
CHECKPOINT`` or ``cbpause serve CHECKPOINT`` runs it; ``docs/serving.md`` is its manual.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from ..core.arguments import check_timeout
from ..core.rank import PEER_PARK_TIMEOUT_S
from .guard import MAX_BODY_BYTES
from .leases import MAX_LEASES

__all__ = ["FLUSH_S", "MIN_PEER_JOIN_GRACE_S", "PEER_JOIN_GRACE_S", "build_app", "join_parked_peer_pauses",
           "shutdown"]

FLUSH_S = 4.0  # how long a stopping server lets the requests in flight finish, before it ends them with an error
# How long a rank of a TP engine stays parked for a peer's pause with no holder of its own before it joins that pause
# with an empty window of its own (join_parked_peer_pauses): far longer than a fleet takes to pause every rank.
PEER_JOIN_GRACE_S = 10.0
# The shortest grace (a shorter one would have the joining thread poll the protocol hundreds of times a second).
MIN_PEER_JOIN_GRACE_S = 0.5


def build_app(checkpoint: str, *, weights_dir: str | Path | None = None, default_ttl: float = 30.0,
              device: str = "cpu", dtype: str = "auto", continuous_batching_config: Any = None,
              api_key: str | None = None, served_model_name: str | None = None, max_leases: int = MAX_LEASES,
              max_body_bytes: int = MAX_BODY_BYTES, lease_log: str | Path | None = None,
              tensor_parallel: Any = None, peer_join_grace: float | None = None, max_model_len: int | None = None,
              staging: str = "bounded", **manager_kwargs: Any) -> Any:  # fmt: skip
    """The FastAPI app serving ``checkpoint`` (a local model directory), its manager started.

    ``weights_dir``: the directory ``/update_weights_from_disk`` may read from (``None``: that route answers 403).
    ``default_ttl``: the ttl of a lease that names none, and of every pause taken by a route without leases.
    ``api_key``: every route but ``/health`` then needs ``Authorization: Bearer <api_key>`` (:mod:`.guard`).
    ``served_model_name``: the model's name for clients (default: ``checkpoint`` as given).  ``max_leases``: leases
    waiting or held at once; ``max_body_bytes``: the longest request body.  ``lease_log``: a file the lease table
    appends its actions to, one JSON record a line (``tla/TraceFleetPause.tla`` validates it:
    ``python -m cbpause.tlc.fleet_traces FILE``).
    ``tensor_parallel``: this server is one rank of a tensor-parallel engine
    (:class:`cbpause.integrations.serving.TensorParallel`): it joins the ranks' process group first, then loads its
    shard of the model; only rank 0 takes generation requests (docs/serving.md, "An engine of TP ranks").
    ``peer_join_grace``: how long such a rank stays parked for a peer's pause with no holder of its own before it
    joins it (:func:`join_parked_peer_pauses`): at least ``MIN_PEER_JOIN_GRACE_S``, and below ``peer_park_timeout``
    (or the peers would fail first); ``None``: :data:`PEER_JOIN_GRACE_S`, or half the ``peer_park_timeout`` where
    that is shorter.  Without ``tensor_parallel`` it must be None.
    ``staging``: how an update by broadcast is received, ``"bounded"`` or ``"full"``
    (:data:`cbpause.serve.transfer.broadcast.STAGINGS`; docs/serving.md, R-TORN-HOLD).
    ``max_model_len``: the most tokens (prompt plus answer) a request may have (default: the model's
    ``max_position_embeddings``, lowered to what one request can hold in the KV cache; :mod:`.capacity`).  On the
    CPU, a ``continuous_batching_config`` without ``num_blocks`` gets :func:`.capacity.cpu_default_blocks`.
    ``manager_kwargs`` go to :func:`cbpause.integrations.transformers.init_continuous_batching` (``while_paused``,
    ``max_staleness``, ``on_stale``, ``peer_park_timeout``, ``trace``).  ``app.state.manager`` and
    ``app.state.leases`` are the manager and the lease table; ``app.state.shutdown()`` ends the leases and stops the
    manager (a signal's handler calls it, and so does the app's shutdown).
    """
    from ..integrations.serving import openai_app
    from .guard import Guard
    from .leases import LeaseTable

    root = None if weights_dir is None else Path(weights_dir).resolve()
    if root is not None and not root.is_dir():
        raise ValueError(f"weights_dir {str(weights_dir)!r} is not a directory")
    Guard(None, api_key=api_key, max_body_bytes=max_body_bytes)  # its arguments checked before the model loads
    _check_staging(staging)  # before the model loads
    peer_join_grace = _peer_join_grace(peer_join_grace, manager_kwargs.get("peer_park_timeout", PEER_PARK_TIMEOUT_S),
                                       tensor_parallel is not None)  # fmt: skip
    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                      or max_model_len < 2):  # fmt: skip
        raise ValueError(f"max_model_len must be an integer of at least 2, not {max_model_len!r}")
    config = _batching_config(checkpoint, continuous_batching_config, device, dtype, max_model_len)
    if tensor_parallel is not None:
        tensor_parallel.join(device)
    app, manager, generate = openai_app(checkpoint, device=device, dtype=dtype, continuous_batching_config=config,
                                        served_model_name=served_model_name, tensor_parallel=tensor_parallel,
                                        **manager_kwargs)  # fmt: skip
    try:
        served, size = _served(app, manager, max_model_len)
        log = None if lease_log is None else _log_writer(Path(lease_log))
        leases = LeaseTable(manager, default_ttl=default_ttl, max_leases=max_leases, log=log)
    except BaseException:
        manager.stop(block=True, timeout=10)
        raise
    groups = _add_routes(app, manager, generate, leases, root, served, tensor_parallel, staging)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_body_bytes)  # outermost: before any route
    app.state.manager, app.state.leases, app.state.generate = manager, leases, generate
    app.state.weight_groups = groups
    app.state.served, app.state.cache = served, size  # what the start-up line says: size.describe(max_model_len)
    app.state.shutdown = lambda: shutdown(leases, manager, groups=groups)
    if tensor_parallel is not None:
        threading.Thread(target=join_parked_peer_pauses, args=(manager, peer_join_grace), daemon=True,
                         name="cbpause-tp-peer-join").start()  # fmt: skip
    upstream = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: Any) -> Any:
        async with upstream(app_):
            try:
                yield
            finally:
                shutdown(leases, manager, groups=groups)

    app.router.lifespan_context = lifespan
    return app


def _check_staging(staging: Any) -> None:
    from .transfer.broadcast import STAGINGS

    if staging not in STAGINGS:
        raise ValueError(f"staging must be one of {list(STAGINGS)}, not {staging!r}")


def _add_routes(app: Any, manager: Any, generate: Any, leases: Any, weights_dir: Path | None, served: Any,
                tensor_parallel: Any, staging: str) -> Any:  # fmt: skip
    """The server's own routes on transformers serve's app: the control routes, the OpenAI routes, the weight-update
    group's; its metrics.  Returns the weight-update groups."""
    from .control import add_control_routes
    from .distributed import WeightGroups, add_distributed_routes
    from .metrics import ServerMetrics
    from .openai import TornRefusal, add_openai_routes

    metrics = ServerMetrics(manager, leases, generate)
    add_control_routes(app, manager, leases, weights_dir=weights_dir, metrics=metrics, served=served,
                       tensor_parallel=tensor_parallel)  # fmt: skip
    add_openai_routes(app, manager, generate, _tokenizer(app.state.processor), served, follower=app.state.follower,
                      metrics=metrics, torn=lambda: leases.torn)  # fmt: skip
    groups = WeightGroups()
    add_distributed_routes(app, manager, leases, groups, metrics, staging)
    app.add_middleware(TornRefusal, torn=lambda: leases.torn, count=generate.count)  # transformers' own routes
    return groups


def _batching_config(checkpoint: str, given: Any, device: str, dtype: str, max_model_len: int | None) -> Any:
    """The batching config the server's manager is built with: ``given`` (or transformers' defaults), with a KV cache
    sized from the model on the CPU when it names no ``num_blocks`` (:mod:`.capacity`)."""
    from transformers import AutoConfig, ContinuousBatchingConfig

    from . import capacity

    config = given if given is not None else ContinuousBatchingConfig()
    if str(device).startswith("cpu") and config.num_blocks is None:
        model_config = AutoConfig.from_pretrained(checkpoint)
        config.num_blocks = capacity.cpu_default_blocks(model_config, _dtype(model_config, dtype), config.page_size,
                                                        max_model_len)  # fmt: skip
    return config


def _dtype(model_config: Any, dtype: str) -> Any:
    """The torch dtype the model loads in (``--dtype``; ``auto``: the checkpoint's, float32 when it says none)."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    found = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(found, str):
        found = getattr(torch, found.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else torch.float32


CACHE_WAIT_S = 600.0  # the longest a server waits at start for its loop to build the KV cache


def _served(app: Any, manager: Any, asked: int | None) -> tuple[Any, Any]:
    """What the OpenAI routes know of the server (:class:`.openai.Served`), and the cache's size, once the loop has
    built the cache: ``max_model_len`` is resolved against it (``ValueError`` for an asked one that does not fit)."""
    from ..integrations.admission import cache_size
    from .capacity import CacheSize, resolve_max_model_len
    from .openai import Served

    cache = manager.wait_for_cache(CACHE_WAIT_S)
    if cache is None:
        status = manager.background_thread_status
        raise RuntimeError(f"the generation loop did not build its KV cache: {status.fatal_error or 'it stopped'}")
    size = CacheSize(**cache_size(cache, manager.continuous_batching_config.page_size))
    model = app.state.model
    max_model_len = resolve_max_model_len(asked, model.config, size.per_request)
    generation = model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else model.config.eos_token_id
    eos_ids = tuple(e for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int) and e >= 0)
    served = Served(name=app.state.served_name, checkpoint=app.state.checkpoint, vocab_size=_vocab(model),
                    max_model_len=max_model_len, default_max_tokens=generation.max_new_tokens,
                    sampling=manager.sampler.default, eos_token_ids=eos_ids, chat=app.state.chat,
                    template_arguments=_template_arguments(_tokenizer(app.state.processor)))  # fmt: skip
    return served, size


def _template_arguments(tokenizer: Any) -> frozenset:
    """The chat template's own arguments (the installed release's ``apply_chat_template``'s), which a request's
    ``chat_template_kwargs`` may not set."""
    import inspect

    from .generation import TEMPLATE_ARGUMENTS

    try:
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError, AttributeError):
        return TEMPLATE_ARGUMENTS
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return TEMPLATE_ARGUMENTS | named


def _vocab(model: Any) -> int:
    return int(model.config.get_text_config().vocab_size)


def _tokenizer(processor: Any) -> Any:
    return getattr(processor, "tokenizer", processor)


def _peer_join_grace(grace: float | None, park: float | None, tensor_parallel: bool) -> float:
    """``build_app``'s ``peer_join_grace``, checked (``ValueError``), or its default."""
    if not tensor_parallel:
        if grace is not None:
            raise ValueError("peer_join_grace applies to a rank of a TP engine only (with tensor_parallel)")
        return PEER_JOIN_GRACE_S
    bound = math.inf if park is None else park
    if grace is None:
        return min(PEER_JOIN_GRACE_S, bound / 2)
    try:
        seconds = check_timeout(grace, "peer_join_grace")  # the protocol's own check of a number of seconds
    except ValueError:
        seconds = None
    if seconds is None or not MIN_PEER_JOIN_GRACE_S <= seconds < bound:
        raise ValueError(f"peer_join_grace must be at least {MIN_PEER_JOIN_GRACE_S} s and below peer_park_timeout "
                         f"({park}), not {grace!r}")  # fmt: skip
    return seconds


def join_parked_peer_pauses(manager: Any, grace: float = PEER_JOIN_GRACE_S) -> None:
    """A rank of a TP engine parked for a peer's pause (P-PARK-FOR-PEER) with no holder of its own for ``grace``
    seconds joins it with an empty window (a holder that enters and leaves at once: P-JOIN-PEER-PAUSE), so that a
    pause that reached some ranks only (a fleet pause refused on one rank, a client that paused the driver alone)
    does not lose the engine at ``peer_park_timeout`` (D3; found by issue 42's hostile review).  The weights of this
    rank do not change in that window: if the peer's holder writes, the ranks' versions differ at the barrier and every
    rank labels ``PartialSync`` (R-TP-PARTIAL-WRITE).  The rank then waits at the barrier for the peer's window to
    end, within the group's timeout.  Ends with the loop (the server stops, or the loop failed).  Polls the protocol's
    phase, a few times a grace: nothing here waits on the loop."""
    status = manager.background_thread_status
    parked_since = None
    pace = threading.Event()  # never set: a bounded wait between looks
    while manager.is_running():
        pace.wait(max(MIN_PEER_JOIN_GRACE_S / 4, min(1.0, grace / 4)))
        state = status.state
        if state.phase != "peer" or state.count:
            parked_since = None
            continue
        now = time.monotonic()
        parked_since = parked_since or now
        if now - parked_since < grace:
            continue
        parked_since = None
        try:
            with manager.pause(timeout=grace, weights_changed=False):
                pass
        except Exception as error:  # noqa: BLE001 -- the loop stopped, or the window passed: logged, looked at again
            logger.warning("a parked TP rank could not join its peer's pause: %s", error)


def _log_writer(path: Path) -> Any:
    """Append each record to ``path`` as a JSON line, flushed at once (the caller holds the lease table's lock, so
    the lines are in the order of the actions)."""
    import json

    out = open(path, "a", buffering=1)  # noqa: SIM115 -- open for the server's life; line-buffered

    def write(record: dict) -> None:
        out.write(json.dumps(record) + "\n")

    return write


logger = logging.getLogger("cbpause")
_SHUTTING = threading.Lock()  # a signal's thread and the app's lifespan both stop the server: one after the other


def shutdown(leases: Any, manager: Any, flush_s: float = FLUSH_S, groups: Any = None) -> None:
    """The server stops (a signal, or the app's shutdown): every lease ends and every pause still waiting is left
    (the loop runs again), the requests in flight get ``flush_s`` seconds to finish, and the rest end with an error,
    so that every request the server holds is answered and the loop has exited.  Idempotent, and one call at a
    time (a SIGTERM's handler and the app's lifespan both call it)."""
    with _SHUTTING:
        if groups is not None:
            groups.close()  # a transfer under way then fails at its next collective, and its write with it
        _shutdown(leases, manager, flush_s)


def _shutdown(leases: Any, manager: Any, flush_s: float) -> None:
    leases.close()
    if leases.torn is None:  # torn weights are never stepped, not even to flush (R-TORN-HOLD): requests fail at once
        manager.stop(block=True, timeout=flush_s)  # a flush: the requests in flight finish if they can
    if manager.is_running():
        manager.stop(block=True, timeout=flush_s, hard_stop=True)  # the rest fail: an error is an answer
    leases.release_torn()
