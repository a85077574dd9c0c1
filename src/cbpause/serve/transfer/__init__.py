"""A server's weight writes: one driver for every transport (:mod:`cbpause.integrations.transfer`'s interface).

A write route checks its request and makes its transport (which checks the manifest once, before anything moves),
takes ``WriteBegin`` under the lease (``LeaseTable.write_weights``), and hands the transport to :func:`write`, which
runs the rest as ``tla/FleetPause.tla`` names it: ``Received`` at the first tensor delivered by a transfer (until
then the model is untouched: R-STAGED-TRANSFER), each tensor copied by the one sink
(:class:`~cbpause.integrations.transfer.ModelWriter`, under the table's ``copying``, cut at the write's deadline),
then ``WriteEnd`` (the version set), or ``WriteFail``, the weights labelled partial and torn if any tensor was copied
(R-TORN-HOLD).  One file per transport: :mod:`.disk` (safetensors files), :mod:`.broadcast` (a weight-update group
over torch.distributed), :mod:`.cuda_ipc` (designed, not built).
"""

from __future__ import annotations

from typing import Any

from ...integrations.transfer import CopyFailed, ModelWriter, TransferFailed, Transport
from ..leases import LeaseGone, LeaseTable

__all__ = ["CopyFailed", "TransferFailed", "WriteFailed", "write"]


class WriteFailed(RuntimeError):
    """A write that failed after ``WriteBegin``: ``cause`` is why (:class:`CopyFailed`, :class:`TransferFailed`, or
    the transport's own refusal); ``copied`` tensors reached the model, and ``torn`` says whether the weights are a
    mix now (labelled partial, generation refused until a complete update)."""

    def __init__(self, cause: BaseException, copied: int, torn: bool) -> None:
        state = (f"after {copied} tensors were copied: the weights are torn, labelled PartialSync, and this server "
                 "refuses generation until a complete update") if torn else \
            "before any tensor was copied: the weights are as they were"  # fmt: skip
        super().__init__(f"{str(cause)[:600]}; the write failed {state}")
        self.cause, self.copied, self.torn = cause, copied, torn


def write(leases: LeaseTable, lease: Any, manager: Any, transport: Transport, new: Any,
          seconds: float | None = None) -> int:  # fmt: skip
    """The write under way under ``lease`` (its ``WriteBegin`` taken): ``transport``'s tensors into the model, then
    ``WriteEnd`` with the version ``new``; returns how many tensors were copied.  ``seconds``: each tensor delivered or
    copied pushes the write's deadline that far on (a transfer that progresses never loses its lease).
    ``LeaseGone`` if the write was cut at its deadline (the cut labelled the weights), :class:`WriteFailed` otherwise
    (``WriteFail``, labelled and torn if a tensor was copied)."""
    from ...integrations.weights import PartialSync

    def progress() -> None:
        if seconds is not None:
            leases.progress(lease, seconds)

    def alive() -> bool:
        progress()
        return not lease.cut

    writer = ModelWriter(manager.model, alive, leases.copying, total=getattr(transport, "total", None))

    def load(name: str, tensor: Any) -> None:
        if writer.copied == 0 and lease.staging:
            leases.received(lease)  # LeaseGone if the write was cut first: nothing copied, nothing taken
        writer.load(name, tensor)

    try:
        transport.receive(load, progress)
    except BaseException as error:
        if lease.cut:  # the cut labelled (and tore) the weights, or left them whole if nothing was copied
            raise LeaseGone(lease) from error
        torn = writer.copied > 0
        leases.fail_write(lease, (lambda: manager.set_weight_version(PartialSync(new))) if torn else None)
        if not isinstance(error, Exception):
            raise
        raise WriteFailed(error, writer.copied, torn) from error
    leases.commit_write(lease, lambda: manager.set_weight_version(new))  # LeaseGone if the write was cut
    return writer.copied

