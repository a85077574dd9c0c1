"""``PauseProtocol`` driving transformers' own continuous-batching loop (transformers 5.23, 5.24 and 5.25): the
manager and its entry point, :func:`init_continuous_batching`.

The package :mod:`cbpause.integrations` is the only code of cbpause that knows transformers' internals: this module
(the manager), :mod:`~cbpause.integrations.iteration` (one iteration of the loop, each step reported to the protocol),
:mod:`~cbpause.integrations.admission` (what ``add_request`` refuses, what fails alone, ``while_paused``),
:mod:`~cbpause.integrations.weights` (what a pause means for the KV cache; weight versions, the staleness bound),
:mod:`~cbpause.integrations.modes` (what a pause mode does to the requests), :mod:`~cbpause.integrations.upstream`
(the table of every change made to transformers, with fingerprints), :mod:`~cbpause.integrations.serving`
(``transformers serve`` on this manager) and :mod:`~cbpause.integrations.trl` (TRL's trainer on it).  It returns
transformers' own ``ContinuousBatchingManager`` (a subclass, same methods) whose status object is a
:class:`~cbpause.PauseProtocol`, and changes the loop only where the protocol needs it:

* ``pause(timeout=None, mode="keep", weights_changed=True)`` keeps upstream's signature and adds a timeout
  (P-PAUSE-TIMEOUT) and a pause mode (R-MODES, :mod:`~cbpause.integrations.modes`); from the loop's own thread
  (a logits processor, a callback) it raises at once (D4).  Outputs carry weight versions (R-VERSIONS).
* The TP group step tells the protocol what this rank observed before the all-reduce (P-OBSERVE) and what the
  group decided (P-ALL-REDUCE, then the pause window and P-BARRIER), so a withdrawn request no longer parks the
  loop (D1) and a rank parked for a peer's pause leaves after ``peer_park_timeout`` seconds (D3); a collective that
  fails is P-COLLECTIVE-TIMEOUT (:mod:`~cbpause.integrations.iteration`).
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
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..core.condition import SafeEvent, thread_alive
from ..core.dropin import PauseProtocol
from ..core.protocol import PauseHold
from ..core.rank import PEER_PARK_TIMEOUT_S

# The minor releases of transformers the integration is checked on (docs/transformers-releases.md: how a new one is
# taken in).  cbpause.integrations.upstream keeps the fingerprints of each.
SUPPORTED = ("5.23", "5.24", "5.25")
# Set to 1 to import the integration on a newer release, unchecked, at your own risk (a warning names what is not).
UNCHECKED_ENV = "CBPAUSE_UNCHECKED_TRANSFORMERS"


def check_transformers_version(version: str, environ: Any = None) -> bool:
    """Raise ``ImportError`` unless ``version`` is a release of :data:`SUPPORTED`; True if it is one.

    The integration overrides private methods of transformers' continuous batching, whose shape changes between
    minor releases; running it on another one could silently lose the pause guarantees.  A newer release is let in,
    with a warning, when ``$CBPAUSE_UNCHECKED_TRANSFORMERS`` is ``1`` (returns False then).
    """
    environ = os.environ if environ is None else environ
    parts = version.split(".")
    minor = ".".join(parts[:2])
    if minor in SUPPORTED:
        return True
    newer = _release(minor) > _release(SUPPORTED[-1])
    if newer and environ.get(UNCHECKED_ENV) == "1":
        warnings.warn(
            f"cbpause.integrations.transformers runs on transformers {version}, which it was not checked on "
            f"({UNCHECKED_ENV}=1): the fingerprints of the upstream functions it overrides and wraps "
            "(`python -m cbpause.integrations.upstream`), the drop-in fidelity tests and the Upstream_* models are "
            f"those of {SUPPORTED[-1]}; a changed one may lose the pause guarantees silently",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    hint = f"; to try a newer one at your own risk, set {UNCHECKED_ENV}=1" if newer else ""
    raise ImportError(
        f"cbpause.integrations.transformers supports transformers {', '.join(SUPPORTED)} only, found {version}: "
        f"install one with `pip install 'cbpause[transformers]'`{hint}"
    )


def _release(minor: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in minor.split("."))
    except ValueError:
        return (0,)


try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "cbpause.integrations.transformers needs transformers: `pip install 'cbpause[transformers]'`"
    ) from exc

check_transformers_version(_transformers.__version__)

import inspect  # noqa: E402

import torch  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching import continuous_api as _api  # noqa: E402

# transformers 5.24 on: the loop runs in the inference mode of the thread that started it (thread-local: start() hands
# it over); earlier releases' loops take no argument.
LOOP_TAKES_INFERENCE_MODE = "use_inference_mode" in inspect.signature(
    _api.ContinuousBatchingManager._run_generation_loop
).parameters

from . import admission, sampling, upstream, weights  # noqa: E402
from .iteration import LoopIteration, PausableBatchProcessor  # noqa: E402

__all__ = ["PausableBatchProcessor", "PausableContinuousBatchingManager", "init_continuous_batching"]


EXIT_STOP_TIMEOUT = 10.0  # seconds the interpreter's exit waits for a loop that was not stopped

# The manager whose loop last started on each model: two loops stepping one model would each pause only
# their own, and a holder of one would see the other's forward steps (R-EXCLUSION).
_DRIVER_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DRIVER_LOCK = threading.Lock()

# Every manager of this process: in a child forked from it, none has a loop (fork copies no thread), so each is
# marked and refuses what only its loop could serve (issue 39, point 14: the child accepted requests for ever).
_MANAGERS: weakref.WeakSet = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for manager in list(_MANAGERS):
        manager._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _stop_at_exit(ref: weakref.ref) -> None:
    """At interpreter exit: hard-stop a loop that is still running, so that its requests get their output."""
    manager = ref()
    if manager is not None and manager.is_running():
        manager.stop(block=True, timeout=EXIT_STOP_TIMEOUT, hard_stop=True)


class PausableContinuousBatchingManager(
    LoopIteration, weights.VersionedManager, admission.Admission, _api.ContinuousBatchingManager
):
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
    sampler: sampling.Sampler | None = None  # per_request_sampling=True's (R-SAMPLING)
    _cache_built: Any = None
    _built_processor: Any = None

    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig,
        workload_hints: Any = None,
        *,
        peer_park_timeout: float | None = PEER_PARK_TIMEOUT_S,
        trace: Any = None,
        while_paused: str = "queue",
        max_staleness: int | None = None,
        on_stale: str = "restart",
        max_stale_restarts: int = weights.MAX_STALE_RESTARTS,
        per_request_sampling: bool = False,
    ) -> None:
        status = PauseProtocol(peer_park_timeout=peer_park_timeout, trace=trace)  # validates the timeout first
        self.while_paused = admission.checked_while_paused(while_paused)
        staleness = weights.checked_staleness(max_staleness, on_stale, max_stale_restarts)
        if not isinstance(per_request_sampling, bool):
            raise TypeError(f"per_request_sampling must be True or False, not {per_request_sampling!r}")
        if per_request_sampling:  # before upstream resolves the config: no graphs, log-probabilities read back
            sampling.check_no_graphs(continuous_batching_config)
            continuous_batching_config.return_logprobs = True
        super().__init__(model, generation_config, continuous_batching_config, workload_hints)
        # R-SAMPLING: the sampler replaces upstream's logits-processor list (and, on each batch processor, its model
        # runner's _sample): every request sampled with its own SamplingParams, the generation config's by default.
        self.sampler = sampling.Sampler(sampling.SamplingParams.from_generation_config(generation_config)) \
            if per_request_sampling else None
        if self.sampler is not None:
            self.logit_processor = self.sampler
        self._built_workload_hints = workload_hints  # compared when a cached manager is reused (_reconfigure)
        self._forked = False  # set in a child process forked from this one (_after_fork_in_child)
        _MANAGERS.add(self)
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
        self._cache_built = SafeEvent()  # set once a session's loop built its processor, or ended (wait_for_cache)
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
        self.checked_sampling(kwargs)
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, not {request_id!r}")
        if request_id is not None and weights.FORK_MARK in request_id:  # it would be taken for a forked child's
            raise ValueError(f"request_id {request_id!r}: {weights.FORK_MARK!r} marks the children transformers "
                             "forks (num_return_sequences); choose another id")  # fmt: skip
        with self._submit_lock:
            self.refuse_after_fork()
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
    def pause(self, timeout: float | None = None, mode: str = "keep", weights_changed: bool = True,
              into: list | None = None) -> Iterator[None]:  # fmt: skip
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
        exited releases its hold (logging an error that names the thread that entered).  ``into``, an empty list,
        gets the hold the moment it is requested, so that another thread may withdraw it while it waits
        (``background_thread_status.interrupt``: the wait then raises ``RuntimeError``).
        """
        weights.check_weights_changed(weights_changed)
        status = self.background_thread_status  # a loop that died says why: its fatal error is the cause
        cause = status.fatal_error
        if not self.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.") from cause
        # request_and_enter_pause appends the hold to `holds` the moment it is requested: an asynchronous exception that
        # lands after the entry and before the with block (where the assignment of a result would be) still finds it.
        holds: list[PauseHold] = [] if into is None else into
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
                    try:
                        status.leave_pause(holds[0])  # P-LEAVE-PAUSE, from whichever thread ends the block
                    except RuntimeError:
                        if holds[0].state != "idle":
                            raise
                        raise RuntimeError(
                            "this pause was already released (a leave_pause() of its hold inside the with block, or "
                            "its thread died and the loop released it?): nothing was changed"
                        ) from None
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
        # The refusals first, before anything changes: a refused start() leaves the manager stopped (its requests
        # refused at the door, as a stopped manager's are), not live without a loop.
        # As upstream's start() does from 5.24 on: the loop runs in the caller's inference mode.
        kwargs = {"use_inference_mode": torch.is_inference_mode_enabled()} if LOOP_TAKES_INFERENCE_MODE else {}
        kept = getattr(self, "batch_processor", None)  # a batch processor kept for this session, or None
        built = getattr(kept, "_cbpause_inference_mode", None)
        if kwargs and built is not None and built != kwargs["use_inference_mode"]:
            # A cached batch processor (stop(keep_for_next_session=True)) keeps tensors made in the mode of its first
            # loop: inference tensors cannot be updated outside inference mode, so the loop would die at its first
            # step (found by issue 41's review; upstream's start() has the same flaw).
            raise RuntimeError(
                f"this manager's cached batch processor was built {'inside' if built else 'outside'} "
                f"torch.inference_mode(), and start() is called {'inside' if not built else 'outside'} it: start it "
                "in the same mode, or call model.destroy_cached_continuous_batching_manager() and build a new one"
            )
        if isinstance(kept, PausableBatchProcessor):
            # A batch processor kept for this session keeps its cache, built for the model as it was: a model moved to
            # another dtype or device since would fail in a kernel at the first step (and upstream's does).
            weights.check_model_unchanged(kept, kept=True)
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
        if self._cache_built is not None:
            self._cache_built.clear()
        self._generation_thread = threading.Thread(
            target=self._run_generation_loop, kwargs=kwargs, name="cbpause-generation-loop", daemon=True
        )
        self._generation_thread.start()

    def wait_for_cache(self, timeout: float) -> Any:
        """The KV cache of the running loop, once it has built it (at the start of a session); ``None`` if the loop
        ended first or ``timeout`` seconds passed.  What ``cbpause serve`` reads its capacity from."""
        if self._cache_built is None or not self._cache_built.wait(timeout):
            return None
        processor = self._built_processor
        return getattr(processor, "cache", None) if self.is_running() else None

    def _run_generation_loop(self, **kwargs: Any) -> None:
        # Settle which thread is the loop's before anything else can ask (D4's check relies on it).
        self.background_thread_status.bind_loop_thread()
        self.versions.launched.clear()  # a step of an earlier session that failed was never read back
        try:
            super()._run_generation_loop(**kwargs)  # use_inference_mode (5.24 on), from start()
        except BaseException as error:
            # Not an Exception, so upstream's handler let it through, and every request with it: each gets its
            # terminal output before the thread ends (R-NOTHING-LOST-DELIVERED).
            killed = RuntimeError(f"the generation loop was killed: {error!r}")
            self._fail_all_remaining_requests(killed, self.batch_processor)
            raise
        finally:
            if self._cache_built is not None:  # a wait_for_cache() gets its answer: None, the loop has ended
                self._cache_built.set()
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
            # The thread read once: upstream's join reads the attribute again after its wait, which a stop() ending
            # the same wait on another thread has cleared meanwhile (an AttributeError; found by issue 41's hostile
            # review: a SIGTERM's stop and the app's shutdown).
            thread.join(timeout)
            if thread_alive(thread):
                _api.logger.warning(f"Generation thread did not exit after join timeout ({timeout}).")
            elif self._generation_thread is thread:
                self._generation_thread = None
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
            self._built_processor = None
        _api.gc.collect()
        device = _api.torch.get_device_module()
        if hasattr(device, "empty_cache"):
            device.empty_cache()

    def _create_batch_processor(self) -> _api.ContinuousBatchProcessor:
        processor = upstream.patch_processor(super()._create_batch_processor(), PausableBatchProcessor, self.model,
                                             self.versions, self.background_thread_status)  # fmt: skip
        if self.sampler is not None:
            upstream.sample_per_request(processor, self.sampler)
        self._built_processor = processor
        if self._cache_built is not None:
            self._cache_built.set()
        if not hasattr(processor, "_cbpause_inference_mode"):  # the mode its tensors are made in (kept when reused)
            processor._cbpause_inference_mode = torch.is_inference_mode_enabled()
        return processor


