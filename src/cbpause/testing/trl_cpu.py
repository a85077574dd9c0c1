"""TEST-ONLY: TRL 1.16's ``AsyncGRPOTrainer`` on a CPU-only torch, and a tiny model and tokenizer it can load.

Two things stop the trainer without CUDA, both outside cbpause (``docs/trl.md``): its ``__init__`` estimates the MFU
with ``torch.cuda.get_device_name`` (``trl.trainer.utils.get_peak_flops_per_device``), and its packed "tree"
attention loads a flash-attention-3 kernel from the Hub at the first loss (``packing._flash_attn``).
:func:`trl_on_cpu` replaces both, for the duration of a ``with`` block, by what a CPU can run: no MFU estimate, and
a pure-torch variable-length attention (SDPA per segment, the causal mask aligned bottom-right, as flash-attention's
``causal=True`` is) that gives the kernel's losses.  Not for training on a GPU: there, TRL's own code runs.

Needs the ``trl`` extra.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from .threads import HANG_S

__all__ = [
    "TARGET", "save_tiny_policy", "target_reward", "tiny_task", "tiny_tokenizer", "trl_on_cpu", "varlen_attention",
]  # fmt: skip


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                     softmax_scale=None, causal=True, window_size=(-1, -1), **_: Any) -> torch.Tensor:  # fmt: skip
    """flash-attention's ``flash_attn_varlen_func`` in plain torch: ``q`` is ``[Tq, H, D]``, ``k`` and ``v`` are
    ``[Tk, Hkv, D]`` (grouped-query heads repeated); segment ``i`` of ``q`` attends to segment ``i`` of ``k``, its last
    query to the last key (bottom-right causal alignment).  A sliding window is refused (the tiny models have none)."""
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("varlen_attention: no sliding window on the CPU path")
    repeat = q.shape[1] // k.shape[1]
    pieces = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]), int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        qi = q[qs:qe].transpose(0, 1)
        ki = k[ks:ke].transpose(0, 1).repeat_interleave(repeat, 0)
        vi = v[ks:ke].transpose(0, 1).repeat_interleave(repeat, 0)
        mask = None
        if causal:
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(diagonal=(ke - ks) - (qe - qs))
        pieces.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale).transpose(0, 1))
    return torch.cat(pieces, 0)


@contextmanager
def trl_on_cpu() -> Iterator[None]:
    """Within the block, TRL's ``AsyncGRPOTrainer`` builds and trains without CUDA (see the module); undone after."""
    # TRL's internals this kit patches to train on a CPU (the testing kit may not import the integration, whose
    # module is the home of TRL's experimental names otherwise).
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    saved = async_grpo_trainer.get_peak_flops_per_device, packing._flash_attn
    kernel = SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    packing._flash_attn = lambda: kernel
    try:
        yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device, packing._flash_attn = saved


PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
# The tiny tokenizer's chat template: the messages' contents, one after the other (no role words: every word is a token
# of the tiny vocabulary), then <pad> where the answer starts; and its response template, which TRL's rollout worker
# reads an answer with (transformers' response parsing: the answer's text after the <pad> of the prompt).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<pad>{% endif %}")
RESPONSE_TEMPLATE = {"defaults": {"role": "assistant"}, "start_anchor": PAD, "fields": {"content": {"content": "text"}}}


def tiny_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer built in memory (no download): ids 0, 1, 2 are ``<pad>``, ``<eos>``, ``<unk>``, id
    ``i >= 3`` is the word ``t<i>``; text is words separated by spaces; its chat template is :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, UNK: 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    tokenizer.chat_template, tokenizer.response_template = CHAT_TEMPLATE, dict(RESPONSE_TEMPLATE)
    return tokenizer


def save_tiny_policy(path: Path, vocab_size: int = 16, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Llama (:func:`cbpause.testing.tiny_llama`) and :func:`tiny_tokenizer` to ``path``, as a
    model directory ``AsyncGRPOTrainer(model=str(path))`` loads; its generation config has no end-of-sequence token
    (every completion is ``max_new_tokens`` long).  It takes 4096 positions (a served request may be that long; the
    weights are those of :func:`cbpause.testing.tiny_llama` of the same seed).  Returns ``path``."""
    from transformers import GenerationConfig

    from .llama import tiny_llama

    model = tiny_llama(seed=seed, vocab_size=vocab_size, **{"max_position_embeddings": 4096, **overrides})
    model.generation_config = GenerationConfig(eos_token_id=-1, pad_token_id=0)
    model.save_pretrained(path)
    tiny_tokenizer(vocab_size).save_pretrained(path)
    return Path(path)


TARGET = 5  # the token the tiny task's reward counts (chance: 1 in 16)


def chat_dataset(n: int = 16) -> Any:
    """The tiny task's prompts as TRL's own rollout worker reads them: a column ``prompt`` of one user message each
    (the words of :func:`tiny_task`'s ``prompt_ids``), which it renders with the tokenizer's chat template."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"t{3 + i % 5} t{4 + i % 3} t9"}]
                                         for i in range(n)]})  # fmt: skip


def target_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The tiny task's reward (TRL's reward-function signature): the share of :data:`TARGET` among the tokens."""
    return [sum(token == TARGET for token in ids) / max(len(ids), 1) for ids in completion_ids]


def tiny_task(path: Path, *, steps: int, num_generations: int = 8, max_new_tokens: int = 8, learning_rate: float = 1e-2,
              max_staleness: int = 4, seed: int = 0, **config: Any) -> SimpleNamespace:  # fmt: skip
    """What a tiny GRPO run on the CPU needs, TRL's side only (no cbpause): ``model_dir`` (a policy saved under
    ``path``), ``tokenizer``, ``dataset`` (16 prompts of 3 token ids, column ``prompt_ids``), ``reward``
    (:func:`target_reward`), ``args`` (an ``AsyncGRPOConfig`` of ``steps`` optimizer steps of one group each, on the
    CPU; ``config`` overrides fields), and the engine's ``generation_config`` and ``batching_config`` (sampling at the
    trainer's temperature, log-probabilities returned)."""
    from datasets import Dataset
    from transformers import GenerationConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from .llama import batching_config

    model_dir = save_tiny_policy(Path(path) / "policy", seed=seed)
    fields = dict(
        output_dir=str(Path(path) / "out"), max_steps=steps, per_device_train_batch_size=num_generations,
        num_generations=num_generations, max_completion_length=max_new_tokens, learning_rate=learning_rate,
        token_budget=0, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
        max_staleness=max_staleness, heartbeat_stale_after_s=HANG_S, temperature=1.0, dtype="float32", seed=seed,
        disable_tqdm=True,
    )  # fmt: skip
    fields.update(config)
    return SimpleNamespace(
        model_dir=model_dir,
        tokenizer=tiny_tokenizer(16),
        dataset=Dataset.from_dict({"prompt_ids": [[3 + i % 5, 4 + i % 3, 9] for i in range(16)]}),
        reward=target_reward,
        args=AsyncGRPOConfig(**fields),
        generation_config=GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0,
                                           top_p=1.0, eos_token_id=-1, pad_token_id=0),  # fmt: skip
        batching_config=batching_config(return_logprobs=True),
        max_new_tokens=max_new_tokens,
        num_generations=num_generations,
    )
