"""A weight-update group: the trainer and the servers in a torch.distributed group of their own (issue 42, first step).

The trainer is rank 0 and broadcasts each tensor of an update; the servers are ranks 1..N and receive them.  The group
is a ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) built on a ``TCPStore`` of its own, not through
``torch.distributed.init_process_group``: the default group stays free for the engine's tensor-parallel ranks, and a
server can join, leave and join again another trainer's group.  Every collective has a deadline (``timeout_s``), and a
peer that dies ends the others' broadcast with an error, not a hang.

Decision (to be stated in the spec with the routes): a server receives every tensor of an update into buffers of its
own (staging) before it copies any into the model, so that a transfer that fails half-way leaves the old weights
intact, never a mix.  It costs one more copy of the tensors sent, for the time of the update (the model's size for a
full update).  :func:`check_manifest` checks an update's names, dtypes and shapes against the model before the
server enters any collective, so that a refused update is a 4xx and the server never blocks in a broadcast nobody
sends.

Not wired to routes yet: ``/init_weights_update_group``, ``/update_weights_from_distributed`` and the fleet's side
come with the FleetPause transition of the broadcast write.
"""

from __future__ import annotations

import datetime
from typing import Any

__all__ = ["BACKENDS", "WeightGroup", "check_manifest", "dtype_of"]

BACKENDS = ("gloo", "nccl")


def dtype_of(name: Any) -> Any:
    """The torch dtype a manifest names as ``weight_info`` writes it (``"float32"``, ``"bfloat16"``), or
    ``ValueError``."""
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype (as /weight_info names them: 'float32', 'bfloat16', ...)")
    return dtype


def check_manifest(model: Any, names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, tuple[int, ...], Any]]:
    """An update's tensors, ``(model's name, shape, dtype)`` in the order they will be broadcast, each checked against
    the model's own tensor; ``ValueError`` naming every tensor refused, before anything is received."""
    from ..integrations.weights import engine_name

    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not names or not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names, dtypes and shapes must be as long as each other, and not empty: {len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}")  # fmt: skip
    own = dict(model.state_dict(keep_vars=True))
    refused, manifest, seen = [], [], set()
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if not isinstance(name, str) or (target := own.get(engine_name(name))) is None:
            refused.append(f"{name!r}: the model has no such tensor")
            continue
        if engine_name(name) in seen:
            refused.append(f"{name!r}: its tensor is named twice")
            continue
        seen.add(engine_name(name))
        if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            refused.append(f"{name!r}: shape {shape!r} is not a list of integers")
            continue
        try:
            torch_dtype = dtype_of(dtype)
        except ValueError as error:
            refused.append(f"{name!r}: {error}")
            continue
        if tuple(shape) != tuple(target.shape) or torch_dtype != target.dtype:
            refused.append(f"{name!r} is {tuple(shape)} {dtype}; the model's is {tuple(target.shape)} "
                           f"{str(target.dtype).removeprefix('torch.')}")  # fmt: skip
            continue
        manifest.append((engine_name(name), tuple(shape), torch_dtype))
    if refused:
        raise ValueError(f"refused before any transfer: {'; '.join(refused[:8])}"
                         + (f"; and {len(refused) - 8} more" if len(refused) > 8 else ""))  # fmt: skip
    return manifest


class WeightGroup:
    """Rank ``rank`` of a group of ``world_size`` (rank 0: the trainer, which also serves the group's store at
    ``master_address:master_port``).  Building it waits until every rank has joined, for at most ``timeout_s``;
    each broadcast after it too."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 group_name: str = "cbpause", backend: str = "gloo", timeout_s: float = 60.0) -> None:  # fmt: skip
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size and world_size > 1):
            raise ValueError(f"rank {rank!r} of world_size {world_size!r}: 0 <= rank < world_size, world_size >= 2")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], not {timeout_s!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                    timeout=self.timeout)  # fmt: skip
        store = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:  # pragma: no cover -- needs GPUs on two processes
            self._group = dist.ProcessGroupNCCL(store, rank, world_size)
        self.device = "cpu" if backend == "gloo" else "cuda"

    def send(self, tensors: list[Any]) -> None:
        """Rank 0: broadcast each tensor, in the order of the receivers' manifest."""
        for tensor in tensors:
            self._group.broadcast(tensor.detach().contiguous().to(self.device), 0, self.timeout).wait()

    def receive(self, manifest: list[tuple[str, tuple[int, ...], Any]]) -> dict[str, Any]:
        """A receiving rank: every tensor of ``manifest`` (:func:`check_manifest`), each into a buffer of its own
        (staging); ``RuntimeError`` if a peer leaves or a broadcast passes the deadline, with nothing returned."""
        import torch

        received = {}
        for name, shape, dtype in manifest:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._group.broadcast(buffer, 0, self.timeout).wait()
            received[name] = buffer
        return received

    def destroy(self) -> None:
        """Leave the group (its store's connection closes with it)."""
        self._group, self._store = None, None
