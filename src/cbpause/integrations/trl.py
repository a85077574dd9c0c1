"""TRL's ``AsyncGRPOTrainer`` rolling out through a cbpause engine (TRL 1.16.x only; ``pip install 'cbpause[trl]'``).

The trainer takes two pieces, and this module gives both, for an engine in the trainer's own process (a second copy of
the policy, driven by :func:`cbpause.integrations.transformers.init_continuous_batching`):

* :class:`PauseWeightSync`, its ``weight_transfer``: ``pause()`` enters ``manager.pause(mode, timeout)``,
  ``send_weights()`` copies the trainer's parameters into the engine's model in place and sets the weight version to
  the number of syncs so far (the trainer's ``model_version`` after the same sync), ``resume()`` leaves the pause.
* :class:`CBRolloutWorker`, its ``rollout_worker``: a producer thread that keeps groups of completions in flight on
  the engine, scores them and puts TRL ``RolloutSample`` s on a bounded queue, each labelled with the oldest weight
  version among its tokens.

The single-process limit: TRL drives the weight sync from its main process only, so an engine split over tensor-
parallel ranks needs one ``pause()``/``send_weights()``/``resume()`` per rank (a pauser on each rank, as
``docs/trl.md`` says); this module serves the one-rank engine.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..core import transitions as t
from ..core.arguments import check_timeout

SUPPORTED = "1.16"

logger = logging.getLogger("cbpause")


def check_trl_version(version: str) -> None:
    """``ImportError`` unless ``version`` is a TRL 1.16.x release: the trainer's two protocols and its
    ``RolloutSample`` are experimental, and their shapes change between minor releases."""
    if version.split(".")[:2] != SUPPORTED.split("."):
        raise ImportError(
            f"cbpause.integrations.trl supports TRL {SUPPORTED}.x only, found {version}: install it with "
            f"`pip install 'trl=={SUPPORTED}.*'` (or `pip install 'cbpause[trl]'`)"
        )


try:
    import trl as _trl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"cbpause.integrations.trl needs TRL {SUPPORTED}.x: `pip install 'cbpause[trl]'`") from exc

check_trl_version(_trl.__version__)

import numpy as np  # noqa: E402
import torch  # noqa: E402

# TRL's experimental async GRPO, imported here and nowhere else in cbpause (issue 41): the stable AsyncGRPOTrainer of a
# later TRL is a change to these lines (the demo, the benchmark and the test kit take the names from this module).
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402

from .modes import ABORTED_BY_PAUSE  # noqa: E402
from .transfer import InProcess, ModelWriter  # noqa: E402
from .weights import STALE, PartialSync, engine_name  # noqa: E402

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "CBRolloutWorker", "PartialSync", "PauseWeightSync",
           "async_grpo_trainer", "engine_name", "packing", "without_vllm"]

MODE_NAMES = tuple(t.MODE_NAMES.values())
# How many times the worker submits one completion again after the engine's staleness bound ended it (each time after
# the engine's own max_stale_restarts): past that it fails, saying why, instead of retrying for ever (issue 40).
MAX_STALE_RESUBMITS = 3


@contextmanager
def without_vllm() -> Iterator[None]:
    """TRL's own rollout worker (``AsyncRolloutWorker``, what ``AsyncGRPOTrainer(rollout_worker=None)`` builds) may be
    built inside this context without the ``vllm`` package installed.

    TRL 1.16's worker talks to its server over HTTP only (``aiohttp``: ``/v1/completions``) and never imports vLLM, but
    its constructor refuses to run unless vLLM is installed (``is_vllm_available()``), which on a machine without a
    CUDA build of torch cannot be.  Inside the context that one check, in the worker's module only, says yes; nothing
    else of TRL is changed, and the worker runs as TRL wrote it (docs/trl.md, "TRL's own rollout worker")."""
    from trl.experimental.async_grpo import async_rollout_worker

    saved = async_rollout_worker.is_vllm_available
    async_rollout_worker.is_vllm_available = lambda *args, **kwargs: True
    try:
        yield
    finally:
        async_rollout_worker.is_vllm_available = saved


class PauseWeightSync:
    """TRL's ``WeightTransferProtocol`` over a cbpause manager in the trainer's process.

    Decisions (``docs/trl.md``): a sync is ``pause()``, ``send_weights()``, ``resume()`` on the trainer's main thread;
    the engine's weight version after sync ``n`` is ``n`` (TRL counts its ``model_version`` the same way: the cold
    sync at train begin is 1).  A ``send_weights`` that fails after copying some parameters labels the engine's weights
    :class:`PartialSync` (TRL then calls ``destroy()`` only, which releases the pause).  Nothing here stops the
    manager: it is the caller's, who started it.
    """

    def __init__(self, manager: Any, *, mode: str = "keep", timeout: float | None = 60.0) -> None:
        if mode not in MODE_NAMES:
            raise ValueError(f"mode must be one of {MODE_NAMES}, not {mode!r}")
        check_timeout(timeout)
        self.manager, self.mode, self.timeout = manager, mode, timeout
        self.syncs = 0  # completed syncs (the engine's weight version after the last one)
        self.sync_seconds = 0.0  # time spent inside pauses, the copy included
        self._pause: Any = None  # the manager.pause() context entered by pause(), until resume() or destroy()
        self._entered_at = 0.0

    def init_weight_transfer(self) -> None:
        """Nothing to set up in one process; ``RuntimeError`` if the manager's loop is not running (start it first)."""
        if not self.manager.is_running():
            raise RuntimeError("PauseWeightSync: start the manager (manager.start()) before the trainer's train()")

    def pause(self) -> None:
        """Enter ``manager.pause(mode, timeout)``: raises as it does (``TimeoutError``, ``RuntimeError`` for a loop
        that died), holding nothing.  ``RuntimeError`` when this sync holds a pause already."""
        if self._pause is not None:
            raise RuntimeError("pause(): this weight sync holds a pause already (resume() it first)")
        context = self.manager.pause(timeout=self.timeout, mode=self.mode)
        context.__enter__()
        self._pause, self._entered_at = context, time.perf_counter()

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each ``(name, tensor)`` into the engine's parameter of that name, in place, then set the weight
        version to the new sync count.  ``KeyError`` for a name the engine lacks, ``ValueError`` for a shape or dtype
        that differs; nothing after the faulty one is copied.  ``ValueError`` for an iterator that yields no tensor (no
        sync happened: the version is unchanged).  ``RuntimeError`` outside ``pause()``."""
        if self._pause is None:
            raise RuntimeError("send_weights() outside pause(): the loop would step while the weights change")
        writer = ModelWriter(self.manager.model)  # the one sink of every transport (cbpause.integrations.transfer)
        try:
            InProcess(self.manager.model, iterator).receive(writer.load)
        except BaseException:
            if writer.copied:
                self.manager.set_weight_version(PartialSync(self.syncs + 1))
            raise
        if not writer.copied:  # issue 39, point 14: an empty sync counted as a full one, labelling old weights as new
            raise ValueError("send_weights() got no tensor: nothing was synced, and the weight version is unchanged")
        self.syncs += 1
        self.manager.set_weight_version(self.syncs)

    def resume(self) -> None:
        """Leave the pause taken by ``pause()``; ``RuntimeError`` without one."""
        if self._pause is None:
            raise RuntimeError("resume() without pause()")
        context, self._pause = self._pause, None
        self.sync_seconds += time.perf_counter() - self._entered_at
        context.__exit__(None, None, None)

    def destroy(self) -> None:
        """Release a pause still held (a ``send_weights`` that raised); never raises (TRL calls it in a ``finally``,
        where an error would hide the one that brought it there) and never stops the manager."""
        if self._pause is None:
            return
        try:
            self.resume()
        except Exception:
            logger.exception("PauseWeightSync.destroy(): releasing the pause failed")


def _policy(version: Any) -> int:
    """A token's policy version for TRL: ``None`` (before the cold sync) is the initial policy, 0; anything but an
    integer (a :class:`PartialSync`) is no policy, -1, older than any, so that the trainer drops the sample."""
    if version is None:
        return 0
    return version if isinstance(version, int) and not isinstance(version, bool) else -1


@dataclass
class _Group:
    """One prompt's ``num_generations`` completions in flight."""

    group_id: int
    row: dict
    prompt_ids: list[int]
    outputs: list
    started: float
    stale: dict = field(default_factory=dict)  # completion index -> times the engine's staleness bound ended it


