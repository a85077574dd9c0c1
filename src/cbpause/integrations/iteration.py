"""One iteration of transformers' continuous-batching loop, each step reported to the protocol (the integration's
half that knows the loop; :mod:`cbpause.integrations.transformers` holds the manager and its entry points).

* :class:`PausableBatchProcessor`: the TP group step (``ContinuousBatchProcessor._update_tp_group_state``) as the
  spec's steps: P-OBSERVE, P-ALL-REDUCE, then P-EXIT-LOOP, the window (P-OPEN-WINDOW, P-SKIP-WINDOW or
  P-PARK-FOR-PEER, P-CLOSE-WINDOW, P-BARRIER), P-DRAIN-FIRST or P-NO-PAUSE; the payload broadcast (P-BROADCAST),
  and a collective that fails (P-COLLECTIVE-TIMEOUT), with the requests in hand failed, never lost (D5);
* :class:`LoopIteration`: the manager's loop body (P-START-STEP, P-END-STEP, P-IDLE, P-EXIT-LOOP) and its fatal-error
  path (P-RECORD-FATAL-ERROR, P-FAIL-LOOP), mixed into the manager.

Each guard is the protocol's own (``cbpause.core.transitions.can_<action>``); no line of transformers is copied
(:mod:`cbpause.integrations.upstream` fingerprints every upstream function these override).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from transformers.generation.continuous_batching import continuous_api as _api
from transformers.generation.continuous_batching.distributed import dist as _dist

from ..core import transitions as t
from ..core.dropin import PauseProtocol
from . import admission, modes, weights

__all__ = ["IDLE_WAIT_S", "LoopIteration", "PausableBatchProcessor"]

IDLE_WAIT_S = 0.1  # the idle loop's longest sleep between two looks at its queues (as upstream's)


class PausableBatchProcessor(_api.ContinuousBatchProcessor):
    """transformers' batch processor whose TP group step reports to a :class:`PauseProtocol`.

    It adds no state: :meth:`PausableContinuousBatchingManager._create_batch_processor` turns the processor
    upstream builds into this class, so the construction code (cache, scheduler, IO buffers) stays upstream's.
    """

    background_thread_status: PauseProtocol

    def _update_tp_group_state(self) -> bool:
        """Upstream's TP group step, each action of it reported to the protocol's explicit loop API.

        Observe, AllReduce, then ExitLoop on a hard stop, the window (open, skip for a withdrawn request, or
        park for a peer for at most ``peer_park_timeout``) and Barrier if the group decided to pause, NoPause
        otherwise.  Returns True if the group is hard-stopping.  Unlike upstream, the requests in hand (drained,
        then carried by the broadcast, until the scheduler has each: the exit path cannot see them) fail, not get
        lost, when anything fails before they are admitted or the group hard-stops (D5; the broadcast, issue 24).
        """
        status = self.background_thread_status
        # The driver empties its two queues (what was submitted, then what was cancelled, since its last group step);
        # a rank without queues brings nothing.
        if self.input_queue is None or self.cancel_queue is None:
            payload: tuple[list, list] = ([], [])
        else:  # in a drain too: the scheduler holds what it takes (TLA+ Admits; upstream.hold_admission)
            payload = (_api.drain_queue(self.input_queue), _api.drain_queue(self.cancel_queue))
        in_hand = payload[0]  # an abort at the decision empties it
        for state in in_hand:  # TracePauseProtocol's Drain, just before the Observe
            status.record_request("Drain", state.request_id)
        try:
            payload_size, hard_stopping = self._group_decision(status, len(payload[0]) + len(payload[1]), in_hand)
            if hard_stopping:
                admission.fail_in_hand(self, in_hand, RuntimeError("The loop hard-stopped before this request ran."))
                return True
            if not payload_size:  # the driver's payload size, all-reduced with the decision: nothing to hand out
                return False
            broadcast = self.distributed_helper.tp_broadcast_object_from_rank_0(payload)  # P-BROADCAST
            in_hand, cancellations = list(broadcast[0]), broadcast[1]
            if in_hand:
                status.record_request("Broadcast")  # P-BROADCAST, on every rank once its collective returned
            while in_hand:  # each leaves the hand once the scheduler has it, or once it failed alone (as upstream)
                self._admit(in_hand[0])
                in_hand.pop(0)
        except BaseException as error:
            admission.fail_in_hand(self, in_hand, error if isinstance(error, Exception) else RuntimeError(repr(error)))
            raise
        for cancelled in cancellations:  # every rank marks the driver's cancellations, in its order
            self.scheduler.set_request_cancellation(cancelled)
            if cancelled in self.scheduler.active_requests or cancelled in self.scheduler.waiting_requests:
                self._peer_drop(cancelled)  # (one the scheduler does not hold yet will come, and run, later)
        return False

    def _peer_drop(self, request_id: str) -> None:
        """A peer's trace only: its copy of the request leaves its scheduler without a step (cancelled, or refused at
        admission), and the peer may idle before the driver's output of it is recorded (TracePauseProtocol's
        PeerDrop; a real TP=2 trace of a request cancelled at once showed it)."""
        status = self.background_thread_status
        if self.input_queue is None and status.tracing:
            status.record_request("PeerDrop", request_id)

    def _generation_step(self, model: Any) -> None:
        """Upstream's forward step, its version noted once it is launched (on a GPU while the device computes;
        R-VERSIONS: async batching reads it back after a window).  Only a window changes the version, and none comes
        before the step's read-back, which pops this note.  (The loop body around it records a trace's Launch and
        checks the model after a window: ``LoopIteration._loop_body``.)"""
        super()._generation_step(model)
        self.output_router.versions.launch()

    def update_batch(self) -> None:
        """Upstream's read-back of a step's tokens, labelled with that step's version.  Traced: RequestVersions' Land,
        with the labels of each new token, then the terminal outputs the read-back produced (held until then: in the
        spec a request is done by its last token's Land)."""
        router = self.output_router
        router.versions.read_back()
        status = self.background_thread_status
        if not status.tracing:
            super().update_batch()
            return
        router.versions.landing, router.held_outputs = [], []
        try:
            super().update_batch()
        finally:
            landed, router.versions.landing = router.versions.landing, None
            held, router.held_outputs = router.held_outputs, None
            status.record_labels("Land", labels=landed)
            for fields in held:
                status.record_labels("Output", **fields)

    def _admit(self, state: Any) -> None:
        """Give one request of the broadcast to the scheduler.  One it cannot take (logits-processor arguments it
        refuses, a prompt too long for the cache) fails alone, its error in its output (``_handle_request_error``),
        and is logged: the loop and the other requests go on, as upstream's do."""
        try:
            self.logit_processor.check_kwargs(state.logit_processor_kwargs)
            self.scheduler.add_waiting_request(state)
        except Exception as error:
            _api.logger.error("request %s cannot be admitted: %s", state.request_id, error, exc_info=True)
            self._handle_request_error(error, state)
            self._peer_drop(state.request_id)

    def _group_decision(self, status: PauseProtocol, payload_size: int, taken: list) -> tuple[int, bool]:
        """Observe, AllReduce, then ExitLoop, or the pause window with its Barrier (DrainFirst in a drain that found
        work), or NoPause.  The agreed mode's effect on the requests (:mod:`~cbpause.integrations.modes`) comes
        before any window; ``taken`` are the requests taken from the input queue this iteration (TLA+ ``drained``).

        Returns the group's payload size and whether the group is hard-stopping.
        """
        observed_status, observed_pause = status.observe()  # P-OBSERVE: what this rank sends (its strongest mode)
        try:
            payload_size, tp_status, tp_pause = self.distributed_helper.tp_all_reduce_state(
                payload_size=payload_size, stop_status=observed_status, pause_requested=observed_pause
            )
        except Exception as error:
            _collective_failed(status, error)
            raise
        busy = tp_pause == t.DRAIN and modes.busy(self)
        status.all_reduce(tp_status, int(tp_pause), busy)  # P-ALL-REDUCE (raises unless tp_status is the agreed one)
        if tp_pause and tp_status < status.HARD_STOP and status.tracing:  # RequestVersions' OpenWindow(m), before its
            status.record_labels("DrainFirst" if busy else "OpenWindow", mode=int(tp_pause))  # Effect (at_decision)
        # What a mode does at the decision (a keep pause does nothing there: the hot path and a keep pause skip it).
        if tp_pause > t.KEEP:
            modes.at_decision(self, status, taken)
        if tp_status == status.HARD_STOP:
            status.exit_loop()  # P-EXIT-LOOP: a hard stop exits before any window
            return payload_size, True
        if busy:
            status.drain_first()  # P-DRAIN-FIRST: step the batch, admitting nothing, and ask again
        elif tp_pause:
            # D6's verdict for the window's end, read as it opens (nothing the holders do changes it: see
            # weights.nothing_to_forget) and before the device's synchronisation, which it overlaps on a GPU.
            quiet = weights.nothing_to_forget(self)
            stream = self.inputs_and_outputs.compute_stream
            if stream is not None:  # the GPU's work of the last step ends before any holder touches the model
                stream.synchronize()
            versions = self.output_router.versions
            before = versions.current
            group = self.distributed_helper.cpu_comm_group
            # Without peers, P-BARRIER in the window's own call (its close and the barrier one hot step).  A loop that
            # records a trace steps through the barrier on its own instead, its phase `barrier` seen by other threads
            # (the scenarios' episodes act there; the spec allows both; memos are off while tracing anyway).
            tracing = status.tracing
            alone = group is None and not tracing
            # P-OPEN-WINDOW / P-SKIP-WINDOW / P-PARK-FOR-PEER, P-CLOSE-WINDOW (raises on D3), and P-BARRIER if alone
            status.pause_window(barrier=alone)
            changed = weights.window_changed_weights(versions, status.pauses_taken)
            if group is None:
                if not alone:
                    status.barrier()  # P-BARRIER
                self._cbpause_check_due = True  # checked once the next forward step is launched (_loop_body)
            else:
                timeout = self.cb_config.cpu_group_timeout
                try:
                    # Every rank, at the barrier: whether any rank's window may have changed the weights (the
                    # ranks must forget their shared prefixes alike, or their batches would part).
                    # and whether the ranks set the same weight version (a digest and its complement, in the same MAX)
                    digest = weights.barrier_digest(versions)
                    top, low, changed = self.distributed_helper.tp_all_reduce_state(digest, -digest, int(changed))
                    changed = weights.agree_versions(versions, self.distributed_helper, top, -low, bool(changed))
                    # P-BARRIER's collective, on the group's CPU channel, bounded by its timeout (None: for ever);
                    # wait_all_ranks names every rank that did not come.
                    bound = None if timeout is None else timedelta(seconds=timeout)
                    _dist.monitored_barrier(group=group, timeout=bound, wait_all_ranks=True)
                except Exception as error:
                    _collective_failed(status, error)
                    raise
                status.barrier()  # P-BARRIER: the group leaves the window together
                weights.check_model_unchanged(self)
            if changed and not quiet:
                weights.forget_shared_prefixes(self)  # D6: no new request reads KV from before the pause
            if tracing:  # RequestVersions' CloseWindow, before the staleness bound ends any request
                status.record_labels("CloseWindow")
            if versions.max_staleness is not None and weights.set_new_version(versions, before):
                modes.restart_stale(self)  # R-STALENESS
        else:
            status.no_pause()  # P-NO-PAUSE
        return payload_size, False


def _batch_ids(processor: Any) -> list[str]:
    """The ids of the caller's requests in the batch the processor is about to step (a trace's Launch)."""
    io = processor.inputs_and_outputs
    if not hasattr(io, "requests_in_batch"):  # async batching: the pair being launched
        io = io.io_pairs[io.current_pair].host_io
    live = processor.output_router.live
    return [f.state.request_id for f in io.requests_in_batch if f.state.request_id in live]


def _check_after_window(processor: Any) -> None:
    """The model check a window of a loop without peers left due (``_cbpause_check_due``), once: see
    ``LoopIteration._loop_body``."""
    if processor._cbpause_check_due:
        processor._cbpause_check_due = False
        weights.check_model_unchanged(processor)


def _collective_failed(status: PauseProtocol, error: BaseException) -> None:
    """P-COLLECTIVE-TIMEOUT: a peer died or never came.  Record ``error`` and stop, waking every waiter.  Where the
    spec has no collective failing, the error is recorded all the same (the caller must see it, not a complaint)."""
    try:
        status.collective_timeout(error)
    except RuntimeError:
        status.record_fatal_error(error)


class LoopIteration:
    """The manager's side of an iteration: upstream's loop body and fatal-error path, with the spec's steps reported
    (mixed into :class:`~cbpause.integrations.transformers.PausableContinuousBatchingManager`, whose
    ``background_thread_status`` and ``_wake_up_loop`` they use)."""

    background_thread_status: PauseProtocol
    _wake_up_loop: Any

    def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        """Upstream's loop body, with the steps the spec names around the forward step reported:
        P-START-STEP before the forward step (refused while a holder is inside: R-EXCLUSION is enforced where
        the step runs), P-END-STEP once the batch is updated, P-IDLE before waiting for work, P-EXIT-LOOP on a
        flush with nothing left.  A loop asked to flush whose pending requests cannot be scheduled now goes
        round through an empty step (spec section 5).
        """
        try:
            return self._loop_body(batch_processor, bootstrapping)
        except BaseException as error:
            status = self.background_thread_status
            s = status.state
            if not isinstance(error, Exception) and t.can_fail_loop(s):
                # Upstream handles Exception only: anything else ends the thread (P-FAIL-LOOP, with this error).
                status.fail_loop(error)
            raise

    def _loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        """The body proper.  The first step after a window of a loop without peers checks that the holders left the
        model's dtype and device alone (:func:`~cbpause.integrations.weights.check_model_unchanged`) once the step is
        launched: on a GPU the check runs while the device computes, instead of between the last holder's exit and
        the step (issue 38); on the CPU it runs after the step.  Either way before the step's tokens are read back
        (``update_batch``, or the next iteration's under async batching): a check that fails ends the loop with its
        clear error and no token of that step reaches a request.  A step that fails because the model changed gets
        the check's error, the kernel's as its cause.  A loop with no step after the window checks at once.  A rank
        with peers checks before the step instead (``_group_decision``): its forward step's collectives would mix
        its model with the peers'."""
        status = self.background_thread_status
        if batch_processor.prepare_next_batch():  # a batch to step
            status.start_step()
            if status.tracing:  # RequestVersions' Launch, with the requests the step computes
                status.record_labels("Launch", ids=_batch_ids(batch_processor))
            try:
                self._generation_step()
            except Exception as error:
                try:  # a step that failed because the model changed inside the window: say so
                    _check_after_window(batch_processor)
                except RuntimeError as clear:
                    raise clear from error
                raise
            _check_after_window(batch_processor)  # the first step after a window (see above)
            self.current_batch += 1  # (upstream's count of forward steps)
            if not bootstrapping:  # no update when bootstrapping an async batching generation
                batch_processor.update_batch()
            status.end_step()
            modes.record_first_steps(batch_processor)  # a trace's FirstStep records (nothing without a recorder)
            return not bootstrapping
        # A window and no step after it: nothing to overlap, check now, so that an idle loop fails at once, not at its
        # next request.
        _check_after_window(batch_processor)
        if status.tp_status == status.HARD_STOP:
            return False  # P-EXIT-LOOP was taken in the group step
        if status.tp_status == status.FLUSH_AND_STOP and not batch_processor.has_pending_requests():
            status.exit_loop()
            return False
        if status.tp_status == status.DONT_STOP:
            status.idle()
        else:
            status.start_step()
            status.end_step()
        # Nothing to step: sleep until a request (or a pause, a stop) wakes the loop (P-IDLE's wait).
        self._wake_up_loop.wait(timeout=IDLE_WAIT_S)
        self._wake_up_loop.clear()
        return True

    def _handle_critical_error(self, error: Exception, batch_processor: Any) -> None:
        """Upstream's fatal-error path, reported to the protocol, without its group all-reduce where the group is
        already broken.

        Between two iterations' collectives (read, body, step) it is P-RECORD-FATAL-ERROR: as upstream, fail
        what remains and tell the group through one more all-reduce, then P-EXIT-LOOP.  Elsewhere (around the
        window) it is P-FAIL-LOOP, and after P-PEER-PARK-TIMEOUT or P-COLLECTIVE-TIMEOUT the rank has stopped
        already: a collective could only wait for peers that are elsewhere, so none is attempted (spec section
        5, "A fatal error"); the peers fail at their own barrier or all-reduce.
        """
        status = self.background_thread_status
        s = status.state
        if t.can_record_fatal_error(s) and not s.fatal:
            # As upstream: fail what remains (retrieving partial outputs) before recording the error.
            self._fail_all_remaining_requests(error, batch_processor)
            status.record_fatal_error(error)
            try:
                _, tp_status, tp_pause = self.distributed_helper.tp_all_reduce_state(0, status.HARD_STOP)
            except Exception as collective_error:
                _collective_failed(status, collective_error)
                return
            status.all_reduce(tp_status, int(tp_pause))
            status.exit_loop()
            return
        if t.can_fail_loop(s):
            status.fail_loop(error)
        else:
            status.record_fatal_error(error)  # recorded; the rank has stopped already
        self._fail_all_remaining_requests(error, batch_processor)  # every request still held gets its output
