"""One interface for every way weights arrive: a transport checks its manifest once, then hands over each tensor.

vLLM's ``WeightTransferEngine`` is the model (one interface, one file per transport): whatever carries the bytes (the
trainer's own process, safetensors files on disk, a broadcast over torch.distributed, CUDA IPC handles), a
:class:`Transport`

* checks what it will deliver against the model when it is made, before anything is read or moved (every name, shape
  and dtype through :func:`~.manifest.entry`, the one home of that check): a refusal raises ``ValueError`` with the
  model untouched;
* then, under the pause, delivers every tensor to ``load(name, tensor)`` (the model's own name; the tensor is valid
  until ``load`` returns), calling ``progress()`` as it moves on; it raises :class:`TransferFailed` when it fails,
  after delivering some tensors or none;
* says whether it holds the whole update before its first delivery (``staged``): a failure before then leaves the
  model untouched, whatever the transport.

The one sink is :class:`ModelWriter`, which copies each tensor into the model in place (a tensor-parallel engine's
parameter takes its shard of it, :func:`copy_whole_or_shard`).  The driver that puts a transport under a pause's write
is the caller's: :class:`~.trl.PauseWeightSync` in the trainer's process (its tensors: :class:`InProcess`), and
``cbpause.serve.transfer`` in a server, which adds the lease table's steps (``Received`` at the first delivery of a
staged write, ``WriteEnd``, ``WriteFail`` and the torn weights: spec/PROTOCOL.md R-TORN-HOLD).  The server's
transports are ``cbpause.serve.transfer.disk``, ``.broadcast`` and ``.cuda_ipc`` (designed, not built).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from .manifest import entry, model_tensors

__all__ = ["CopyFailed", "InProcess", "ModelWriter", "TransferFailed", "Transport", "copy_whole_or_shard"]

Load = Callable[[str, Any], None]


class TransferFailed(RuntimeError):
    """The transport failed (a peer lost, a deadline passed, bytes that are not the manifest's, a file unreadable):
    what it delivered before stands, and the caller labels it."""


class CopyFailed(RuntimeError):
    """The copy into the model stopped half-way (``copied`` tensors of ``total`` were copied): the weights are a
    mix if ``copied``, which the caller labels (``PartialSync``)."""

    def __init__(self, copied: int, total: int | None, why: str) -> None:
        super().__init__(f"the copy of the weights stopped after {copied} of {total or 'the'} tensors: {why}")
        self.copied, self.total = copied, total


class Transport(Protocol):
    """See the module."""

    staged: bool

    def receive(self, load: Load, progress: Callable[[], None] | None = None) -> None: ...


class ModelWriter:
    """Copies checked tensors into the model one at a time, in place (the caller holds a pause): what every transport
    delivers to.  ``alive()`` is asked before each tensor, and the tensor copied, under ``lock`` (a server's lease
    table's ``copying``): once it says no (the write was cut at its deadline), nothing more is copied, and a tensor
    under way when the next write began lands before that write's own.  :meth:`load` raises :class:`CopyFailed` when
    it stops, for that or any other reason."""

    def __init__(self, model: Any, alive: Callable[[], bool] | None = None, lock: Any = None,
                 total: int | None = None) -> None:  # fmt: skip
        self._own = model_tensors(model)
        self._alive, self._lock, self.total = alive, lock, total
        self.copied = 0

    def load(self, name: str, tensor: Any) -> None:
        import torch

        with torch.no_grad(), self._lock if self._lock is not None else contextlib.nullcontext():
            if self._alive is not None and not self._alive():
                raise CopyFailed(self.copied, self.total, "the write passed its deadline and was cut off")
            try:
                copy_whole_or_shard(self._own[name], tensor)
            except Exception as error:  # noqa: BLE001 -- reported with how far the copy went
                raise CopyFailed(self.copied, self.total, f"{type(error).__name__}: {error}") from error
        self.copied += 1


def copy_whole_or_shard(target: Any, tensor: Any) -> None:
    """Copy the whole tensor ``tensor`` into ``target``, in place: all of it, or, where ``target`` is a ``DTensor`` (a
    parameter of a tensor-parallel engine, whose shape is the whole tensor's), this rank's shard of it, cut by the
    target's own placements on this rank, with no collective (``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        whole = tensor.to(target.to_local().device)
        target.to_local().copy_(distribute_tensor(whole, target.device_mesh, target.placements,
                                                  src_data_rank=None).to_local())  # fmt: skip
    else:
        target.copy_(tensor.to(target.device))


class InProcess:
    """The trainer's own tensors, in its process (TRL's ``send_weights`` iterator): ``(name, tensor)`` pairs in the
    trainer's names.  An iterator has no manifest ahead of it (a sharded trainer gathers each parameter as it is
    asked for: holding them all would cost the model's size), so each pair is checked as it comes, by the same
    :func:`~.manifest.entry`, before it is delivered, and a tensor named twice (whatever the wrapper's prefix) or a
    value that is not a tensor is refused too; a refusal raises its ``ValueError`` (or ``KeyError``) there, after the
    tensors before it."""

    staged = False

    def __init__(self, model: Any, pairs: Iterable[tuple[str, Any]]) -> None:
        self._own, self._pairs = model_tensors(model), pairs

    def receive(self, load: Load, progress: Callable[[], None] | None = None) -> None:
        import torch

        seen: set[str] = set()
        for name, tensor in self._pairs:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name!r}: not a tensor but a {type(tensor).__name__}"[:200])
            own_name = entry(self._own, name, tuple(tensor.shape), tensor.dtype).name
            if own_name in seen:
                raise ValueError(f"{name!r}: its tensor is named twice in this update")
            seen.add(own_name)
            load(own_name, tensor)
            if progress is not None:
                progress()
