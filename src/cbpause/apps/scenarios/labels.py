"""The real loop's labels traced for ``tla/RequestVersions.tla`` (issue 40, point 2): one scenario that takes every
step the spec names (windows of every mode, updates inside them, requests admitted, in flight, restarted by the
staleness bound and ended by an abort, delivered), its log (:func:`cbpause.tlc.label_traces.label_log`) validated
by TLC.  ``tests/test_label_traces.py`` runs it and forges its log; the real-loop campaign runs it once
(``python -m cbpause.apps.scenarios --real``).

Every request asks for :data:`TOKENS` new tokens with no end-of-sequence stop, and its prompt fits one step (the
spec's requests generate ``Tokens`` each and are prefilled in one step).  The manager samples per request
(R-SAMPLING): each request with a seed and sampling of its own, so that its log also records the position of its
seed's stream each token was drawn at, which TLC checks against the request's tokens (through the keep and retract
windows, the restarts of the staleness bound and the abort).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.recorder import TraceRecorder
from ...testing import HANG_S, batching_config, greedy_config, run_thread

__all__ = ["TOKENS", "MAX_STALENESS", "run_labelled"]

TOKENS = 6
MAX_STALENESS = 1  # a keep update leaves a request one version behind (kept); a second one restarts it


def run_labelled(model: Any, probe: Any, bound: float = HANG_S) -> tuple[TraceRecorder, Any]:
    """The scenario on ``model`` (``probe`` attached): its recorder and its manager's ``versions`` (the staleness
    bound's constants).  Raises if the loop loses or fails a request the scenario did not abort."""
    from ...integrations.sampling import SamplingParams
    from ...integrations.transformers import init_continuous_batching

    recorder = TraceRecorder()
    manager = init_continuous_batching(model, greedy_config(TOKENS), batching_config(), trace=recorder,
                                       max_staleness=MAX_STALENESS, per_request_sampling=True)  # fmt: skip
    manager.start()
    ids: list[str] = []
    aborted: list[str] = []

    def submit(n: int, into: list[str]) -> None:
        for k in range(n):
            sampling = SamplingParams(temperature=(1.0, 0.0, 0.7)[k % 3], top_k=(0, 0, 5)[k % 3], seed=len(into) + k)
            into.append(manager.add_request([3 + k, 5, 7, 9], max_new_tokens=TOKENS, sampling=sampling))

    armed: list = []  # the hold of the next forward step, armed while the loop is parked in a window

    def arm() -> None:
        armed.append(probe.hold_next())

    def window_after_next_step(mode: str, inside: Callable[[], None], then_arm: bool = True) -> None:
        """The loop is held in its first forward step after the last window (armed in that window, where the loop
        waits: no step can slip in however slow this thread is); ask for a pause in ``mode`` on another thread, then
        let the step end: the window opens right after it (R-BOUNDED-ENTRY), and ``inside`` runs in it, which arms
        the hold of the step after this window unless ``then_arm`` is false."""
        reached, release = armed.pop()
        if not reached.wait(bound):
            raise TimeoutError(f"the loop ran no forward step within {bound} s")
        manager._wake_up_loop.clear()  # pause() sets it once its request is in; the held loop does not touch it

        def hold() -> None:
            with manager.pause(timeout=bound, mode=mode):
                inside()
                if then_arm:
                    arm()

        thread, box = run_thread(hold, name=f"labels-{mode}")
        asked = manager._wake_up_loop.wait(bound)
        release.set()
        thread.join(bound)
        if not asked or thread.is_alive() or "error" in box:
            raise RuntimeError(f"the {mode} pause did not run: {box.get('error', 'a hang')}")

    try:
        with manager.pause(timeout=bound):
            manager.set_weight_version(0)  # an integer from the start: the staleness bound counts integers only
            submit(3, ids)  # admitted together after the window, in one step
            arm()
        # keep, after one step: the requests go on with KV of version 0 (their labels differ)
        window_after_next_step("keep", lambda: manager.set_weight_version(1))
        # retract, after one more: two versions behind, the bound restarts them; two requests queued in the window
        window_after_next_step("retract", lambda: (manager.set_weight_version(2), submit(2, ids)))
        # drain: the batch is stepped to its end first, admitting nothing; two requests queued in the window...
        window_after_next_step("drain", lambda: submit(2, aborted))
        # ... run one step, and the abort ends them, failed
        window_after_next_step("abort", lambda: manager.set_weight_version(3), then_arm=False)
        submit(1, ids)
        missing = set(ids)
        while missing:  # every output, in the order they come (get_result(id) returns None for another's)
            output = manager.get_result(timeout=bound)
            if output is None:
                raise TimeoutError(f"no output for {sorted(missing)} within {bound} s")
            missing.discard(output.request_id)
    finally:
        manager.stop(block=True, timeout=bound)
    return recorder, manager.versions
