"""Weights by broadcast, a transport (:mod:`cbpause.integrations.transfer`): a weight-update group's buckets.

The group is the server's end of the trainer's torch.distributed group (:class:`~cbpause.serve.receiver.ReceivingGroup`
over gloo, :class:`~cbpause.client.weight_group.WeightGroup` over NCCL), and its wire format is
:mod:`cbpause.client.buckets` (packed, each bucket checked by its header and checksum before a byte is used), or a
stock trainer's one broadcast per tensor.  Its manifest was checked by the route before any collective
(``check_manifest``).  ``staging`` (``cbpause serve --staging``): ``"bounded"`` delivers each bucket's tensors as soon
as the bucket arrived whole and checked, while the next one arrives (two buckets held); ``"full"`` receives every bucket
into buffers of its own, takes the second vote (every member has the whole update), and only then delivers.  In
cbpause's own protocol (``bucket_bytes`` named) the first vote comes before (a refusal anywhere: nothing moves) and
the second after; with bounded staging its outcome changes nothing on a server that received every bucket, which
commits (the trainer hears from each server which did).  Any failure of the group raises
:class:`~cbpause.integrations.transfer.TransferFailed`, a member's refusal :class:`Declined`; the caller drops the
group, whose connections are then in an unknown state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...integrations.transfer import TransferFailed

__all__ = ["STAGINGS", "Broadcast", "Declined"]

# How a server receives an update (R-STAGED-TRANSFER, R-TORN-HOLD): "bounded", each bucket copied into the model as it
# arrives (two buckets held, a transfer torn half-way refused until mended); "full", the whole update staged first (a
# failed transfer leaves the weights as they were, for a copy of the update in memory).
STAGINGS = ("bounded", "full")


class Declined(Exception):
    """The group did not take the update (a member refused it, or did not receive it whole), with the HTTP status
    that says why: nothing was copied."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Broadcast:
    """The update ``manifest`` (checked ``(name, shape, dtype)`` entries, in the order they are sent) over ``group``,
    in buckets of ``bucket_bytes`` (``None``: a stock trainer's one broadcast per tensor, and no vote).
    ``still_writing()`` says whether the write may go on (not cut): the second vote carries it."""

    def __init__(self, group: Any, manifest: list, bucket_bytes: int | None, staging: str,
                 still_writing: Callable[[], bool]) -> None:  # fmt: skip
        if staging not in STAGINGS:
            raise ValueError(f"staging must be one of {list(STAGINGS)}, not {staging!r}")
        self.group, self.manifest, self.bucket_bytes = group, manifest, bucket_bytes
        self.staged, self.total = staging == "full", len(manifest)
        self._voting, self._still = bucket_bytes is not None, still_writing

    def vote(self, ok: bool) -> bool:
        """This member's vote (cbpause's protocol only; True without one): every member's ``ok``."""
        if not self._voting:
            return True
        try:
            return self.group.vote(ok)
        except RuntimeError as error:
            raise TransferFailed(f"the weight-update group's vote failed ({error})") from None

    def receive(self, load: Any, progress: Any = None) -> None:
        if not self.vote(True):
            raise Declined(409, "another member of the weight-update group refused this update: nothing was received")
        try:
            staged = self.group.receive(self.manifest, progress=progress, bucket_bytes=self.bucket_bytes,
                                        load=None if self.staged else load)  # fmt: skip
        except RuntimeError as error:
            if isinstance(error, TransferFailed):
                raise
            raise TransferFailed(f"the transfer failed ({error})") from None
        if not self.staged:
            try:  # the trainer waits for it; its outcome changes nothing here (every bucket is in the model)
                self.vote(self._still())
            except TransferFailed:
                pass
            return
        still = self._still()  # (asked once: the vote and the answer say the same of this member)
        if not self.vote(still):
            raise Declined(409 if still else 410, "the update did not reach every member whole: nothing "
                          "was copied")  # fmt: skip
        for name, tensor in staged.items():
            load(name, tensor)
            if progress is not None:
                progress()
