"""Weights through CUDA IPC, a transport (:mod:`cbpause.integrations.transfer`): designed, not built.

A trainer and a server that share one GPU need not send the weights through a network stack: the trainer packs each
bucket on its GPU (:mod:`cbpause.client.buckets`, the layout of the broadcast), and sends the server, under its lease,
the bucket's header and a CUDA IPC handle of its buffer with the device's UUID; the server refuses a handle of another
device, opens it, checks the header and the checksum on the GPU, and delivers the bucket's tensors as the broadcast
does.  docs/serving.md, "Weights through CUDA IPC", has the design, to be built and checked where a GPU is lent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CudaIpc"]


class CudaIpc:
    """The transport's place: making one raises ``NotImplementedError`` (a route that offers it answers 501)."""

    staged = False

    def __init__(self, *_: Any, **__: Any) -> None:
        raise NotImplementedError("weights through CUDA IPC are designed (docs/serving.md), not built: send them by "
                                  "broadcast (POST /update_weights_from_distributed) or from disk")

    def receive(self, load: Any, progress: Any = None) -> None:  # pragma: no cover -- never made
        raise NotImplementedError
