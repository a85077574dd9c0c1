"""``PauseProtocol`` driving transformers' own continuous-batching loop (transformers 5.23.x only).

This module and its two helpers, :mod:`~cbpause.integrations.admission` (what ``add_request`` refuses, what
fails alone) and :mod:`~cbpause.integrations.weights` (what a pause means for the KV cache), are the only code
of cbpause that knows transformers' internals.  It returns transformers' own
``ContinuousBatchingManager`` (a subclass, same methods) whose status object is a
:class:`~cbpause.PauseProtocol`, and changes the loop only where the protocol needs it:

* ``pause(timeout=None, mode="keep", weights_changed=True)`` keeps upstream's signature and adds a timeout
  (P-PAUSE-TIMEOUT) and a pause mode (R-MODES, :mod:`~cbpause.integrations.modes`); from the loop's own thread
  (a logits processor, a callback) it raises at once (D4).  Outputs carry weight versions (R-VERSIONS).
* The TP group step (``ContinuousBatchProcessor._update_tp_group_state``) tells the protocol what this rank
  observed before the all-reduce (P-OBSERVE) and what the group decided (P-ALL-REDUCE, then the pause
  window and P-BARRIER), so a withdrawn request no longer parks the loop (D1) and a rank parked for a peer's
  pause leaves after ``peer_park_timeout`` seconds (D3).  A collective that fails (a peer died or never
  came) is P-COLLECTIVE-TIMEOUT: the loop stops with the error recorded, and every waiter is told.
* ``stop()`` never tears down a loop that still runs: a stop that does not wait, whose wait runs out, or that
  comes from the loop's own thread asks for the stop and returns; the loop's exit path tears down.

Everything else is upstream's: the queues, the scheduler, ``DistributedHelper`` with its
``tp_all_reduce_state`` MAX all-reduce, its CPU (gloo) group and its monitored barrier.  No line is copied from
transformers: where an override must do what upstream's function did, it calls upstream's (``super()``, as the
teardown does) or says it in its own words; :mod:`cbpause.integrations.upstream` holds a fingerprint of every
upstream function overridden, wrapped or restated, so that a change upstream fails ``tests/test_upstream_copies.py``
until it is reviewed.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..core import transitions as t
from ..core.condition import SafeEvent
from ..core.dropin import PauseProtocol
from ..core.protocol import PauseHold

SUPPORTED = "5.23"


def check_transformers_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` is a transformers 5.23.x release.

    The integration overrides a private method of transformers' batch processor, whose shape changes
    between minor releases; running it on another one could silently lose the pause guarantees.
    """
    parts = version.split(".")
    if parts[:2] != SUPPORTED.split("."):
        raise ImportError(
            f"cbpause.integrations.transformers supports transformers {SUPPORTED}.x only, found {version}: "
            f"install it with `pip install 'transformers=={SUPPORTED}.*'` (or `pip install 'cbpause[transformers]'`)"
        )


try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "cbpause.integrations.transformers needs transformers: `pip install 'cbpause[transformers]'`"
    ) from exc

check_transformers_version(_transformers.__version__)

from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api as _api  # noqa: E402
from transformers.generation.continuous_batching.distributed import dist as _dist  # noqa: E402

from . import admission, modes, upstream, weights  # noqa: E402

