"""Packed buckets: an update's tensors laid out in fixed-size byte buffers, one collective each, every one checked.

Both ends derive the same layout from the manifest alone (names, shapes and dtypes in the order sent) and the
``bucket_bytes`` the request names, before the first byte moves: tensors in manifest order, each at an offset aligned
to :data:`ALIGN` bytes, a bucket closed when the next tensor would take it past ``bucket_bytes``; a tensor larger than
that has a bucket of its own (a tensor is never split, so that a receiver can hand each one whole to a
tensor-parallel shard).  On the wire a bucket is two broadcasts from rank 0: its header, :data:`HEADER_WORDS`
64-bit integers (``MAGIC``, the bucket's index, its length, its checksum), then its bytes.  A receiver checks the
header against its own layout and the checksum against the bytes that arrived, before it uses any of them.

The checksum is the sum of the bucket's 64-bit words modulo 2**64.  It is there against a sender whose bytes are not
its manifest's (a short tensor, another dtype, a bucket left out), not against a forger: the lease holder is trusted
to send the weights it means.  A receiver fills its buffer with ones before each bucket, so that the words a short
sender never sent count as -1 each and the sum cannot match by leaving them out.

The wire protocol both ends speak, so it lives with the client, and imports nothing but torch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["ALIGN", "DEFAULT_BUCKET_BYTES", "HEADER_WORDS", "MAGIC", "Bucket", "Slot", "aligned", "checksum",
           "header", "layout", "pack", "refusal", "tensor_bytes", "unpack"]

ALIGN = 16  # every tensor's offset in its bucket: a view of any dtype (complex128 included) is aligned
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024  # two of them staged: 128 MiB, a small share of any model worth a broadcast
MAX_BUCKET_BYTES = 4 * 1024 * 1024 * 1024
MIN_BUCKET_BYTES = 1024
HEADER_WORDS = 4
MAGIC = 0x63627061757365  # "cbpause": a header of another protocol (a stock trainer's tensor) is not taken for one


class Slot(NamedTuple):
    """One tensor's place in its bucket."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: Any


class Bucket(NamedTuple):
    """A bucket: its index in the update, its slots, and its length in bytes (a multiple of :data:`ALIGN`)."""

    index: int
    slots: tuple[Slot, ...]
    nbytes: int


def aligned(n: int) -> int:
    """``n`` bytes rounded up to :data:`ALIGN`: where the next slot may start."""
    return -(-n // ALIGN) * ALIGN


def tensor_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


def layout(manifest: list[tuple[str, tuple[int, ...], Any]], bucket_bytes: int) -> list[Bucket]:
    """The buckets of an update whose tensors are ``manifest``'s ``(name, shape, dtype)``, in its order."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or \
            not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:  # fmt: skip
        raise ValueError(f"bucket_bytes must be an integer in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}], not "
                         f"{bucket_bytes!r}")  # fmt: skip
    buckets: list[Bucket] = []
    slots: list[Slot] = []
    used = 0
    for name, shape, dtype in manifest:
        nbytes = tensor_bytes(shape, dtype)
        if slots and used + aligned(nbytes) > bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(slots), used))
            slots, used = [], 0
        slots.append(Slot(name, used, nbytes, tuple(shape), dtype))
        used += aligned(nbytes)
    if slots:
        buckets.append(Bucket(len(buckets), tuple(slots), used))
    return buckets


def pack(bucket: Bucket, tensors: list[Any], out: Any = None) -> Any:
    """The bucket's bytes (a ``uint8`` tensor of ``bucket.nbytes``, ``out`` if given), from ``tensors``, one per slot
    in the slot's order, each of the slot's shape and dtype (``ValueError`` otherwise)."""
    import torch

    if len(tensors) != len(bucket.slots):
        raise ValueError(f"bucket {bucket.index} has {len(bucket.slots)} tensors, not {len(tensors)}")
    buffer = torch.zeros(bucket.nbytes, dtype=torch.uint8) if out is None else out[: bucket.nbytes]
    for slot, tensor in zip(bucket.slots, tensors, strict=True):
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"{slot.name!r} is {tuple(tensor.shape)} {tensor.dtype}, its manifest says "
                             f"{slot.shape} {slot.dtype}")  # fmt: skip
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(flat)
        buffer[slot.offset + slot.nbytes : slot.offset + aligned(slot.nbytes)].zero_()
    return buffer


def unpack(bucket: Bucket, buffer: Any) -> list[tuple[str, Any]]:
    """Each slot's tensor, a view of ``buffer`` (no copy): ``(name, tensor)`` in the slot's order."""
    return [(slot.name, buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape))
            for slot in bucket.slots]  # fmt: skip


def checksum(buffer: Any) -> int:
    """The sum of the 64-bit words of ``buffer`` (``uint8``, a length that is a multiple of 8) modulo 2**64, as a
    signed integer (what an ``int64`` header holds)."""
    import torch

    total = int(buffer.view(torch.int64).sum()) if buffer.numel() else 0
    return (total + 2**63) % 2**64 - 2**63


def header(bucket: Bucket, buffer: Any) -> list[int]:
    """The header a sender broadcasts before the bucket's bytes."""
    return [MAGIC, bucket.index, bucket.nbytes, checksum(buffer[: bucket.nbytes])]


def refusal(bucket: Bucket, received: list[int], summed: int) -> str | None:
    """Why a bucket whose header arrived as ``received`` and whose bytes sum to ``summed`` (:func:`checksum`) is not
    the one the layout expects, or None."""
    if len(received) != HEADER_WORDS or received[0] != MAGIC:
        return f"bucket {bucket.index}: its header is not a cbpause bucket's (a sender of another protocol?)"
    if received[1] != bucket.index or received[2] != bucket.nbytes:
        return (f"bucket {bucket.index}: the sender sent bucket {received[1]} of {received[2]} bytes where the "
                f"manifest lays out {bucket.nbytes} bytes")  # fmt: skip
    if received[3] != summed:
        return (f"bucket {bucket.index}: its bytes do not sum to the sender's checksum (a short tensor, another "
                "dtype than the manifest's, or bytes lost)")  # fmt: skip
    return None