INIT_KEYWORDS = ("workload_hints", "peer_park_timeout", "trace", "while_paused", "max_staleness", "on_stale",
                 "max_stale_restarts", "per_request_sampling")


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
    (R-STALENESS) ``max_staleness=`` (``None``, the default: none; an integer ``n``: at the close of a window that
    set a new integer weight version, a request in flight whose oldest token or KV is more than ``n`` versions
    behind is restarted from its prompt, ``on_stale="restart"``, at most ``max_stale_restarts`` times (default 3)
    before it ends as ``"abort"`` ends it, or ends with an error starting with
    ``cbpause.integrations.weights.STALE``, ``on_stale="abort"``), and ``per_request_sampling=`` (``False``, the
    default: transformers' own sampling, one configuration for every request; ``True``: each request sampled with
    its own :class:`~cbpause.integrations.sampling.SamplingParams`, ``add_request(..., sampling=...)``, the
    generation config's by default, R-SAMPLING; it sets the batching config's ``return_logprobs`` and turns off an
    automatic choice of CUDA graphs, and refuses graphs or a compiled step asked for: ``ValueError``).  A cached
    manager (``stop(keep_for_next_session=True)``) of this kind is reused, as upstream does, with the
    ``while_paused``, ``max_staleness``, ``on_stale`` and ``max_stale_restarts`` given now; a ``peer_park_timeout``,
    ``trace``, ``workload_hints`` or ``per_request_sampling`` other than the ones it was built with is a
    ``ValueError`` (destroy the cached manager first).

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
        _reconfigure(cached, kwargs)
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
        peer_park_timeout=kwargs.get("peer_park_timeout", PEER_PARK_TIMEOUT_S),
        trace=kwargs.get("trace"),
        while_paused=kwargs.get("while_paused", "queue"),
        max_staleness=kwargs.get("max_staleness"),
        on_stale=kwargs.get("on_stale", "restart"),
        max_stale_restarts=kwargs.get("max_stale_restarts", weights.MAX_STALE_RESTARTS),
        per_request_sampling=kwargs.get("per_request_sampling", False),
    )