__all__ = ["PausableBatchProcessor", "PausableContinuousBatchingManager", "init_continuous_batching"]


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
        else:
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
        return False

    def _generation_step(self, model: Any) -> None:
        """Upstream's forward step, its version noted (R-VERSIONS: async batching reads it back after a window)."""
        self.output_router.versions.launch()
        super()._generation_step(model)

    def update_batch(self) -> None:
        """Upstream's read-back of a step's tokens, labelled with that step's version."""
        self.output_router.versions.read_back()
        super().update_batch()

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
        # What a mode does at the decision (a keep pause does nothing there: the hot path and a keep pause skip it).
        if tp_pause > t.KEEP or self.scheduler._cbpause_draining:
            modes.at_decision(self, status, taken)
        if tp_status == status.HARD_STOP:
            status.exit_loop()  # P-EXIT-LOOP: a hard stop exits before any window
            return payload_size, True
        if busy:
            status.drain_first()  # P-DRAIN-FIRST: step the batch, admitting nothing, and ask again
        elif tp_pause:
            stream = self.inputs_and_outputs.compute_stream
            if stream is not None:  # the GPU's work of the last step ends before any holder touches the model
                stream.synchronize()
            before = self.output_router.versions.current
            status.pause_window()  # P-OPEN-WINDOW / P-SKIP-WINDOW / P-PARK-FOR-PEER, P-CLOSE-WINDOW; raises on D3
            changed = weights.window_changed_weights(self.output_router.versions, status.pauses_taken)
            if self.distributed_helper.cpu_comm_group is not None:
                timeout = self.cb_config.cpu_group_timeout
                try:
                    # Every rank, at the barrier: whether any rank's window may have changed the weights (the
                    # ranks must forget their shared prefixes alike, or their batches would part).
                    # and whether the ranks set the same weight version (a digest and its complement, in the same MAX)
                    versions = self.output_router.versions
                    digest = weights.version_digest(versions.current)
                    top, low, changed = self.distributed_helper.tp_all_reduce_state(digest, -digest, int(changed))
                    changed = weights.agree_versions(versions, self.distributed_helper, top, -low, bool(changed))
                    # P-BARRIER's collective, on the group's CPU channel, bounded by its timeout (None: for ever);
                    # wait_all_ranks names every rank that did not come.
                    bound = None if timeout is None else timedelta(seconds=timeout)
                    _dist.monitored_barrier(group=self.distributed_helper.cpu_comm_group, timeout=bound,
                                            wait_all_ranks=True)  # fmt: skip
                except Exception as error:
                    _collective_failed(status, error)
                    raise
            status.barrier()  # P-BARRIER: the group leaves the window together
            weights.check_model_unchanged(self, changed)
            if changed:
                weights.forget_shared_prefixes(self)  # D6: no new request reads KV from before the pause
            versions = self.output_router.versions
            if versions.max_staleness is not None and weights.set_new_version(versions, before):
                modes.restart_stale(self)  # R-STALENESS
        else:
            status.no_pause()  # P-NO-PAUSE
        return payload_size, False


def _collective_failed(status: PauseProtocol, error: BaseException) -> None:
    """P-COLLECTIVE-TIMEOUT: a peer died or never came.  Record ``error`` and stop, waking every waiter.  Where the
    spec has no collective failing, the error is recorded all the same (the caller must see it, not a complaint)."""
    try:
        status.collective_timeout(error)
    except RuntimeError:
        status.record_fatal_error(error)


EXIT_STOP_TIMEOUT = 10.0  # seconds the interpreter's exit waits for a loop that was not stopped

# The manager whose loop last started on each model: two loops stepping one model would each pause only
# their own, and a holder of one would see the other's forward steps (R-EXCLUSION).
_DRIVER_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DRIVER_LOCK = threading.Lock()


def _leave(status: PauseProtocol, hold: PauseHold) -> None:
    """P-LEAVE-PAUSE at the end of a ``pause()`` block, from whichever thread ends it.  (An asynchronous exception
    that lands here before the hold left is handled by ``pause()``'s outer handler, which finishes the release.)"""
    try:
        status.leave_pause(hold)
    except RuntimeError:
        if hold.state != "idle":
            raise
        raise RuntimeError(
            "this pause was already released (a release_pause() inside the with block, or its thread died and the "
            "loop released it?): nothing was changed"
        ) from None