class CBRolloutWorker:
    """TRL's ``RolloutWorkerProtocol``, in process: a thread keeps ``max_inflight_groups`` groups of
    ``num_generations`` completions in flight on ``manager``, scores each finished group with ``reward_funcs`` and
    puts one ``RolloutSample`` per completion on ``rollout_buffer`` (bounded: ``queue_maxsize``, by default
    ``num_generations * max_inflight_groups``: the further ahead the worker may run, the staler its samples).

    * Rows of ``dataset`` give the prompt as ``prompt_ids`` (token ids) or ``prompt`` (text, tokenized with
      ``processing_class``; a list of chat messages goes through its chat template).  The rows are taken in order,
      cycling.  The other columns reach the reward functions as keyword arguments, one value per completion.
    * ``reward_funcs``: TRL's signature ``f(prompts=, completions=, completion_ids=, **columns) -> list[float|None]``;
      their sum is the reward (``None`` from every function: unscorable, advantage 0), the advantage is the reward's
      z-score within the group, as TRL's own worker computes it.
    * ``old_log_probs`` are the engine's (``ContinuousBatchingConfig(return_logprobs=True)`` is required);
      ``model_version`` is the oldest weight version among the completion's tokens (``weight_versions``; a token of a
      :class:`PartialSync` counts as -1, so that the trainer drops the sample as stale).
    * A request ended by a pause of mode ``abort``, or by the engine's staleness bound (``on_stale="abort"``, or its
      ``max_stale_restarts`` spent), is submitted again from its prompt, as a new request with a budget of its own;
      one completion ended stale more than ``MAX_STALE_RESUBMITS`` times fails the worker with a message that says
      why, and so does any other failed request (``check_health`` raises it).
    * Per sample, ``metrics_queue`` gets ``cbpause/reward``, ``cbpause/staleness`` (the worker's ``model_version``
      minus the sample's), ``cbpause/versions_spanned`` and ``cbpause/tokens_per_s``.

    Build the engine with ``init_continuous_batching(..., max_staleness=args.max_staleness)`` (R-STALENESS): a request
    that falls further behind than the trainer would accept is restarted (or, ``on_stale="abort"``, ended and
    submitted again here) at the window that makes it so, instead of being finished and dropped by the trainer.

    The worker owns the manager's output queue (``get_result``): nothing else may read results from it.  ``stop()``
    cancels the requests it has in flight and joins the thread; it does not stop the manager.
    """

    def __init__(
        self,
        manager: Any,
        dataset: Any,
        reward_funcs: Callable | list[Callable],
        *,
        num_generations: int,
        max_new_tokens: int,
        processing_class: Any = None,
        max_inflight_groups: int = 2,
        queue_maxsize: int | None = None,
        poll_s: float = 0.05,
        join_timeout: float = 30.0,
    ) -> None:
        if queue_maxsize is None:  # a group ahead per group in flight: samples wait little, so they age little
            queue_maxsize = num_generations * max_inflight_groups if isinstance(num_generations, int) else 1
        sizes = dict(num_generations=num_generations, max_new_tokens=max_new_tokens,
                     max_inflight_groups=max_inflight_groups, queue_maxsize=queue_maxsize)  # fmt: skip
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty")
        if not manager.continuous_batching_config.return_logprobs:
            raise ValueError("the manager must return log-probabilities: "
                             "ContinuousBatchingConfig(return_logprobs=True)")  # fmt: skip
        self.manager, self.dataset = manager, dataset
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.reward_names = [getattr(f, "__name__", type(f).__name__) for f in self.reward_funcs]
        self.num_generations, self.max_new_tokens = num_generations, max_new_tokens
        self.processing_class, self.max_inflight_groups = processing_class, max_inflight_groups
        self.poll_s, self.join_timeout = poll_s, join_timeout
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self.model_version = 0
        self.resubmitted = 0  # requests submitted again (aborted by a pause, or stale)
        self.samples = 0  # samples put on the buffer
        self.tokens = 0  # tokens of the completions finished and scored
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._produced_at = time.monotonic()
        self._in_flight: dict[str, tuple[_Group, int]] = {}  # request id -> (its group, its index there)

    # -- RolloutWorkerProtocol ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            logger.warning("CBRolloutWorker.start(): already running; nothing to do")
            return
        self._stop.clear()
        self._error, self._produced_at = None, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="cbpause-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop producing: cancel the requests in flight, join the thread (``join_timeout``); logs, never raises."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(self.join_timeout)
            if thread.is_alive():
                logger.error("CBRolloutWorker.stop(): the thread did not end within %.0f s", self.join_timeout)
        for request_id in list(self._in_flight):
            try:
                self.manager.cancel_request(request_id)
            except Exception:
                logger.exception("CBRolloutWorker.stop(): cancelling %s failed", request_id)
        self._in_flight.clear()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """Raise with the thread's error, if it ended on one, or when it has put nothing for ``stale_after_s``."""
        if self._error is not None:
            raise RuntimeError("CBRolloutWorker failed; see the chained exception") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("CBRolloutWorker's thread ended without being stopped")
        idle = time.monotonic() - self._produced_at
        if idle > stale_after_s:
            raise RuntimeError(f"CBRolloutWorker produced nothing for {idle:.0f} s (> {stale_after_s:.0f} s)")

    # -- the producer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._produce()
        except BaseException as error:
            self._error = error
            logger.exception("CBRolloutWorker failed")

    def _produce(self) -> None:
        groups: dict[int, _Group] = {}
        next_group = 0
        while not self._stop.is_set():
            while len(groups) < self.max_inflight_groups:
                row = self.dataset[next_group % len(self.dataset)]
                group = _Group(next_group, dict(row), self._prompt_ids(row), [None] * self.num_generations,
                               time.perf_counter())  # fmt: skip
                for index in range(self.num_generations):
                    self._submit(group, index)
                groups[group.group_id], next_group = group, next_group + 1
            output = self.manager.get_result(timeout=self.poll_s)
            if output is None:
                if not self.manager.is_running():
                    status = self.manager.background_thread_status
                    raise RuntimeError("the generation loop stopped") from status.fatal_error
                continue
            slot = self._in_flight.pop(output.request_id, None)
            if slot is None:
                continue  # not one of ours (or cancelled)
            group, index = slot
            if output.error:
                if str(output.error).startswith(STALE):
                    group.stale[index] = group.stale.get(index, 0) + 1
                    if group.stale[index] > MAX_STALE_RESUBMITS:  # issue 40: no completion is retried for ever
                        raise RuntimeError(
                            f"a completion of prompt group {group.group_id} was ended by the engine's staleness bound "
                            f"{group.stale[index]} times (each after its own restarts): it needs more forward steps "
                            "than the weight updates leave it; raise max_staleness (or max_stale_restarts), or update "
                            f"less often. Last: {output.error}"
                        )
                if str(output.error).startswith((ABORTED_BY_PAUSE, STALE)):
                    self.resubmitted += 1
                    self._submit(group, index)
                    continue
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            group.outputs[index] = output
            if all(o is not None for o in group.outputs):
                del groups[group.group_id]
                for sample in self._score(group):
                    self._put(sample)

    def _prompt_ids(self, row: Any) -> list[int]:
        if "prompt_ids" in row:
            return [int(i) for i in row["prompt_ids"]]
        prompt = row["prompt"]
        if self.processing_class is None:
            raise ValueError("a text prompt needs processing_class (a tokenizer), or give the rows prompt_ids")
        if isinstance(prompt, list):
            return list(self.processing_class.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        return list(self.processing_class(prompt, add_special_tokens=False)["input_ids"])

    def _submit(self, group: _Group, index: int) -> None:
        request_id = self.manager.add_request(list(group.prompt_ids), max_new_tokens=self.max_new_tokens)
        if request_id is None:
            raise RuntimeError("the engine refused a request (its loop is not running)")
        self._in_flight[request_id] = (group, index)

    def _put(self, sample: RolloutSample) -> None:
        sample.enqueued_at = time.time()
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=self.poll_s)
            except queue.Full:
                continue
            self.samples += 1
            self._produced_at = time.monotonic()
            return

    def _rewards(self, group: _Group, completions: list, completion_ids: list) -> tuple[np.ndarray, np.ndarray]:
        """The group's summed rewards (NaN where every function said None) and each function's."""
        n = self.num_generations
        columns = {k: [v] * n for k, v in group.row.items() if k not in ("prompt", "prompt_ids")}
        prompts = [group.row.get("prompt", group.prompt_ids)] * n
        table = []
        for func in self.reward_funcs:
            values = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            table.append([math.nan if v is None else float(v) for v in values])
        per_func = np.array(table, dtype=float).reshape(len(self.reward_funcs), n)
        rewards = np.nansum(per_func, axis=0)
        rewards[np.all(np.isnan(per_func), axis=0)] = np.nan
        return rewards, per_func

    def _score(self, group: _Group) -> Iterator[RolloutSample]:
        ids = [list(o.generated_tokens) for o in group.outputs]
        self.tokens += sum(map(len, ids))
        decode = self.processing_class.decode if self.processing_class is not None else None
        completions = [decode(i, skip_special_tokens=True) if decode else i for i in ids]
        rewards, per_func = self._rewards(group, completions, ids)
        scored = ~np.isnan(rewards)
        advantages = np.zeros_like(rewards)
        reward_std = float(rewards[scored].std()) if scored.any() else math.nan
        if scored.any():
            advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (rewards[scored].std() + 1e-8)
        prompt = list(group.prompt_ids)
        for i, output in enumerate(group.outputs):
            logprobs = list(output.logprobs)
            if len(logprobs) != len(ids[i]):
                raise RuntimeError(f"request {output.request_id}: {len(logprobs)} log-probabilities for "
                                   f"{len(ids[i])} tokens")  # fmt: skip
            versions = [_policy(v) for _, v in output.weight_versions] or [0]
            oldest = min(versions)
            elapsed = max(time.perf_counter() - group.started, 1e-9)
            self._metric({"cbpause/reward": float(rewards[i]), "cbpause/staleness": float(self.model_version - oldest),
                          "cbpause/versions_spanned": float(len(set(versions))),
                          "cbpause/tokens_per_s": len(ids[i]) / elapsed})  # fmt: skip
            metrics = {"reward": float(rewards[i]), "reward_std": reward_std}
            metrics.update({f"rewards/{name}": float(per_func[k, i]) for k, name in enumerate(self.reward_names)})
            yield RolloutSample(
                prompt=group.row.get("prompt", prompt), completion=completions[i],
                input_ids=np.asarray(prompt + ids[i], dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt) + [1] * len(ids[i]), dtype=np.int64),
                old_log_probs=np.asarray([0.0] * len(prompt) + logprobs, dtype=np.float32),
                advantage=float(advantages[i]), model_version=int(oldest), group_id=group.group_id, metrics=metrics,
            )  # fmt: skip

    def _metric(self, values: dict[str, float]) -> None:
        try:
            self.metrics_queue.put_nowait(values)
        except queue.Full:
            pass  # the trainer stopped draining: metrics are dropped, generation never blocks on them