def _reconfigure(cached: PausableContinuousBatchingManager, kwargs: dict) -> None:
    """The keywords given when a cached manager is reused (issue 39, point 14: they were silently ignored): the
    admission and staleness settings are the manager's own and take the new values (checked first: a bad one changes
    nothing); the others were built into its protocol and loop, so a different value is a ``ValueError`` that says
    to destroy the cached manager first."""
    status = cached.background_thread_status
    fixed = {"peer_park_timeout": status._peer_park_timeout, "trace": status._trace,
             "workload_hints": getattr(cached, "_built_workload_hints", None),
             "per_request_sampling": cached.sampler is not None}  # fmt: skip
    for key, built in fixed.items():
        if key in kwargs and kwargs[key] is not built and kwargs[key] != built:
            raise ValueError(
                f"the model's cached manager (stop(keep_for_next_session=True)) was built with {key}={built!r}, not "
                f"{kwargs[key]!r}: call model.destroy_cached_continuous_batching_manager() first to change it"
            )
    while_paused = admission.checked_while_paused(kwargs.get("while_paused", cached.while_paused))
    versions = cached.versions
    bound = weights.checked_staleness(kwargs.get("max_staleness", versions.max_staleness),
                                      kwargs.get("on_stale", versions.on_stale),
                                      kwargs.get("max_stale_restarts", versions.max_stale_restarts))  # fmt: skip
    cached.while_paused = while_paused
    versions.max_staleness, versions.on_stale, versions.max_stale_restarts = bound


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