def _stop_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit: hard-stop a loop that is still running, so that its requests get their output."""
    manager = ref()
    if manager is not None and manager.is_running():
        manager.stop(block=True, timeout=EXIT_STOP_TIMEOUT, hard_stop=True)


class PausableContinuousBatchingManager(weights.VersionedManager, admission.Admission, _api.ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` driven by :class:`PauseProtocol`.

    Build it with :func:`init_continuous_batching`.  Same methods as upstream's; ``pause()`` adds
    ``timeout=``.  ``background_thread_status`` is the manager's :class:`PauseProtocol` (its ``metrics()``
    tell how many pauses were taken and how long the loop was paused).
    """

    background_thread_status: PauseProtocol

    # Defaults for a manager built with __new__, as transformers' own pause tests build one (issue 26, point 15):
    # its stop() then works as upstream's.  The class lock serves only such managers; __init__ gives each its own.
    _teardown_lock = threading.Lock()
    _loop_done, _teardown_asked, _stop_at_exit_registered = True, None, False  # _teardown_asked: a stop's keep flag

    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig,
        workload_hints: Any = None,
        *,
        peer_park_timeout: float | None = 300.0,
        trace: Any = None,
        while_paused: str = "queue",
        max_staleness: int | None = None,
        on_stale: str = "restart",
    ) -> None:
        status = PauseProtocol(peer_park_timeout=peer_park_timeout, trace=trace)  # validates the timeout first
        self.while_paused = admission.checked_while_paused(while_paused)
        staleness = weights.checked_staleness(max_staleness, on_stale)
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        self.background_thread_status, self._wake_up_loop = status, SafeEvent()  # SafeEvent: issue 26, point 1
        # P-SUBMIT: the acceptance check and the enqueue happen under this lock, and so does the loop's last
        # drain of the queue; a request is then either drained (and gets its output) or refused.
        self._submit_lock = threading.Lock()
        # stop() never tears down a loop that still runs: it leaves the teardown to the loop's exit path. The
        # lock orders the two: either stop() sees the loop done and tears down, or the loop finds the request.
        self._teardown_lock = threading.Lock()
        # The ids of the requests in flight (added, no terminal output delivered yet): a duplicate would make the
        # scheduler mix two requests up and fail the loop (upstream), so add_request refuses one.
        self._live_ids: set[str] = set()
        self.versions = weights.WeightVersions(*staleness)  # the version in force, each request's spans, the bound
        self.output_router = admission.TrackingRouter(self._live_ids, self.versions)
        if self.is_tp_driver:  # the requests are the driver's; the other ranks' outputs are copies nobody reads
            self.output_router.status = status

    def add_request(
        self,
        input_ids: list[int],
        request_id: str | None = None,
        max_new_tokens: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> str | None:
        """Upstream's ``add_request``, atomic against the loop's exit (P-SUBMIT, R-NOTHING-LOST-DELIVERED), and
        refusing at the door what would otherwise fail later, in the loop, for every request in flight.

        Upstream checks that the loop accepts requests, then enqueues: a request enqueued after the loop's
        last drain is never seen again.  Returns ``None`` (and logs why) when the loop does not accept
        requests, as upstream does (``add_requests`` is all or nothing: see there).  Raises, with nothing enqueued:
        ``TypeError`` for a prompt that is not a sequence of integers, a ``max_new_tokens`` that is not an
        integer or a ``request_id`` that is not a string; ``ValueError`` for an empty prompt, a token id outside
        ``[0, vocab_size)``, ``max_new_tokens < 1``, a prompt plus ``max_new_tokens`` that cannot fit the KV cache,
        or a ``request_id`` of a request still in flight (added, its terminal output not delivered yet).  The
        cache's size is known once the loop built it; a request too long for it that comes earlier fails alone,
        with the same ``ValueError`` as its error, when the loop takes it.
        """
        prompt, max_new_tokens = self.checked_request(input_ids, max_new_tokens)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {request_id!r}")
        with self._submit_lock:
            self.refuse_while_paused()
            if request_id is None:
                request_id = self.next_request_id()
            elif request_id in self._live_ids:
                raise ValueError(f"request_id {request_id!r} is already in use by a request in flight")
            return self.enqueue(prompt, request_id, max_new_tokens, *args, **kwargs)

    def _fail_all_remaining_requests(self, error: Exception, batch_processor: Any) -> None:
        with self._submit_lock:  # the loop's last drain (see add_request)
            super()._fail_all_remaining_requests(error, batch_processor)

    @contextmanager
    def pause(self, timeout: float | None = None, mode: str = "keep", weights_changed: bool = True) -> Iterator[None]:
        """Pause the generation loop while inside the ``with`` block; the loop resumes when the last holder leaves.

        ``mode`` says what happens to the requests in flight (R-MODES; :mod:`cbpause.integrations.modes`): ``"keep"``
        (they keep their KV and go on after the resume), ``"retract"`` (their KV is freed; they are prefilled again
        after the resume), ``"drain"`` (the loop admits no new request and finishes those in flight before the
        window opens; ``timeout`` bounds that too) or ``"abort"`` (every request queued or in flight ends with a
        terminal output, status FAILED, error ``modes.ABORTED_BY_PAUSE``).  Holders asking at once get the
        strongest mode (keep < retract < drain < abort), agreed by every rank; a holder asking for more than the
        open window's mode waits for the next window, and so does one arriving after a holder left the window
        (R-WINDOW-CLOSES: threads taking turns cannot keep it open).  Nothing is lost (R-NOTHING-LOST-DELIVERED).
        ``weights_changed=False`` says the holder leaves the weights alone: the KV blocks kept for prefix sharing
        survive a window whose every holder said so and in which the weight version did not change (D6).
        While any holder is inside, no forward step runs on any rank (R-EXCLUSION, R-SAME-WINDOW).  Under TP
        every rank must pause; a rank whose pauser never comes fails after ``peer_park_timeout`` seconds
        instead of hanging (D3).

        Raises ``RuntimeError`` (the fatal error as ``__cause__``) when the loop is not running, is
        hard-stopping, has failed or stops before pausing; ``RuntimeError`` at once from the loop's own thread
        (D4); ``TimeoutError`` when the loop has not paused within ``timeout`` seconds; ``ValueError`` for a
        negative or non-numeric ``timeout`` or an unknown ``mode``; ``TypeError`` for a ``weights_changed`` that
        is not a bool.  In every case, and on ``KeyboardInterrupt`` while waiting, the request is withdrawn first.

        The hold belongs to the pause, not to the thread: the ``with`` block may end on another thread (an
        asyncio executor's ``__exit__``), and a context manager that is garbage-collected without having been
        exited releases its hold (logging an error that names the thread that entered).
        """
        weights.check_weights_changed(weights_changed)
        status = self.background_thread_status  # a loop that died says why: its fatal error is the cause
        cause = status.fatal_error
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.") from cause
        # request_and_enter_pause appends the hold to `holds` the moment it is requested: an asynchronous exception that
        # lands after the entry and before the with block (where the assignment of a result would be) still finds it.
        holds: list[PauseHold] = []
        entered = False
        try:
            try:
                status.request_and_enter_pause(self._wake_up_loop, mode, timeout=timeout, into=holds)
                entered = True
                if not weights_changed:
                    self.versions.unchanged_entries += 1
                yield
            except GeneratorExit:  # the context manager was closed (collected) without its with block ending
                if holds[0].state == "idle":  # its thread died, and the loop released it (P-RELEASE-DEAD-HOLDER)
                    entered = False
                else:
                    _api.logger.error(f"A pause entered on thread {holds[0].thread.name!r} was never exited; "
                                      "released when its context manager was garbage-collected")  # fmt: skip
                raise
            finally:
                # request_and_enter_pause leaves nothing held when it raises; an exception after it returned leaves
                # the hold inside.
                if holds and (entered or holds[0].state == "inside"):
                    _leave(status, holds[0])
        except BaseException:
            # An asynchronous exception that landed in the finally above before its release: release, then propagate.
            if holds and holds[0].state == "inside":
                status.leave_pause(holds[0])
            raise

    def start(self) -> None:
        """Start the loop thread (upstream's ``start``), named so that it shows in thread dumps.

        ``RuntimeError`` while another manager's loop runs on the same model (its pauses would not stop this
        loop's forward steps).  The thread is a daemon, and the first ``start()`` registers an ``atexit`` hard stop:
        a script that ends (or raises) without ``stop()`` exits instead of waiting for ever on a loop that idles, and
        the requests in flight get their terminal output (failed) first, within ``EXIT_STOP_TIMEOUT`` seconds.
        """
        if self.is_running():
            _api.logger.warning("start(): the generation loop runs already; nothing to do")
            return
        with _DRIVER_LOCK:
            ref = _DRIVER_OF.get(self.model)
            other = ref() if ref is not None else None
            if other is not None and other is not self and other.is_running():
                raise RuntimeError(
                    "this model is already driven by another running continuous-batching manager: its pauses would "
                    "not stop this one's forward steps. Stop that manager first, or use it."
                )
            _DRIVER_OF[self.model] = weakref.ref(self)
        with self._teardown_lock:
            self._loop_done, self._teardown_asked = False, None
        if not self._stop_at_exit_registered:
            atexit.register(_stop_at_exit, weakref.ref(self))
            self._stop_at_exit_registered = True
        self.background_thread_status.clear()  # P-RESTART (a no-op before the first start)
        self._generation_thread = threading.Thread(
            target=self._run_generation_loop, name="cbpause-generation-loop", daemon=True
        )
        self._generation_thread.start()

    def _run_generation_loop(self) -> None:
        # Settle which thread is the loop's before anything else can ask (D4's check relies on it).
        self.background_thread_status.bind_loop_thread()
        self.versions.launched.clear()  # a step of an earlier session that failed was never read back
        try:
            super()._run_generation_loop()
        except BaseException as error:
            # Not an Exception, so upstream's handler let it through, and every request with it: each gets its
            # terminal output before the thread ends (R-NOTHING-LOST-DELIVERED).
            killed = RuntimeError(f"the generation loop was killed: {error!r}")
            self._fail_all_remaining_requests(killed, self.batch_processor)
            raise
        finally:
            with self._teardown_lock:
                self._loop_done, keep = True, self._teardown_asked
                self._teardown_asked = None
            if keep is not None:  # a stop() returned while the loop ran: its teardown is done here, at the end
                self._teardown(keep)

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """Upstream's ``stop``, except that it never tears down a loop that still runs.

        Upstream clears the batch processor (or caches the manager) as soon as its wait ends, whether or not
        the loop has exited: after ``stop(block=False)``, a ``timeout`` that ran out while a holder was inside,
        or a ``stop()`` from the loop's own thread, the running loop then fails every request with "Tried to
        perform a generation step before the batch processor was initialized".  Here the stop is asked, the
        wait (if any) happens, and the teardown is done by whichever of ``stop()`` and the loop's exit path
        comes last.  From the loop's own thread the stop is asked and the call returns at once (it cannot
        wait for itself).  ``RuntimeError`` from inside a pause, as upstream.
        """
        thread = self._generation_thread
        if thread is None:  # never started, or already joined: upstream's checks and teardown are safe
            super().stop(block=block, timeout=timeout, keep_for_next_session=keep_for_next_session,
                         hard_stop=hard_stop)  # fmt: skip
            return
        status = self.background_thread_status
        if status.held_by():  # the loop cannot exit while this thread keeps it paused
            raise RuntimeError(
                "stop() from inside a pause would wait for ever: the loop cannot exit while this thread holds it "
                "paused. Leave the pause first; nothing was changed."
            )
        stop_status = status.HARD_STOP if hard_stop else status.FLUSH_AND_STOP
        status.request_stop(stop_status, self.distributed_helper.global_rank)
        if block and threading.current_thread() is not thread:
            self.join(_api.perf_counter(), timeout)
        with self._teardown_lock:
            if not self._loop_done:
                self._teardown_asked = keep_for_next_session
                return
        self._teardown(keep_for_next_session)

    def _teardown(self, keep_for_next_session: bool) -> None:
        """What upstream's ``stop`` does once the loop has exited (upstream's own cannot be called for it: once the
        loop's thread is joined it only warns "Manager not started"): give the model back the attention
        implementation it had, keep this manager cached on the model for the next session or drop its batch
        processor, and free what the session held."""
        if self._original_attn_impl is not None:
            self.model.set_attn_implementation(self._original_attn_impl)
            self._original_attn_impl = None
        if keep_for_next_session:
            _api.logger.info("this continuous-batching manager stays cached on the model for the next session")
            self.model._cached_continuous_batching_manager = self  # type: ignore[attr-defined]
        else:
            self.batch_processor = None
        _api.gc.collect()
        device = _api.torch.get_device_module()
        if hasattr(device, "empty_cache"):
            device.empty_cache()

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
            if not isinstance(error, Exception) and t.live(s) and s.phase != "window":
                # Upstream handles Exception only: anything else ends the thread (P-FAIL-LOOP, with this error).
                status.fail_loop(error)
            raise

    def _loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        status = self.background_thread_status
        if batch_processor.prepare_next_batch():  # a batch to step
            status.start_step()
            self._generation_step()
            self.current_batch += 1  # (upstream's count of forward steps)
            if not bootstrapping:  # no update when bootstrapping an async batching generation
                batch_processor.update_batch()
            status.end_step()
            return not bootstrapping
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
        # Nothing to step: sleep until a request (or a pause, a stop) wakes the loop, at most 0.1 s (P-IDLE's wait).
        self._wake_up_loop.wait(timeout=0.1)
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
        if s.phase in ("read", "body", "step") and not s.fatal:
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
        if s.phase not in ("stopped", "dead", "window"):
            status.fail_loop(error)
        else:
            status.record_fatal_error(error)  # recorded; the rank has stopped already
        self._fail_all_remaining_requests(error, batch_processor)  # every request still held gets its output

    def _create_batch_processor(self) -> _api.ContinuousBatchProcessor:
        return upstream.patch_processor(super()._create_batch_processor(), PausableBatchProcessor, self.model,
                                        self.versions)  # fmt: skip


INIT_KEYWORDS = ("workload_hints", "peer_park_timeout", "trace", "while_paused", "max_staleness", "on_stale")


def init_continuous_batching(
    model: Any,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    **kwargs: Any,
) -> PausableContinuousBatchingManager:
    """A transformers ``ContinuousBatchingManager`` for ``model``, driven by :class:`PauseProtocol`.

    Takes what ``model.init_continuous_batching`` takes (``workload_hints=`` among ``kwargs``), and
    ``peer_park_timeout=`` (seconds a rank parked for a peer's pause waits for its own pauser; default
    300, ``None`` for ever), ``trace=`` (a :class:`cbpause.TraceRecorder`), ``while_paused=`` (``"queue"``,
    the default: requests submitted while a pause is asked or held wait and run after it; ``"reject"``:
    ``add_request`` raises :class:`cbpause.LoopPausedError` then, and nothing is enqueued), and the staleness bound
    (R-STALENESS) ``max_staleness=`` (``None``, the default: none; an integer ``n``: at the close of a window that set
    a new integer weight version, a request in flight whose oldest token or KV is more than ``n`` versions behind is
    restarted from its prompt, ``on_stale="restart"``, or ends with an error starting with
    ``cbpause.integrations.weights.STALE``, ``on_stale="abort"``).  A cached manager
    (``stop(keep_for_next_session=True)``) of this kind is reused, as upstream does.

    Raises ``TypeError`` for a model that is not a transformers model, ``ValueError`` when no generation
    config can be found or a cached manager is upstream's own, and ``TypeError`` for an unknown keyword.
    """
    unknown = set(kwargs) - set(INIT_KEYWORDS)
    if unknown:
        raise TypeError(f"init_continuous_batching() got unexpected keyword argument(s): {sorted(unknown)}")
    if not all(hasattr(model, a) for a in ("config", "device", "dtype", "_get_logits_processor")):
        raise TypeError(f"expected a transformers generative model (PreTrainedModel), got {type(model).__name__}")

    cached = getattr(model, "_cached_continuous_batching_manager", None)  # stop(keep_for_next_session=True)
    if isinstance(cached, PausableContinuousBatchingManager):
        # Reused as upstream reuses its own, with the attention implementation stop() may have switched back.
        cached.switch_to_cb_friendly_attn(model, cached.continuous_batching_config.auto_switch_to_flash)
        return cached
    if cached is not None:
        raise ValueError(
            "the model caches an upstream ContinuousBatchingManager (stop(keep_for_next_session=True)); call "
            "model.destroy_cached_continuous_batching_manager() first"
        )
    gen_config, continuous_batching_config = _configs(model, generation_config, continuous_batching_config)
    return PausableContinuousBatchingManager(
        model,
        gen_config,
        continuous_batching_config,
        kwargs.get("workload_hints"),
        peer_park_timeout=kwargs.get("peer_park_timeout", 300.0),
        trace=kwargs.get("trace"),
        while_paused=kwargs.get("while_paused", "queue"),
        max_staleness=kwargs.get("max_staleness"),
        on_stale=kwargs.get("on_stale", "restart"),
    )


def _configs(
    model: Any, generation_config: GenerationConfig | None, continuous_batching_config: ContinuousBatchingConfig | None
) -> tuple[GenerationConfig, ContinuousBatchingConfig]:
    """The generation and batching configs a manager runs with, as ``model.init_continuous_batching`` settles them:
    the model's generation config unless one is given (``ValueError`` if there is none; no end-of-sequence token
    means none, ``-1``, with a warning), and the batching config given, else the deprecated one the generation
    config carries (with upstream's warning), else the default."""
    gen_config = model.generation_config if generation_config is None else generation_config
    if gen_config is None:
        raise ValueError("no generation config: pass generation_config= or set the model's generation_config")
    if gen_config.eos_token_id is None:
        _api.logger.warning("the generation config has no eos_token_id: requests end at max_new_tokens only (-1)")
        gen_config.eos_token_id = -1
    carried = getattr(gen_config, "continuous_batching_config", None)
    if continuous_batching_config is None and isinstance(carried, ContinuousBatchingConfig):
        _api.logger.warning("a ContinuousBatchingConfig inside the GenerationConfig is deprecated (transformers): "
                            "pass it as continuous_batching_config=")  # fmt: skip
        continuous_batching_config = carried
    if continuous_batching_config is None:
        continuous_batching_config = ContinuousBatchingConfig()
    return gen_config, continuous_batching_config
