"""What a pause mode does to the requests of transformers' batch (spec R-MODES, section 5 "Pause modes").

Part of the integration (with :mod:`cbpause.integrations.transformers`, the only code of cbpause that knows
transformers' internals).  The group agrees on the mode through its all-reduce (``PauseProtocol.all_reduce``: the
strongest mode asked on any rank); every rank then applies the same effect to its own scheduler at the decision,
before any window opens, so that the batches of a TP group stay copies of each other:

* ``keep``: nothing.
* ``retract`` (:func:`retract`): every request in flight loses its KV.  A request in the batch is replaced, under the
  same id, by transformers' own soft-reset copy (``RequestState.create_equivalent_initial_request``: its prompt plus
  the tokens it generated, the rest of its ``max_new_tokens``), put at the head of the waiting queue; a waiting
  request whose KV was offloaded to the CPU gets the same.  After the resume each is prefilled again with the
  weights of then, before its next token: nothing lost, nothing repeated.  The copy keeps the request's metadata
  (:func:`soft_reset`): its created time, the start of its lifespan and its tokens' timestamps.
* ``drain``: while the batch has requests in flight (:func:`busy`) the decision is ``DrainFirst``: the loop steps the
  batch and admits no waiting request (:func:`cbpause.integrations.upstream.hold_admission`); the window opens
  once the batch is empty.
* ``abort`` (:func:`abort`): every request the rank holds (the batch, the waiting queue, what the loop took from
  the input queue this iteration and what is still in it) ends with one terminal output: status ``FAILED``, its
  partial tokens, and an error that starts with :data:`ABORTED_BY_PAUSE`.  Callers may resubmit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from transformers.generation.continuous_batching import continuous_api as _api

from ..core import transitions as t
from .weights import STALE

__all__ = ["ABORTED_BY_PAUSE", "abort", "at_decision", "busy", "record_first_steps", "restart_stale", "retract"]

ABORTED_BY_PAUSE = "aborted by a pause (mode='abort')"


def in_flight(state: Any) -> bool:
    """A waiting request that has run already: offloaded to the CPU, or soft-reset (retracted, or offloaded without a
    CPU pool).  The scheduler's active requests are in flight too."""
    return bool(state.is_cpu_offloaded or state._true_initial_tokens)


def in_flight_ids(scheduler: Any) -> Iterator[str]:
    """The ids of the requests in flight: active, or waiting after a step (a drain waits for them)."""
    yield from scheduler.active_requests
    yield from (request_id for request_id, state in scheduler.waiting_requests.items() if in_flight(state))


def busy(processor: Any) -> bool:
    """The batch has requests in flight (what a drain waits for)."""
    return next(in_flight_ids(processor.scheduler), None) is not None


def record_first_steps(processor: Any) -> None:
    """The driver's trace only, after each forward step: record each request in flight (:func:`busy`'s) that the trace
    does not know in flight yet (``FirstStep``, TracePauseProtocol's waiting -> active), so that the trace's
    ``InFlight`` at the next all-reduce is what :func:`busy` reads there, and TLC checks the drain's decision
    (``draining``) against it.  A request leaves the set when delivered, or restarted stale (:func:`restart_stale`)."""
    router = processor.output_router
    status = router.status
    if status is None or not status.tracing:
        return
    traced = router.traced_in_flight
    for request_id in list(in_flight_ids(processor.scheduler)):
        # (only the requests the caller submitted: the children upstream forks for num_return_sequences > 1 are not
        # the spec's requests, and a trace of such a run is rejected at their outputs: a known limit)
        if request_id not in traced and request_id in router.live:
            traced.add(request_id)
            status.record_request("FirstStep", request_id)


class RetractedRequestState(_api.RequestState):
    """A retracted request: once it has started, the start of its lifespan stays (upstream's soft-reset copy is a new
    request, whose first admission would stamp a new start)."""

    @property
    def status(self) -> Any:
        return self._status

    @status.setter
    def status(self, value: Any) -> None:
        started = self.lifespan[0]
        _api.RequestState.status.fset(self, value)
        if started >= 0:
            self.lifespan = (started, self.lifespan[1])


def soft_reset(state: Any) -> Any:
    """transformers' soft-reset copy of ``state`` (its prompt plus the tokens it generated), keeping what upstream's
    copy restarts: the created time, the lifespan's start and the timestamps of the tokens (issue 26, point 10)."""
    fresh = state.create_equivalent_initial_request()
    fresh.__class__ = RetractedRequestState
    fresh.created_time, fresh.lifespan = state.created_time, (state.lifespan[0], -1)
    fresh._timestamps = list(state._timestamps)
    return fresh


def retract(processor: Any) -> int:
    """Free the KV of every request in flight and queue it again, first, to be prefilled with the weights of after the
    pause (see the module's docstring).  Returns how many."""
    scheduler, offloading = processor.scheduler, processor.offloading_manager
    retracted = []
    for request_id, state in list(scheduler.active_requests.items()):
        fresh = soft_reset(state)
        scheduler.finish_request(request_id)  # frees its blocks
        retracted.append(fresh)
    for request_id, state in list(scheduler.waiting_requests.items()):
        if state.is_cpu_offloaded:
            offloading.free_request_cpu_cache(state)
            scheduler.waiting_requests[request_id] = soft_reset(state)
    for state in reversed(retracted):  # the head of the queue, in the batch's order
        scheduler.waiting_requests[state.request_id] = state
        scheduler.waiting_requests_order.appendleft(state.request_id)
    _unblock(scheduler)
    return len(retracted)


