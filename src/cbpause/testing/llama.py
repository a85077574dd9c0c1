"""A tiny random Llama built from a config (no download), its generation and batching configs, and a probe.

Needs the ``transformers`` extra (torch and transformers 5.23-5.25).  The tests, the benchmark, the soak and the
demo all build their model here, so that "the tiny model" is one model, sized by keyword where a use needs
more (the benchmark's is wider).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from .threads import HANG_S, JOIN_TIMEOUT, enter_and_leave, run_thread

__all__ = [
    "PAGE_SIZE",
    "ForwardProbe",
    "batching_config",
    "cache_blocks",
    "greedy_config",
    "greedy_reference",
    "pending_pause",
    "probed",
    "random_sampling",
    "tiny_llama",
    "tiny_llama_config",
]

PAGE_SIZE = 16


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A 2-layer, 64-wide Llama config (vocabulary 128, 512 positions); keywords override any field."""
    fields = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(device: str = "cpu", seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    """A random :func:`tiny_llama_config` model on ``device``, in eval mode, the same for the same seed."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).to(device).eval()


def greedy_config(max_new_tokens: int) -> GenerationConfig:
    """Greedy decoding, no end-of-sequence token: every request generates exactly ``max_new_tokens``."""
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def random_sampling(rng: Any) -> dict[str, Any]:
    """A request's sampling arguments (those of ``cbpause.integrations.sampling.SamplingParams``) drawn from ``rng`` (a
    ``random.Random``), as RL rollout clients mix them: greedy or sampled, filters, a penalty, a seed, top
    log-probabilities."""
    return {"temperature": rng.choice([0.0, 0.7, 1.0, 1.3]), "top_p": rng.choice([1.0, 0.9]),
            "top_k": rng.choice([0, 5]), "min_p": rng.choice([0.0, 0.05]), "repetition_penalty": rng.choice([1.0, 1.2]),
            "seed": rng.randrange(2**32), "logprobs": rng.randrange(0, 4)}  # fmt: skip


def greedy_reference(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens greedy decoding appends to ``prompt`` outside the loop, with no end-of-sequence token.

    Not ``model.generate``: it stops at the model config's end-of-sequence token (2 for a ``LlamaConfig``),
    which :func:`greedy_config` turns off for the loop, so the two disagreed on every prompt whose greedy
    continuation holds a 2 (a prompt built from the loop's own output, whose split between old and new weights
    depends on timing, hit one in CI).  ``generate`` refuses ``eos_token_id=-1`` with a warning; this is its
    greedy loop, the KV cache included, without the stop.
    """
    tokens = torch.tensor([prompt], device=model.device)
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(n):
            step = model(tokens, past_key_values=past, use_cache=True)
            past = step.past_key_values
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            tokens = torch.tensor([[token]], device=model.device)
    return out


