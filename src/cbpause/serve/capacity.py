"""How much memory the KV cache of ``cbpause serve`` takes, and how long a request may be (``--num-blocks``,
``--max-model-len``; docs/serving.md "Memory").

Decision: on the CPU, the cache is sized from the model and ``max_model_len``, not from the machine.  transformers
sizes a cache it is given no ``num_blocks`` for at a share of the device's free memory; on a GPU that is the device
the server owns, but on the CPU it is the machine's RAM, which other processes share (a 2-layer toy model took 14.6
GB, and a second server on the same machine got the first killed by the kernel).  So on the CPU the default cache
holds :data:`CPU_SEQUENCES` sequences of ``max_model_len`` tokens, and at most :data:`CPU_KV_BYTES`; on a GPU it is
transformers' choice.  ``max_model_len`` (prompt plus answer) is ``--max-model-len``, else the model's
``max_position_embeddings``, and never more than one request can hold in the cache: a default is lowered to it, an
asked length that does not fit is refused at start.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["CPU_KV_BYTES", "CPU_SEQUENCES", "CacheSize", "cpu_default_blocks", "kv_bytes_per_token",
           "model_max_len", "resolve_max_model_len"]  # fmt: skip

CPU_SEQUENCES = 8  # full-length sequences the default CPU cache holds
CPU_KV_BYTES = 1 << 30  # and its most bytes (1 GiB)


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_bytes_per_token(config: Any, dtype: Any) -> int:
    """The bytes one token's keys and values take in every layer of a model of ``config`` in ``dtype`` (a
    ``torch.dtype``): 2 x layers x key-value heads x head size x the dtype's size."""
    text = _text(config)
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def model_max_len(config: Any) -> int | None:
    """The longest sequence the model was made for (``max_position_embeddings``), or None."""
    value = getattr(_text(config), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def cpu_default_blocks(config: Any, dtype: Any, page_size: int, max_model_len: int | None) -> int:
    """The KV blocks of ``page_size`` tokens a CPU server holds by default: :data:`CPU_SEQUENCES` sequences of
    ``max_model_len`` tokens (the model's length when None), within :data:`CPU_KV_BYTES`, and at least one block."""
    length = max_model_len or model_max_len(config) or 2048
    per_block = kv_bytes_per_token(config, dtype) * page_size
    wanted = math.ceil(CPU_SEQUENCES * length / page_size)
    return max(1, min(wanted, CPU_KV_BYTES // per_block))


def resolve_max_model_len(asked: int | None, config: Any, per_request: int) -> int:
    """The server's ``max_model_len``: ``asked`` (``--max-model-len``), else the model's length, never more than
    ``per_request`` (the tokens one request can hold in the cache): a default is lowered to it; an asked length
    longer than either is a ``ValueError`` that says what to change."""
    limit = model_max_len(config)
    if asked is not None:
        if limit is not None and asked > limit:
            raise ValueError(f"--max-model-len {asked} is longer than the model's max_position_embeddings ({limit})")
        if asked > per_request:
            raise ValueError(f"--max-model-len {asked} does not fit the KV cache, which holds {per_request} tokens per "
                             "request: raise --num-blocks, or lower --max-model-len")  # fmt: skip
        return asked
    return min(limit, per_request) if limit is not None else per_request


@dataclass(frozen=True)
class CacheSize:
    """What the server's start-up line says of its cache: blocks, tokens per block, bytes, on which device, and the
    tokens one request can hold."""

    blocks: int
    page_size: int
    bytes: int
    device: str
    per_request: int

    def describe(self, max_model_len: int) -> str:
        tokens = self.blocks * self.page_size
        return (f"KV cache: {self.blocks} blocks of {self.page_size} tokens ({tokens} tokens, "
                f"{self.bytes / 2**20:.1f} MiB on {self.device}); max_model_len {max_model_len} "
                f"({tokens // max(max_model_len, 1)} full-length sequences at once)")  # fmt: skip
