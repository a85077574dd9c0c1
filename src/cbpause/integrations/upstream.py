"""The one table of what the integration changes in transformers, with a fingerprint of each upstream function it
touches; and the patches of the loop's objects.

The integration changes transformers' continuous batching (``transformers.generation.continuous_batching``) and its
server (``transformers serve``, ``transformers.cli.serving``, which :mod:`cbpause.integrations.serving` runs on a
cbpause manager, through :mod:`~cbpause.integrations.serving_manager` on 5.23-5.24 and
:mod:`~cbpause.integrations.serving_engine` on 5.25) in five ways:

* subclasses whose methods override upstream's (``PausableContinuousBatchingManager``, ``PausableBatchProcessor``,
  which the manager swaps in with ``__class__``, ``TrackingRouter``, ``RetractedRequestState``,
  ``PausableCBGenerateManager`` on 5.23-5.24, ``PausableEngine`` and ``PausableModelManager`` on 5.25);
* methods wrapped on an instance (:data:`WRAPPED`: the wrapper calls upstream's, and upstream's own caller must still
  call it), or replaced on one (:data:`REPLACED`: the model loader of a tensor-parallel rank);
* the ``_cbpause_*`` attributes those wrappers keep on the instance (:data:`STAMPS`);
* upstream's own private attributes that the integration sets (:data:`SETS`: the server's generation manager, built
  at start-up where upstream builds one lazily), with the upstream functions that read them;
* routes of upstream's app that the server takes away (:data:`REMOVED_ROUTES`).

No line of transformers is copied into the project; where the integration must do what an upstream function does,
it calls it or restates it in its own words (:data:`RESTATED`).  So every upstream function the integration
overrides, wraps, reads through a private attribute, edits the routes of or restates, and every caller of a wrapped
method, has a fingerprint here (:data:`FINGERPRINTS`: a hash of its source in the transformers version the
integration was checked against), and ``tests/test_upstream_copies.py`` fails when the installed transformers
differs anywhere in one of them (a copy check could not see a line upstream adds around copied lines, nor upstream
ceasing to call a method the integration wrapped), or when an override, a wrap, a stamp, an attribute or a route is
missing from the tables.  Names are relative to ``transformers.generation.continuous_batching``, or, starting with
``cli.``, to ``transformers``.

The patches of the loop's objects are here too (:func:`patch_processor`, which the manager applies to every batch
processor upstream builds, and the wraps it installs); the subclasses' overrides live with their classes, and the
server's patches in :func:`cbpause.integrations.serving.openai_app` and the two modules' ``build``.  A name of the
tables that a release no longer has (5.23's server names on 5.25) is mapped to ``None`` in that release's
:data:`CHANGED_IN`: :func:`dropped`.

``python -m cbpause.integrations.upstream`` prints the table for the installed transformers (to review the
changes of a new release, then update :data:`FINGERPRINTS`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from typing import Any

from . import admission, modes, weights

__all__ = [
    "CANCELLED", "CHANGED_IN", "CHECKED_WITH", "FINGERPRINTS", "REMOVED_ROUTES", "REPLACED", "RESTATED", "SERVED",
    "SERVER_WITH_MANAGER", "SETS", "STAMPS", "WRAPPED", "dropped",
    "deliver_cancellations", "fingerprint", "fingerprints", "hold_admission", "release", "replaced",
    "never_share_stale_blocks",
    "patch_processor", "refuse_what_cannot_fit", "sample_per_request",
    "upstream_function", "upstream_name",
]  # fmt: skip

# The release each minor version's fingerprints were taken on (docs/transformers-releases.md: how a new one is taken
# in).  FINGERPRINTS is 5.23.0's; CHANGED_IN holds what a later release changed, each change reviewed.
CHECKED_WITH = {"5.23": "5.23.0", "5.24": "5.24.0", "5.25": "5.25.0"}
# The releases whose `transformers serve` cbpause.integrations.serving runs on (all: issue 41 ported the 5.25 server),
# and those whose server calls an in-process CBGenerateManager (serving_manager); 5.25 rebuilt it (handlers call an
# EngineClient of a worker process), which serving_engine replaces with an engine in this process.
SERVED = ("5.23", "5.24", "5.25")
SERVER_WITH_MANAGER = ("5.23", "5.24")
_PACKAGE = "transformers.generation.continuous_batching."
_CLI = "cli."  # names under transformers itself (the server's)

# Methods wrapped on an instance: "module.Class.method" -> the upstream functions that call it (they must still).
WRAPPED = {
    "scheduler.Scheduler._get_waiting_candidates": (  # hold_admission: a drain admits nothing new
        "scheduler.FIFOScheduler.schedule_batch", "scheduler.PrefillFirstScheduler.schedule_batch",
    ),
    "scheduler.Scheduler.add_waiting_request": (  # admission.refuse_what_cannot_fit: a request too long fails alone
        "continuous_api.ContinuousBatchProcessor._update_tp_group_state",
    ),
    "scheduler.Scheduler.clear_cancelled_requests": (  # admission.deliver_cancellations: a cancelled request's output
        "continuous_api.ContinuousBatchProcessor.prepare_next_batch",
    ),
    "cache.PagedAttentionCache.mark_complete_blocks": (  # weights.never_share_stale_blocks: no stale prefix (D6)
        "continuous_api.ContinuousBatchProcessor.update_batch",
    ),
    # sample_per_request: the top log-probabilities ride on each token's log-probability through the read-back
    "input_outputs.ContinuousBatchingIOs.prepare_batch_update": (
        "continuous_api.ContinuousBatchProcessor.update_batch",
        "continuous_api.ContinuousBatchProcessor.handle_batch_error",
    ),
    "input_outputs.ContinuousBatchingAsyncIOs.prepare_batch_update": (
        "continuous_api.ContinuousBatchProcessor.update_batch",
        "continuous_api.ContinuousBatchProcessor.handle_batch_error",
    ),
}  # fmt: skip

# Methods replaced on an instance (the replacement does not call upstream's: it restates it, changed), and the upstream
# functions that call them (they must still).  serving.load_sharded: a rank of a tensor-parallel engine loads its
# shard (from_pretrained with a DistributedConfig), where transformers serve loads the whole model; on 5.23-5.24 the
# model manager's __init__ loads the forced model through load_model_and_processor, so the replacement is made first.
REPLACED = {
    # sample_per_request (per_request_sampling=True): the model runner's sampling step is the Sampler's (R-SAMPLING).
    "model_runner.ModelRunner._sample": ("model_runner.ModelRunner._forward_process_and_sample",),
    "cli.serving.model_manager.ModelManager._load_model": (
        "cli.serving.model_manager.ModelManager.load_model_and_processor",
    ),
    "cli.serving.model_manager.ModelLoader._load_model": (
        "cli.serving.model_manager.ModelLoader.load_model_and_processor",
    ),
}

# Upstream functions whose behaviour the integration restates in its own words without overriding them.
RESTATED = {
    "continuous_api.ContinuousMixin.init_continuous_batching": "init_continuous_batching and _configs",
    # The calls a batch processor, its IO buffers and its model runner make on their logits-processor list.
    "cb_logits_processors.ContinuousBatchingLogitsProcessorList": "sampling.Sampler (per_request_sampling=True)",
    "cli.serve.Serve.__init__": "serving.openai_app and the server modules' build (the model manager, the handlers)",
}

# Upstream's private attributes the integration sets on upstream's objects, and the upstream functions that read them.
SETS = {
    # per_request_sampling=True: the manager's logits-processor list is a sampling.Sampler, which upstream hands to each
    # batch processor it builds (and that one to its IO buffers and its model runner).
    "continuous_api.ContinuousBatchingManager.logit_processor": (
        "continuous_api.ContinuousBatchingManager.__init__",
        "continuous_api.ContinuousBatchingManager._create_batch_processor",
    ),
    "continuous_api.OutputRouter.result_handlers": (  # serving: a refused request's handler taken back, duplicates
        # seen; serving_manager (5.23-5.24): a streamed request's handler wrapped
        "continuous_api.OutputRouter.__init__", "continuous_api.OutputRouter.deliver",
        "continuous_api.OutputRouter.deliver_batch", "continuous_api.ContinuousBatchingManager.register_result_handler",
    ),
    "cli.serving.utils.GenerationState._cb_manager": (  # serving_manager.build: the cbpause manager, built at start-up
        "cli.serving.utils.GenerationState.__init__", "cli.serving.utils.GenerationState.get_manager",
        "cli.serving.utils.GenerationState.shutdown", "cli.serving.utils.GenerationState.is_cb_alive",
    ),
    "cli.serving.utils.GenerationState._cb_model_id": (  # the model it serves, so get_manager keeps it
        "cli.serving.utils.GenerationState.__init__", "cli.serving.utils.GenerationState.get_manager",
    ),
}  # fmt: skip

# Routes of upstream's app (built by the function named) that the server removes: /reset and /load_model would unload
# the model the manager steps; /v1/systemone runs the model through upstream's own sequential manager, outside the
# pausable loop (during a pause, during a weight write, with no version labels), and /v1/audio/transcriptions serves
# speech models, not the text checkpoint served here (issue 39's review: a 500).  /v1/completions,
# /v1/chat/completions and /v1/models are cbpause.serve.openai's (per-request sampling, token ids, log-probabilities,
# n, stop: none of which upstream's handlers take).
REMOVED_ROUTES = {route: "cli.serving.server.build_server"
                  for route in ("/reset", "/load_model", "/v1/systemone", "/v1/audio/transcriptions",
                                "/v1/completions", "/v1/chat/completions", "/v1/models")}

# The attributes the integration keeps on upstream's objects, and who sets them.
STAMPS = {
    "_cbpause_holds_admission": "the scheduler (hold_admission)",
    "_cbpause_delivers_cancellations": "the scheduler (admission.deliver_cancellations)",
    "_cbpause_stale": "the cache (never_share_stale_blocks)",
    "_cbpause_marked": "the cache (the same): a block may have been hashed since the last forgetting",
    "_cbpause_model": "the batch processor (PausableContinuousBatchingManager._create_batch_processor)",
    "_cbpause_layout": "the batch processor (the same; weights.check_model_unchanged renews it)",
    "_cbpause_check_due": "the batch processor (the same; the window sets it, the next forward step's launch checks)",
    "_cbpause_inference_mode": "the batch processor (the same): the inference mode its tensors were made in",
    "_cbpause_draws": "a request's state (sampling.Sampler): the position of its seed's stream it draws next",
    "_cbpause_drawn": "a request's state (the same): its draws not yet read back (a penalty's tokens, top logprobs)",
    "_cbpause_landed": "a request's state (the same): the stream position of the token read back last",
    "_cbpause_read_back": "the IO buffers' prepare_batch_update (sample_per_request): wrapped once",
}

# sha256 (first 16 hex digits) of each upstream function's source in transformers 5.23.0.
FINGERPRINTS = {
    "continuous_api.ContinuousBatchingManager.register_result_handler": "5c1b552714bb0cd7",
    "cli.serve.Serve.__init__": "9cdf7dd30dfecd7d",
    "cli.serving.server.build_server": "84b2277b9e8d679b",
    "cli.serving.utils.CBGenerateManager.__init__": "da83f8210fe5dc3e",
    "cli.serving.utils.CBGenerateManager._check_alive": "a904b9c9e8c4e3c7",
    "cli.serving.utils.CBGenerateManager.generate_non_streaming": "c4d880fcd99dcb24",
    "cli.serving.utils.CBGenerateManager.generate_streaming": "6097bafe29e501ca",
    "cli.serving.utils.CBGenerateManager.init_cb": "ef34b6aa0ba099ce",
    "cli.serving.utils.CBGenerateManager.stop": "13a680db9a536877",
    "cli.serving.utils.GenerationState.__init__": "8b18fa6979b7d6de",
    "cli.serving.utils.GenerationState.get_manager": "f8add1ae52618ef0",
    "cli.serving.utils.GenerationState.is_cb_alive": "b07acf4f9715d4ed",
    "cli.serving.utils.GenerationState.shutdown": "7960f7e614fc9ba1",
    "cache.PagedAttentionCache.mark_complete_blocks": "f6255bb6c6a6eb93",
    "continuous_api.ContinuousBatchProcessor._update_tp_group_state": "2731052eb9413443",
    "continuous_api.ContinuousBatchProcessor._generation_step": "91e7d3b5bd328f31",
    "continuous_api.ContinuousBatchProcessor.prepare_next_batch": "cbc297079d4a9591",
    "continuous_api.ContinuousBatchProcessor.update_batch": "cbad955852af2e67",
    "continuous_api.ContinuousBatchingManager.__init__": "c17deedf60b75aab",
    "continuous_api.ContinuousBatchingManager.__iter__": "df8fe3ab4db08d61",
    "continuous_api.ContinuousBatchingManager._create_batch_processor": "cc0fca82818d2471",
    "continuous_api.ContinuousBatchingManager._fail_all_remaining_requests": "f0d58d1d4c083305",
    "continuous_api.ContinuousBatchingManager._generation_loop_body": "b138833254b235b0",
    "continuous_api.ContinuousBatchingManager._handle_critical_error": "84bd1f89da0d9553",
    "continuous_api.ContinuousBatchingManager._run_generation_loop": "ccf319f4eb072ce8",
    "continuous_api.ContinuousBatchingManager.add_request": "614fe428df5a446a",
    "continuous_api.ContinuousBatchingManager.add_requests": "2f9cb99cbbf5fd95",
    "continuous_api.ContinuousBatchingManager.get_result": "b1c47c2b1e05ecb5",
    "continuous_api.ContinuousBatchingManager.is_running": "6449fcb63bcc0c86",
    "continuous_api.ContinuousBatchingManager.pause": "52a56eadb79b1252",
    "continuous_api.ContinuousBatchingManager.request_id_iter": "309bcbfdb0205679",
    "continuous_api.ContinuousBatchingManager.start": "a02bac6de98089d7",
    "continuous_api.ContinuousBatchingManager.stop": "e739fc93466f2b7f",
    "continuous_api.ContinuousMixin.init_continuous_batching": "864a244a2534b05a",
    "continuous_api.OutputRouter.__init__": "bbd24a9572cf71bb",
    "continuous_api.OutputRouter.deliver": "37d803adc21f1789",
    "continuous_api.OutputRouter.deliver_batch": "837fee22f767dd54",
    "requests.RequestState.status": "2e2af1e07ae77b2d",
    "scheduler.FIFOScheduler.schedule_batch": "15a13a70ff385794",
    "scheduler.PrefillFirstScheduler.schedule_batch": "2a710fdda6d60dd9",
    "scheduler.Scheduler._get_waiting_candidates": "43968829acdd62e8",
    "scheduler.Scheduler.add_waiting_request": "9ef098f71ace6777",
    "scheduler.Scheduler.clear_cancelled_requests": "c3c5dd503929ae64",
    "cli.serving.model_manager.ModelManager._load_model": "52f50cb891309a25",
    "cli.serving.model_manager.ModelManager.load_model_and_processor": "cf98e1475fcdab8e",
    "model_runner.ModelRunner._sample": "e366edcd1b7c57bc",
    "model_runner.ModelRunner._forward_process_and_sample": "e326cff070721010",
    "input_outputs.ContinuousBatchingIOs.prepare_batch_update": "f2e488c1cea7563f",
    "input_outputs.ContinuousBatchingAsyncIOs.prepare_batch_update": "e6e19b414bbf2c8e",
    "continuous_api.ContinuousBatchProcessor.handle_batch_error": "c866d3b06837f91e",
    "cb_logits_processors.ContinuousBatchingLogitsProcessorList": "4bea7d4b587de3cd",
}


# The fingerprints a later release changed, with what the change is and why the integration still holds (or what it
# does about it).  A name absent here is as in 5.23.0; a name mapped to None is not touched on that release
# (dropped()); a name not in 5.23.0's table is one only that release has.  On a release not in SERVED the server's
# ("cli.") names would not be checked, since cbpause.integrations.serving would refuse to run there.
_LOOP_IN_CALLERS_INFERENCE_MODE = {
    # start() hands the caller's torch.inference_mode (thread-local) to the loop, which runs in it: the manager's
    # start() and _run_generation_loop pass use_inference_mode on (transformers.LOOP_TAKES_INFERENCE_MODE).
    "continuous_api.ContinuousBatchingManager._run_generation_loop": "56c9cdba165cd2cf",
    "continuous_api.ContinuousBatchingManager.start": "70483a28c71ce586",
}
# 5.25 rebuilt transformers serve: the handlers ask a model's EngineClient, which runs the model in a worker process
# (CBGenerateRunner there), where 5.23 asked the GenerationState's in-process CBGenerateManager.  serving_engine
# overrides the client's calls (PausableEngine) and the model manager's (PausableModelManager) to run the model on
# the cbpause manager in this process; the handlers' wraps and the routes removed are as on 5.23, reviewed.
_SERVER_REBUILT = {
    # The wiring, restated by serving_engine.build: a ModelLoader, a GenerationState, a ModelManager, the handlers
    # (TranscriptionHandler takes the model manager alone), build_server without the generation state.
    "cli.serve.Serve.__init__": "09d6ae9ecdcc38da",
    # The routes removed are still declared; the app adds RequestIdMiddleware and CancelOnDisconnect (which cancels a
    # handler whose client left: PausableEngine cancels the request then) and answers EngineDeadError with a 503.
    "cli.serving.server.build_server": "12d3ed1cfc2a13e0",
    # Gone (CBGenerateManager, GenerationState's manager), or no longer read by anything the integration sets.
    "cli.serving.utils.CBGenerateManager.__init__": None,
    "cli.serving.utils.CBGenerateManager._check_alive": None,
    "cli.serving.utils.CBGenerateManager.generate_non_streaming": None,
    "cli.serving.utils.CBGenerateManager.generate_streaming": None,
    "cli.serving.utils.CBGenerateManager.init_cb": None,
    "cli.serving.utils.CBGenerateManager.stop": None,
    "cli.serving.utils.GenerationState.__init__": None,
    "cli.serving.utils.GenerationState.get_manager": None,
    "cli.serving.utils.GenerationState.is_cb_alive": None,
    "cli.serving.utils.GenerationState.shutdown": None,
    # New in 5.25, overridden by serving_engine: the client's calls (the config and processor it reads are kept) ...
    "cli.serving.model_manager.EngineClient.__init__": "c8fe14f395f05029",
    "cli.serving.model_manager.EngineClient.generate_non_streaming": "a93707a9966983f0",
    "cli.serving.model_manager.EngineClient.generate_streaming": "7694b458332d5a2d",
    "cli.serving.model_manager.EngineClient.load": "c2c3744299f7ac3f",
    "cli.serving.model_manager.EngineClient.process_running": "4f4be2c979a305e9",
    "cli.serving.model_manager.EngineClient.shutdown": "512741242cbc0d21",
    "cli.serving.model_manager.EngineClient.start": "e7054e0da429a4bd",
    "cli.serving.model_manager.EngineClient.submit": "aa61788bfea0da26",
    "cli.serving.model_manager.EngineClient.submit_streaming": "d56f4023031dd324",
    # ... and the model manager's (one model, loaded at start-up).
    "cli.serving.model_manager.ModelManager.__init__": "d9b74453776c2405",
    "cli.serving.model_manager.ModelManager.get_engine": "861642d75206df92",
    "cli.serving.model_manager.ModelManager.is_dead": "16e7e2c0358cd098",
    "cli.serving.model_manager.ModelManager.shutdown": "8bd32cd5ff57643c",
    # The loading moved to a ModelLoader (the worker process's): serving.load_sharded replaces its _load_model, which
    # its load_model_and_processor still calls; the model manager's no longer exist.
    "cli.serving.model_manager.ModelManager._load_model": None,
    "cli.serving.model_manager.ModelManager.load_model_and_processor": None,
    "cli.serving.model_manager.ModelLoader._load_model": "716e4f2cee6e4a5c",
    "cli.serving.model_manager.ModelLoader.load_model_and_processor": "4ceedaa5e81ff9f5",
}
CHANGED_IN = {
    "5.24": {
        **_LOOP_IN_CALLERS_INFERENCE_MODE,
        # GET /v1/models lists model_manager.list_models(): the serving module answers /v1/models itself (the served
        # name, serving._GenerationChecks), so upstream's listing is never reached.
        "cli.serving.server.build_server": "a040a6af921a70e0",
        # A local checkpoint's model loads as on 5.23 (the change: a decision model's class is found by name; the
        # replacement of serving.load_sharded loads a causal LM, as it did).
        "cli.serving.model_manager.ModelManager._load_model": "841a401c221409f5",
    },
    "5.25": {**_LOOP_IN_CALLERS_INFERENCE_MODE, **_SERVER_REBUILT},
}


def replaced() -> dict[str, tuple[str, ...]]:
    """The entries of :data:`REPLACED` that the installed release has (5.23-5.24 load with the model manager, 5.25
    with a model loader)."""
    found = {}
    for name, callers in REPLACED.items():
        try:
            upstream_function(name)
        except (AttributeError, ModuleNotFoundError):
            continue
        found[name] = callers
    return found


def release(version: str | None = None) -> str:
    """The minor release (``"5.24"``) of ``version``, the installed transformers by default."""
    if version is None:
        import transformers

        version = transformers.__version__
    return ".".join(version.split(".")[:2])


def _key(minor: str) -> tuple[int, ...]:
    return tuple(int(part) for part in minor.split("."))


def _checked(minor: str | None) -> str:
    """The release whose table applies to ``minor`` (the installed one by default): itself if checked, else
    (CBPAUSE_UNCHECKED_TRANSFORMERS) the newest checked one, which it is compared with."""
    minor = release() if minor is None else minor
    return minor if minor in CHECKED_WITH else max(CHECKED_WITH, key=_key)


def fingerprints(minor: str | None = None) -> dict[str, str]:
    """The fingerprints of the release ``minor`` (the installed one by default): 5.23.0's, with what that release
    changed, added and dropped (:func:`dropped`); without the server's where the serving module does not run
    (:data:`SERVED`).  A release never checked gets the newest checked one's table (what ``python -m
    cbpause.integrations.upstream`` compares it with)."""
    minor = _checked(minor)
    merged = {**FINGERPRINTS, **CHANGED_IN.get(minor, {})}
    table = {name: digest for name, digest in merged.items() if digest is not None}
    if minor not in SERVED:
        table = {name: digest for name, digest in table.items() if not name.startswith(_CLI)}
    return table


def dropped(minor: str | None = None) -> set[str]:
    """The names of 5.23.0's table that the integration does not touch on the release ``minor`` (the installed one
    by default): 5.23's server names on 5.25, whose server was rebuilt (gone, or no longer read by what the
    integration sets).  Their entries of :data:`WRAPPED`, :data:`SETS` and :data:`RESTATED` do not apply there."""
    return {name for name, digest in CHANGED_IN.get(_checked(minor), {}).items() if digest is None}


# ------------------------------------------------------------------------------------------------ the patches


def patch_processor(processor: Any, cls: type, model: Any, versions: weights.WeightVersions, status: Any) -> Any:
    """Every change the integration makes to a batch processor upstream built (``_create_batch_processor``), in one
    place: its class becomes ``cls`` (the integration's ``PausableBatchProcessor``, which adds no state, so that
    upstream's constructor is not copied), the stamps the model check after a window reads, and the wraps of
    :data:`WRAPPED`.  A processor reused for the next session keeps its wraps (each is idempotent)."""
    if type(processor) is cls.__base__:
        processor.__class__ = cls
    processor._cbpause_model = model  # for the check after a window (weights.check_model_unchanged)
    processor._cbpause_layout = weights.ModelLayout(model)  # each parameter's dtype and device, now
    # No window yet.  (A processor kept for the next session, stop(keep_for_next_session=True), keeps its cache and is
    # stamped again here, after start() checked the model against its last stamp: weights.check_model_unchanged.)
    processor._cbpause_check_due = False
    never_share_stale_blocks(processor, versions)
    hold_admission(processor.scheduler, status)
    scheduler = processor.scheduler
    if not getattr(scheduler, "_cbpause_delivers_cancellations", False):  # a reused processor has it
        deliver_cancellations(scheduler, processor.output_router)
        refuse_what_cannot_fit(scheduler, processor)
    return processor


def sample_per_request(processor: Any, sampler: Any) -> None:
    """R-SAMPLING on a batch processor (its logits-processor list is the manager's ``sampler`` already): its model
    runner samples with the sampler (``_sample`` replaced on the instance, :data:`REPLACED`), and its IO buffers'
    read-back carries the top log-probabilities (``prepare_batch_update`` wrapped, :data:`WRAPPED`).  Idempotent (a
    processor reused for the next session keeps both)."""
    processor.model_runner._sample = sampler.sample
    io = processor.inputs_and_outputs
    if not getattr(io.prepare_batch_update, "_cbpause_read_back", False):
        io.prepare_batch_update = sampler.read_back(io.prepare_batch_update)


def hold_admission(scheduler: Any, status: Any) -> None:
    """Wrap the scheduler's choice of waiting requests on the instance: while the protocol's rank drains
    (``status.state.draining``, the flag's one home: P-DRAIN-FIRST), only requests in flight
    (:func:`~cbpause.integrations.modes.in_flight`) are candidates, so a drain admits no new request into the batch.
    Idempotent (a processor reused for the next session keeps its wrapper, and its manager's protocol)."""
    if getattr(scheduler, "_cbpause_holds_admission", False):
        return
    candidates = scheduler._get_waiting_candidates

    def _get_waiting_candidates() -> list:
        states = candidates()
        return [s for s in states if modes.in_flight(s)] if status.state.draining else states

    scheduler._get_waiting_candidates = _get_waiting_candidates
    scheduler._cbpause_holds_admission = True


def refuse_what_cannot_fit(scheduler: Any, processor: Any) -> None:
    """A request too long for the cache fails alone when the loop takes it (``ValueError``, the request's error),
    instead of failing the loop and every request in flight once it cannot be scheduled (upstream's "No requests
    can be scheduled").  ``add_request`` refuses it at the door once the cache exists; one added before comes here.
    The scheduler's method is wrapped on the instance: its caller (``_update_tp_group_state``'s upstream loop over
    new requests) fails the one request whose ``add_waiting_request`` raises, and goes on."""
    add = scheduler.add_waiting_request

    def add_waiting_request(state: Any) -> None:
        n_tokens = len(state.initial_tokens) + (state.max_new_tokens or 0)
        admission.check_fits(n_tokens, admission.cache_capacity(processor))
        add(state)

    scheduler.add_waiting_request = add_waiting_request


CANCELLED = "cancelled by cancel_request()"  # the error of a cancelled request's terminal output


def deliver_cancellations(scheduler: Any, router: Any) -> None:
    """Give each cancelled request a terminal output: FAILED, error ``"cancelled by cancel_request()"``.

    Upstream removes a cancelled request from the scheduler and delivers nothing, so a caller waiting for
    it (``get_result``, ``request_id_iter``) waits for ever (R-NOTHING-LOST-DELIVERED).  The scheduler's
    own method is wrapped on the instance, since its caller (``prepare_next_batch``) is upstream's.
    """
    clear = scheduler.clear_cancelled_requests

    def clear_cancelled_requests() -> list:
        states = clear()
        for state in states:
            router.fail_and_deliver(state, RuntimeError(CANCELLED))
        return states

    scheduler.clear_cancelled_requests = clear_cancelled_requests
    scheduler._cbpause_delivers_cancellations = True


def never_share_stale_blocks(processor: Any, versions: weights.WeightVersions | None = None) -> None:
    """Wrap the cache's ``mark_complete_blocks`` on the instance (upstream calls it after each forward step for every
    request of the batch): blocks that a request written with earlier weights completes are not registered for
    sharing, nor those of a child forked from one (which shares its blocks), and ``versions`` labels the request's
    new token.  Idempotent (a reused processor keeps its wrapper)."""
    cache = processor.cache
    if hasattr(cache, "_cbpause_stale"):
        return
    cache._cbpause_stale = set()  # ids of the requests in flight at the last pause window (ids are unique in flight)
    # Whether a block may have been hashed since the last forgetting (upstream hashes blocks only here): the forgetting
    # skips the ledgers while it is False (weights.forget_shared_prefixes).  True at first: the cache may hold some.
    cache._cbpause_marked = True
    mark = cache.mark_complete_blocks

    def mark_complete_blocks(state: Any, complete_blocks: dict[str, int]) -> None:
        if versions is not None:
            versions.note(state)
        rid, stale = state.request_id, cache._cbpause_stale
        # A child forked from a request in flight at the last window (num_return_sequences: upstream names it
        # "<parent>__child#<i>", ContinuousBatchProcessor.update_batch) shares its parent's blocks: it is as stale.
        if rid not in stale and rid.partition(weights.FORK_MARK)[0] not in stale:
            cache._cbpause_marked = True
            mark(state, complete_blocks)

    cache.mark_complete_blocks = mark_complete_blocks


# ----------------------------------------------------------------------------------------- the fingerprints


def upstream_function(name: str) -> object:
    """The upstream function ``module.Class.function`` of transformers' continuous batching, or with a ``cli.`` name
    of transformers' server (``cli.serving.server.build_server``)."""
    parts = name.split(".")
    base = "transformers." if name.startswith(_CLI) else _PACKAGE
    for cut in range(len(parts) - 1, 0, -1):  # the longest prefix that is a module
        try:
            obj = importlib.import_module(base + ".".join(parts[:cut]))
            break
        except ModuleNotFoundError:
            continue
    else:
        raise ModuleNotFoundError(f"no upstream module for {name}")
    for part in parts[cut:]:
        obj = getattr(obj, part)
    return obj


def upstream_name(cls: type, attribute: str) -> str:
    """The table's name of ``attribute`` of the upstream class ``cls``."""
    module = cls.__module__
    short = module.removeprefix(_PACKAGE) if module.startswith(_PACKAGE) else module.removeprefix("transformers.")
    return f"{short}.{cls.__qualname__}.{attribute}"


def fingerprint(name: str) -> str:
    """The fingerprint of the installed transformers' ``module.Class.function``."""
    obj = upstream_function(name)
    if isinstance(obj, property):
        obj = obj.fget
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


if __name__ == "__main__":  # pragma: no cover
    import transformers

    print(f"# transformers {transformers.__version__}")
    known = fingerprints()
    for name in sorted(known):
        try:
            now = fingerprint(name)
        except (AttributeError, ModuleNotFoundError) as error:
            now = f"gone: {error}"
        print(f'    "{name}": "{now}",' + ("" if now == known[name] else f"  # was {known[name]}"))