def cache_blocks(requests: int, tokens: int, spare: int = 16) -> int:
    """KV-cache blocks for ``requests`` requests of up to ``tokens`` tokens each (prompt plus new tokens).

    The cache must hold every prompt plus its ``max_new_tokens``, or the loop dies at start ("Tried to
    perform a generation step before the batch processor was initialized").
    """
    return requests * -(-tokens // PAGE_SIZE) + spare


def batching_config(**overrides: Any) -> ContinuousBatchingConfig:
    """transformers' continuous batching as the CPU runs it best: no CUDA graphs, no async batching."""
    fields = dict(
        use_cuda_graph=False, use_async_batching=False, num_blocks=128, page_size=PAGE_SIZE, max_batch_tokens=256
    )
    fields.update(overrides)
    return ContinuousBatchingConfig(**fields)


class ForwardProbe:
    """A forward pre-hook that sees every forward step of a model.

    It counts and times the steps (and waits for them), checks R-EXCLUSION (``inside`` is counted in and out
    by the caller's holders; a step that starts while it is positive is a violation), and can act on the
    next step: hold it until released (:meth:`hold_next`), make it raise (``fail_with``), or run a callable
    on the loop's own thread (``call_next``).
    """

    def __init__(self) -> None:
        self.forwards = 0
        self.times: list[float] = []
        self.inside = 0
        self.violations = 0
        self.hold: tuple[threading.Event, threading.Event] | None = None  # (reached, release)
        self.fail_with: BaseException | None = None
        self.call_next: Callable[[], object] | None = None
        self._stepped = threading.Condition()

    def __call__(self, module: Any, args: Any, kwargs: Any = None) -> None:
        now = time.perf_counter()
        with self._stepped:
            self.forwards += 1
            self.times.append(now)
            if self.inside:
                self.violations += 1
            self._stepped.notify_all()
        if self.call_next is not None:
            fn, self.call_next = self.call_next, None
            fn()
        if self.hold is not None:
            reached, release = self.hold
            self.hold = None
            reached.set()
            release.wait(HANG_S)  # held until the test releases it: a bound on a hang only
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error

    def attach(self, model: torch.nn.Module) -> Any:
        """Hook onto ``model``; returns the handle (``.remove()`` unhooks)."""
        return model.register_forward_pre_hook(self, with_kwargs=True)

    def hold_next(self) -> tuple[threading.Event, threading.Event]:
        """Hold the next forward step: ``(reached, release)``; set ``release`` to let it go on."""
        self.hold = (threading.Event(), threading.Event())
        return self.hold

    def wait_until(self, forwards: int, timeout: float) -> bool:
        """Wait until ``forwards`` steps have started in all (False after ``timeout`` seconds)."""
        with self._stepped:
            return self._stepped.wait_for(lambda: self.forwards >= forwards, timeout)

    def wait_steps(self, n: int, timeout: float) -> bool:
        """Wait for ``n`` more steps to start."""
        return self.wait_until(self.forwards + n, timeout)

    def first_after(self, t: float, timeout: float) -> float:
        """The start of the first forward step after ``t`` (waits for it)."""
        with self._stepped:
            if not self._stepped.wait_for(lambda: bool(self.times) and self.times[-1] > t, timeout):
                raise TimeoutError(f"no forward step within {timeout} s")
            return self.times[bisect.bisect_right(self.times, t)]

    def step_times(self, n: int, timeout: float) -> list[float]:
        """Times between consecutive forward starts over the next ``n`` steps of a busy loop: one whole
        iteration each (the forward step, the batch update, the next batch's preparation)."""
        start = self.forwards
        self.wait_steps(n, timeout)
        xs = self.times[start : start + n]
        return [b - a for a, b in zip(xs, xs[1:], strict=False)]


def pending_pause(manager: Any, probe: ForwardProbe, timeout: float) -> tuple[threading.Event, threading.Thread, dict]:
    """Hold ``manager``'s loop in its next forward step and start a ``pause()`` on another thread, which then
    waits: returns once its request is in, with the step's release event, the thread, and its box (``error``
    when the pause raised).  The caller may arm the probe (``fail_with``) before it releases the step.
    """
    reached, release = probe.hold_next()
    if not reached.wait(timeout):
        raise TimeoutError(f"the loop ran no forward step within {timeout} s")
    manager._wake_up_loop.clear()  # pause() sets it once its request is in; the held loop does not touch it
    thread, box = run_thread(lambda: enter_and_leave(manager.pause()), name="pending-pause")
    if not manager._wake_up_loop.wait(timeout):
        raise TimeoutError(f"the pause did not ask within {timeout} s")
    return release, thread, box


@contextmanager
def probed(manager: Any, model: torch.nn.Module, stop_timeout: float = JOIN_TIMEOUT) -> Iterator[Any]:
    """``manager`` with a :class:`ForwardProbe` on ``model`` as ``manager.probe``; unhooked, and stopped if still
    running, on exit."""
    probe = ForwardProbe()
    handle = probe.attach(model)
    manager.probe = probe
    try:
        yield manager
    finally:
        handle.remove()
        if manager.is_running():
            manager.stop(block=True, timeout=stop_timeout)