def _unblock(scheduler: Any) -> None:
    """The batch is empty: lift the admission block that transformers' offloading sets under cache pressure.  It
    lifts it only when a request of the batch finishes, which none will now: left set, the waiting requests would
    never be scheduled, and the loop would idle with them for ever."""
    scheduler.block_new_requests = False


def abort(processor: Any, taken: list) -> int:
    """End every request this rank holds with one terminal output (see the module's docstring); ``taken`` (the
    requests the loop took from the input queue this iteration, not in the scheduler yet) is emptied.  Returns how
    many."""
    scheduler, offloading, router = processor.scheduler, processor.offloading_manager, processor.output_router
    states = list(scheduler.active_requests.values())
    for state in states:
        scheduler.finish_request(state.request_id)
    for state in scheduler.waiting_requests.values():
        offloading.free_request_cpu_cache(state)
        states.append(state)
    scheduler.waiting_requests.clear()
    scheduler.waiting_requests_order.clear()
    states.extend(taken)
    taken.clear()
    if processor.input_queue is not None:  # what was submitted since the loop's drain of this iteration
        states.extend(_api.drain_queue(processor.input_queue))
    _unblock(scheduler)
    error = RuntimeError(f"{ABORTED_BY_PAUSE}: resubmit the request")
    for state in states:
        router.fail_and_deliver(state, error)
    return len(states)


def at_decision(processor: Any, status: Any, taken: list) -> None:
    """What the agreed mode does at the decision, on every rank (the caller has applied the all-reduce): a retract or
    an abort takes effect before any window opens.  (A drain that found work holds admission while the rank drains:
    :func:`~cbpause.integrations.upstream.hold_admission` reads the protocol's flag.)"""
    s = status.state
    if s.tp_status >= t.HARD_STOP:
        return
    if s.tp_pause == t.RETRACT:
        retract(processor)
    elif s.tp_pause == t.ABORT:
        abort(processor, taken)


def from_prompt(state: Any) -> Any:
    """A copy of ``state`` back at its prompt, under the same id, with its whole ``max_new_tokens``: its tokens (those
    a retract moved into its prompt included) are discarded.  It keeps its created time and lifespan's start."""
    prompt_len = state._true_initial_tokens or len(state.initial_tokens)
    config = state.get_request_config()
    if state.max_new_tokens is not None:
        config["max_new_tokens"] = state.max_new_tokens + len(state.initial_tokens) - prompt_len
    fresh = RetractedRequestState(request_id=state.request_id, initial_tokens=list(state.initial_tokens[:prompt_len]),
                                  **config)  # fmt: skip
    fresh.created_time, fresh.lifespan = state.created_time, (state.lifespan[0], -1)
    return fresh


def restart_stale(processor: Any) -> int:
    """R-STALENESS, at the close of a window that set a new weight version, on every rank alike: every request in
    flight more than ``max_staleness`` versions behind (:meth:`~cbpause.integrations.weights.WeightVersions.behind`)
    goes back to its prompt at the head of the waiting queue (``on_stale="restart"``, at most
    ``max_stale_restarts`` times per request: ``StaleRestarted`` in ``RequestVersions.tla``) or ends with one terminal
    output whose error starts with :data:`~cbpause.integrations.weights.STALE` (``"abort"``, or a request whose
    restarts are spent: without the budget, one that needs more forward steps than the updates leave it was
    restarted at every window for ever, issue 40).  Returns how many."""
    scheduler, offloading, router = processor.scheduler, processor.offloading_manager, processor.output_router
    versions = router.versions
    bound = versions.max_staleness
    stale = [(s, True) for s in scheduler.active_requests.values() if versions.behind(s, True) > bound]
    stale += [(s, False) for s in scheduler.waiting_requests.values() if in_flight(s)
              and versions.behind(s, s.is_cpu_offloaded) > bound]  # fmt: skip
    restarted = []
    for state, active in stale:
        behind = versions.behind(state, active or state.is_cpu_offloaded)
        if active:
            scheduler.finish_request(state.request_id)  # frees its blocks
        else:
            offloading.free_request_cpu_cache(state)
            del scheduler.waiting_requests[state.request_id]
            scheduler.waiting_requests_order.remove(state.request_id)
        done = versions.restarts.get(state.request_id, 0)
        if versions.on_stale == "restart" and done < versions.max_stale_restarts:
            versions.forget(state.request_id)
            versions.restarts[state.request_id] = done + 1
            restarted.append(from_prompt(state))
            if state.request_id in router.traced_in_flight:  # back at its prompt: no longer in flight
                router.traced_in_flight.discard(state.request_id)
                router.status.record_request("StaleRestart", state.request_id)
        else:
            spent = f"; restarted {done} times (max_stale_restarts={versions.max_stale_restarts}), it needs more " \
                    "forward steps than the updates leave it" if versions.on_stale == "restart" else ""
            router.fail_and_deliver(state, RuntimeError(f"{STALE}: {behind} versions behind the weights in force "
                                                        f"(max_staleness={bound}){spent}"))  # fmt: skip
    for state in reversed(restarted):
        scheduler.waiting_requests[state.request_id] = state
        scheduler.waiting_requests_order.appendleft(state.request_id)
    if stale:
        _unblock(scheduler)
    versions.stale += len(stale)
    return len(stale)
