"""What the integration changes in transformers, in one table, with a fingerprint of each upstream function.

The integration changes transformers' continuous batching in three ways: subclasses whose methods override
upstream's (``PausableContinuousBatchingManager``, ``PausableBatchProcessor``, which the manager swaps in with
``__class__``, ``TrackingRouter``, ``RetractedRequestState``), methods wrapped on an instance
(:data:`WRAPPED`: the wrapper calls upstream's, and upstream's own caller must still call it), and the
``_cbpause_*`` attributes those wrappers keep on the instance (:data:`STAMPS`).  A copy check can prove that
copied lines are unchanged; it cannot see a line upstream adds around them, nor upstream ceasing to call a method
the integration wrapped.  So every upstream function the integration overrides or wraps, and every caller of a
wrapped method, has a fingerprint here (:data:`FINGERPRINTS`: a hash of its source in the transformers version the
integration was checked against), and ``tests/test_upstream_copies.py`` fails when the installed transformers
differs anywhere in one of them, or when an override or a wrap is missing from the table.

``python -m cbpause.integrations.upstream`` prints the table for the installed transformers (to review the
changes of a new release, then update :data:`FINGERPRINTS`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect

__all__ = ["CHECKED_WITH", "FINGERPRINTS", "STAMPS", "WRAPPED", "fingerprint", "upstream_function"]

CHECKED_WITH = "5.23.0"
_PACKAGE = "transformers.generation.continuous_batching."

# Methods wrapped on an instance: "module.Class.method" -> the upstream functions that call it (they must still).
WRAPPED = {
    "scheduler.Scheduler._get_waiting_candidates": (  # modes.hold_admission: a drain admits nothing new
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
}  # fmt: skip

# The attributes the integration keeps on upstream's objects, and who sets them.
STAMPS = {
    "_cbpause_draining": "the scheduler (modes.hold_admission)",
    "_cbpause_delivers_cancellations": "the scheduler (admission.deliver_cancellations)",
    "_cbpause_stale": "the cache (weights.never_share_stale_blocks)",
    "_cbpause_model": "the batch processor (PausableContinuousBatchingManager._create_batch_processor)",
    "_cbpause_layout": "the batch processor (the same)",
    "_cbpause_first_parameter": "the batch processor (weights.check_model_unchanged)",
}

# sha256 (first 16 hex digits) of each upstream function's source in transformers CHECKED_WITH.
FINGERPRINTS = {
    "cache.PagedAttentionCache.mark_complete_blocks": "f6255bb6c6a6eb93",
    "continuous_api.ContinuousBatchProcessor._update_tp_group_state": "2731052eb9413443",
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
}


def upstream_function(name: str) -> object:
    """The upstream function ``module.Class.function`` of transformers' continuous batching."""
    module, *path = name.split(".")
    obj = importlib.import_module(_PACKAGE + module)
    for part in path:
        obj = getattr(obj, part)
    return obj


def fingerprint(name: str) -> str:
    """The fingerprint of the installed transformers' ``module.Class.function``."""
    obj = upstream_function(name)
    if isinstance(obj, property):
        obj = obj.fget
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


if __name__ == "__main__":  # pragma: no cover
    import transformers

    print(f"# transformers {transformers.__version__}")
    for name in sorted(FINGERPRINTS):
        now = fingerprint(name)
        print(f'    "{name}": "{now}",' + ("" if now == FINGERPRINTS[name] else f"  # was {FINGERPRINTS[name]}"))
