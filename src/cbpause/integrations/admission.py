"""What the transformers integration refuses at the door, and what it fails alone in the loop (issue 13).

Part of the integration (:mod:`cbpause.integrations.transformers` imports it after its version check): with
that module, the only code of cbpause that knows transformers' internals.  A bad request is refused by
``add_request`` with a ``TypeError`` or ``ValueError`` and nothing enqueued; what can only fail later (a request
too long for a cache the loop had not built yet) fails that request alone; a cancelled request gets its
terminal output.
"""

from __future__ import annotations

import numbers
import queue
from collections.abc import Iterator
from typing import Any

from transformers.generation.continuous_batching import continuous_api as _api

from ..core.condition import thread_alive
from ..core.errors import LoopPausedError
from . import sampling

__all__ = [
    "Admission", "TrackingRouter", "cache_capacity", "cache_size", "checked_while_paused", "check_fits", "fail_in_hand",
    "checked_max_new_tokens", "checked_prompt", "TOO_LONG",
]  # fmt: skip


WHILE_PAUSED = ("queue", "reject")


def checked_while_paused(rule: Any) -> str:
    if rule not in WHILE_PAUSED:
        raise ValueError(f"while_paused must be 'queue' or 'reject', not {rule!r}")
    return rule


class Admission:
    """The admission calls of :class:`~cbpause.integrations.transformers.PausableContinuousBatchingManager`."""

    background_thread_status: Any
    output_router: Any
    while_paused: str
    is_tp_driver: bool
    _live_ids: set[str]
    _generation_thread: Any
    _submit_lock: Any
    _request_lock: Any
    _request_counter: int
    _use_prefix_sharing: bool
    model: Any
    generation_config: Any
    batch_processor: Any
    input_queue: queue.Queue
    sampler: Any

    def is_running(self) -> bool:
        """Upstream's, through :func:`cbpause.core.condition.thread_alive`: a Ctrl-C inside ``Thread.is_alive()``
        can mark the live loop's thread stopped for good on CPython 3.11."""
        thread = self._generation_thread
        return thread is not None and thread_alive(thread)

    def checked_request(self, input_ids: Any, max_new_tokens: Any) -> tuple[list[int], int | None]:
        """The prompt and ``max_new_tokens`` of a request, checked (``TypeError``/``ValueError`` otherwise)."""
        prompt = checked_prompt(input_ids, self.model.config.get_text_config().vocab_size)
        max_new_tokens = checked_max_new_tokens(max_new_tokens)
        new_tokens = self.generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens
        check_fits(len(prompt) + (new_tokens or 0), cache_capacity(self.batch_processor))
        return prompt, max_new_tokens

    # What add_request passes on to upstream's besides the logits processors' arguments.
    REQUEST_KEYWORDS = ("streaming", "record_timestamps", "eos_token_id")

    def checked_sampling(self, kwargs: dict) -> None:
        """R-SAMPLING at the door: ``sampling=`` (a :class:`~cbpause.integrations.sampling.SamplingParams`, or None
        for the default) only on a manager built with ``per_request_sampling=True`` (``ValueError`` otherwise), and
        on such a manager no other logits-processor argument (``ValueError``: transformers' per-request processors do
        not run there).  A ``sampling=None`` is dropped."""
        if kwargs.get("sampling", ...) is None:
            del kwargs["sampling"]
        if self.sampler is None:
            if "sampling" in kwargs:
                raise ValueError("sampling= needs a manager built with init_continuous_batching(..., "
                                 "per_request_sampling=True)")  # fmt: skip
            return
        unknown = set(kwargs) - {"sampling", *self.REQUEST_KEYWORDS}
        if unknown:
            raise ValueError(f"unknown arguments {sorted(unknown)}: with per-request sampling, a request's sampling "
                             "is sampling=SamplingParams(...)")  # fmt: skip
        if "sampling" in kwargs and not isinstance(kwargs["sampling"], sampling.SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, not {type(kwargs['sampling']).__name__}")

    def next_request_id(self) -> str:
        """Upstream's naming (``req_N``), skipping the ids a caller chose that are still in flight."""
        with self._request_lock:
            request_id = f"req_{self._request_counter}"
            self._request_counter += 1
            while request_id in self._live_ids:
                request_id = f"req_{self._request_counter}"
                self._request_counter += 1
            return request_id

    def add_requests(
        self,
        inputs: list[list[int]],
        max_new_tokens: int | None = None,
        streaming: bool = False,
        record_timestamps: bool = False,
        **logit_processor_kwargs: Any,
    ) -> list[str]:
        """Upstream's ``add_requests``, all or nothing (issue 26, point 6): every request is checked first, then all
        are enqueued under one hold of the submit lock, after one admission check, so that a pause asked meanwhile
        (``while_paused="reject"``) refuses the whole batch or none of it.  Returns the ids in the order of
        ``inputs`` (``req_N``, skipping ids still in flight); enqueued in prefix-sharing order, as upstream.
        Raises, with nothing enqueued: as ``add_request`` for any one request, ``LoopPausedError`` in reject mode
        during a pause, ``queue.Full`` when the batch does not fit a bounded input queue inside one's own pause,
        ``RuntimeError`` when the loop does not accept requests (upstream logs and drops each).  Outside one's own
        pause, a bounded input queue that fills while the batch goes in makes a put wait, as upstream's does."""
        checked = [self.checked_request(x, max_new_tokens) for x in inputs]
        self.checked_sampling(logit_processor_kwargs)
        status = self.background_thread_status
        with self._submit_lock:
            self.refuse_after_fork()
            self.refuse_while_paused()
            denial = status.can_accept_new_requests()
            if denial is not None:
                raise RuntimeError(f"{denial} Nothing was enqueued.")
            self.refuse_full_queue(len(checked))
            ids = [self.next_request_id() for _ in checked]
            order = list(zip(ids, checked, strict=True))
            if self._use_prefix_sharing:  # upstream's order, for cache hits
                order.sort(key=lambda x: x[1][0], reverse=True)
            # The end-of-sequence token: the generation config's, else the model's, else none (-1).
            eos_token_id = next(
                (e for e in (self.generation_config.eos_token_id, self.model.config.eos_token_id) if e is not None), -1
            )
            for request_id, (prompt, new_tokens) in order:
                self.enqueue(prompt, request_id, new_tokens, streaming=streaming, record_timestamps=record_timestamps,
                             eos_token_id=eos_token_id, **logit_processor_kwargs)  # fmt: skip
        return ids

    def refuse_full_queue(self, n: int) -> None:
        """``queue.Full`` at once when ``n`` more requests do not fit a bounded input queue and this thread is inside a
        pause: the loop takes no request until it leaves (upstream's put would wait 10 s under the submit lock, then
        raise an empty ``Full``)."""
        size, status = self.input_queue.maxsize, self.background_thread_status
        if size and self.input_queue.qsize() + n > size and status.held_by():
            raise queue.Full(
                f"{n} request(s) do not fit the input queue (max_queue_size={size}) and this thread is inside a pause: "
                "the loop takes no request until it leaves; nothing was enqueued"
            )

    def refuse_after_fork(self) -> None:
        """``RuntimeError`` in a child process forked from the one running this manager's loop: fork copies no
        thread, so no loop runs here and a request enqueued would never be answered (nor a pause entered)."""
        if getattr(self, "_forked", False):
            raise RuntimeError(
                "this process was forked from the one whose thread runs this manager's generation loop: no loop runs "
                "here, and nothing added here would ever be served; build a manager in this process (or start it "
                "with the 'spawn' method)"
            )

    def refuse_while_paused(self) -> None:
        """R-ADMISSION: with ``while_paused="reject"``, ``LoopPausedError`` while a holder of this rank (the TP
        driver, which takes the requests) waits for a pause or is inside one; the caller may retry after it."""
        if self.while_paused == "reject" and self.background_thread_status.state.count:
            raise LoopPausedError(
                "the generation loop is paused (or a pause is asked) and this manager was built with "
                "while_paused='reject': nothing was enqueued; retry once the pause is over"
            )

    def enqueue(self, prompt: list[int], request_id: str, max_new_tokens: int | None, *args: Any, **kwargs: Any) -> Any:
        """P-SUBMIT for a checked request, under ``add_request``'s submit lock: the protocol's acceptance check
        (``PauseProtocol.submit``, which a trace records in order with the stops), then upstream's enqueue.  The id
        joins ``_live_ids`` before the enqueue (the loop may deliver the output at once) and leaves it if upstream
        refuses after all; that refusal is the caller's answer, its terminal output in the trace."""
        if not self.is_tp_driver:  # upstream's no-op
            return super().add_request(prompt, request_id, max_new_tokens, *args, **kwargs)  # type: ignore[misc]
        self.refuse_full_queue(1)
        if self.sampler is not None:  # a seed drawn here, on the driver, for a request that names none (R-SAMPLING)
            kwargs["sampling"] = kwargs.get("sampling", self.sampler.default).seeded()
        denial = self.background_thread_status.submit(request_id)
        if denial is not None:
            _api.logger.warning(f"{denial}. Request {request_id!r} will be dropped.")
            return None
        self._live_ids.add(request_id)
        added = None
        try:
            added = super().add_request(prompt, request_id, max_new_tokens, *args, **kwargs)  # type: ignore[misc]
        finally:
            if added is None:  # refused (a stop came since the check), or the enqueue raised
                self._live_ids.discard(request_id)
                self.background_thread_status.record_request("Deliver", request_id)
        return added

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        """Upstream's ``get_result``; from inside the caller's own pause, a wait without a timeout on an empty
        output queue raises ``RuntimeError`` at once (the loop cannot produce anything until the caller
        leaves), as ``stop()`` does there.  With a timeout it returns ``None`` when that runs out."""
        status = self.background_thread_status
        if timeout is None and status.held_by() and self.output_router.output_queue.empty():
            raise RuntimeError(
                "get_result() without a timeout from inside a pause would wait for ever: the generation loop is "
                "paused until this thread leaves the pause. Leave it first, or pass a timeout."
            )
        return super().get_result(request_id=request_id, timeout=timeout)  # type: ignore[misc]

    def __iter__(self) -> Iterator[Any]:
        """Upstream's: the outputs as they come, while the loop runs.  Inside the caller's own pause it yields what is
        already there, then raises ``RuntimeError`` instead of waiting for ever (issue 26, point 5)."""
        return self._outputs(None)

    def request_id_iter(self, request_id: str) -> Iterator[Any]:
        """Upstream's: the outputs of ``request_id`` until its last, while the loop runs; inside the caller's own
        pause, as ``__iter__``."""
        return self._outputs(request_id)

    def _outputs(self, request_id: str | None) -> Iterator[Any]:
        status = self.background_thread_status
        get = super().get_result  # type: ignore[misc]
        while self.is_running():
            if not status.held_by():
                result = get(request_id=request_id, timeout=0.1)
            else:  # look once at each output queued (another request's goes back to the end), without waiting
                for _ in range(max(1, self.output_router.output_queue.qsize())):
                    if (result := get(request_id=request_id, timeout=0)) is not None:
                        break
                if result is None:
                    raise RuntimeError(
                        "waiting for outputs from inside a pause would wait for ever: the generation loop is paused "
                        "until this thread leaves the pause. Leave it first."
                    )
            if result is not None:
                yield result
                if request_id is not None and result.is_finished():
                    return


def checked_prompt(input_ids: Any, vocab_size: int) -> list[int]:
    """The prompt as a list of ints, or ``TypeError``/``ValueError`` naming what is wrong with it."""
    if isinstance(input_ids, _api.torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dim() != 1:
            raise TypeError(f"input_ids must be a 1-D integer tensor, not {input_ids.dtype} of shape "
                            f"{tuple(input_ids.shape)}")  # fmt: skip
        input_ids = input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
        raise TypeError(f"input_ids must be a sequence of token ids, not {type(input_ids).__name__}")
    prompt = []
    for i, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"input_ids[{i}] must be an integer token id, not {token!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(f"input_ids[{i}] = {token} is not a token id of this model (0 to {vocab_size - 1})")
        prompt.append(int(token))
    if not prompt:
        raise ValueError("input_ids is empty: a request needs at least one prompt token")
    return prompt


def checked_max_new_tokens(max_new_tokens: Any) -> int | None:
    """``max_new_tokens`` as an int (None: the generation config's), or ``TypeError``/``ValueError``."""
    if max_new_tokens is None:
        return None
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an integer, not {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    return int(max_new_tokens)


class TrackingRouter(_api.OutputRouter):
    """Upstream's output router, which also forgets each request id once its terminal output is delivered (the ids
    in ``live`` are the requests in flight, which ``add_request`` refuses to reuse), records the delivery in the
    driver's trace (``Deliver``), and gives every output its ``weight_versions`` and ``kv_versions`` spans
    (:class:`cbpause.integrations.weights.WeightVersions`)."""

    def __init__(self, live: set[str], versions: Any) -> None:
        super().__init__()
        self.live = live
        self.versions = versions
        self.status: Any = None  # the driver's PauseProtocol, which writes each terminal output into its trace
        # The requests whose first forward step the driver's trace recorded (FirstStep, modes.record_first_steps)
        # and that are not delivered yet: in flight as TracePauseProtocol sees them.
        self.traced_in_flight: set[str] = set()
        # While a traced step's tokens are read back, its terminal outputs' trace records, held for after its Land.
        self.held_outputs: list | None = None

    def _delivered(self, request_id: str) -> None:
        # Recorded before the id is free again: a caller reusing it at once has its Submit recorded after this
        # Deliver, which the trace then numbers as the old request's (found by a hostile review, issue 40).
        if self.status is not None:
            self.status.record_request("Deliver", request_id)
        self.traced_in_flight.discard(request_id)
        self.live.discard(request_id)

    def _label(self, output: Any) -> bool:
        finished = output.is_finished()
        output.weight_versions, output.kv_versions = self.versions.spans(output.request_id, finished)
        if finished and self.status is not None and self.status.tracing:  # RequestVersions' Deliver, with the labels
            fields = {"id": output.request_id, "failed": output.status == _api.RequestStatus.FAILED,
                      "tokens": len(output.generated_tokens), "weights": list(output.weight_versions),
                      "kv": list(output.kv_versions)}  # fmt: skip
            if self.held_outputs is not None:
                self.held_outputs.append(fields)
            else:
                self.status.record_labels("Output", **fields)
        return finished

    # A terminal output's id is free again before the output is handed over: its receiver (a thread waiting in
    # get_result, a handler the event loop runs) may send a request with the same id at once, which add_request
    # refused as in flight while the loop's thread had not yet come back here (found by issue 41's hostile review: 15%
    # of immediate reuses over HTTP were a 409).  The request is out of the scheduler by now.

    def deliver(self, output: Any) -> None:
        if self._label(output):
            self._delivered(output.request_id)
        super().deliver(output)

    def deliver_batch(self, outputs: list) -> None:
        for output in outputs:
            if self._label(output):
                self._delivered(output.request_id)
        super().deliver_batch(outputs)


def cache_capacity(processor: Any) -> int | None:
    """The most tokens (prompt plus new ones) one request can hold in the processor's KV cache, or None before the
    loop built it."""
    cache = getattr(processor, "cache", None)
    return None if cache is None else int(cache.max_tokens_read)


def cache_size(cache: Any, page_size: int) -> dict[str, Any]:
    """What a built KV cache holds: ``blocks`` of ``page_size`` tokens, its ``bytes`` (the one tensor transformers
    allocates for it), its ``device``, and the tokens one request can hold (``per_request``)."""
    tensor = cache.cache_tensor
    return {"blocks": int(cache.num_blocks), "page_size": int(page_size), "device": str(tensor.device),
            "bytes": int(tensor.numel() * tensor.element_size()),
            "per_request": int(cache.max_tokens_read)}  # fmt: skip


TOO_LONG = "the prompt plus max_new_tokens"  # how the error of a request too long for the KV cache starts


def check_fits(n_tokens: int, capacity: int | None) -> None:
    if capacity is not None and n_tokens > capacity:
        raise ValueError(
            f"{TOO_LONG} ({n_tokens} tokens) cannot fit the KV cache, which holds {capacity} "
            "tokens per request (ContinuousBatchingConfig.num_blocks x page_size)"
        )


def fail_in_hand(processor: Any, states: list, error: Exception) -> None:
    """Give each request in hand (taken from the input queue, or carried by the payload broadcast, and not in the
    scheduler yet) its terminal failed output, emptying ``states`` as it goes: a request leaves the list once its
    output is delivered, so a second call (the failure of a delivery reaching an outer handler) never delivers one
    twice.

    Requests in hand are in no queue and no scheduler, so the loop's exit path cannot see them: upstream 5.23.0
    loses them when a collective or the pause window raises, or on a hard stop (R-NOTHING-LOST-DELIVERED).
    """
    while states:
        processor.output_router.fail_and_deliver(states[0], error)
        states.pop(0)
