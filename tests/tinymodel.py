"""A tiny random Llama (no download) and a forward pre-hook probe, shared by the transformers tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

WAIT = 30.0
MAX_NEW = 24
PROMPT = [1, 2, 3, 4, 5]


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip


def tiny_llama(device: str = "cpu", seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config()).to(device).eval()


def gen_config(max_new: int = MAX_NEW) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(**overrides) -> ContinuousBatchingConfig:
    # The cache must hold every prompt plus its max_new_tokens, or the loop dies at start (DESIGN.md).
    kw = dict(use_cuda_graph=False, use_async_batching=False, num_blocks=128, page_size=16, max_batch_tokens=256)
    kw.update(overrides)
    return ContinuousBatchingConfig(**kw)


class Probe:
    """Forward pre-hook: exclusion check, a gate to hold one forward step, and fault injection.

    ``inside`` is counted in and out by the tests' holders; a forward step that starts while it is positive
    breaks R-EXCLUSION and is counted in ``violations``.
    """

    def __init__(self):
        self.inside = 0
        self.violations = 0
        self.forwards = 0
        self.hold: tuple[threading.Event, threading.Event] | None = None  # (reached, release)
        self.fail_with: BaseException | None = None

    def __call__(self, module, args, kwargs):
        self.forwards += 1
        if self.inside:
            self.violations += 1
        if self.hold is not None:
            reached, release = self.hold
            self.hold = None
            reached.set()
            release.wait(WAIT)
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error


@contextmanager
def probed(manager, model, stop_timeout: float = WAIT) -> Iterator:
    """``manager`` with a :class:`Probe` on ``model`` as ``manager.probe``; unhooked, and stopped if still
    running, on exit."""
    probe = Probe()
    handle = model.register_forward_pre_hook(probe, with_kwargs=True)
    manager.probe = probe
    try:
        yield manager
    finally:
        handle.remove()
        if manager.is_running():
            manager.stop(block=True, timeout=stop_timeout)
