"""A weight-update group: the trainer and the servers in a torch.distributed group of their own (issue 42).

The trainer is rank 0 and broadcasts each tensor of an update; the servers are ranks 1..N and receive them.  The group
is a ``ProcessGroupGloo`` (or ``ProcessGroupNCCL``) built on a ``TCPStore`` of its own, not through
``torch.distributed.init_process_group``: the default group stays free for the engine's tensor-parallel ranks, and a
server can join, leave and join again another trainer's group.  Every collective has a deadline (``timeout_s``), and a
peer that dies ends the others' broadcast with an error, not a hang.

An update is three collectives, each with the group's deadline (:meth:`WeightGroup.vote`, :meth:`WeightGroup.send`,
:meth:`WeightGroup.receive`): a vote (every member says whether it takes the update: one refusal and nobody receives
anything, at once), the tensors, and a second vote (every member received all of them): a member copies into its
model only once every member has the whole update, so a transfer that fails anywhere leaves every server's weights as
they were (but for the last message of that vote, which may reach one member and not another: two generals; the fleet
then reports which took it).  That holds for servers that stage the whole update first (``cbpause serve --staging
full``: one more copy of the tensors sent, for the time of the update); by default a server copies each bucket into
its model as it arrives, and one that fails after its first bucket is left torn and refusing (R-TORN-HOLD).

The wire protocol both ends speak, so it lives with the client (which imports nothing else of cbpause, and nothing but
torch here); ``cbpause.serve.distributed`` drives it on the servers, :class:`cbpause.client.Fleet` on the trainer.
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from . import buckets

__all__ = ["BACKENDS", "DEFAULT_GROUP", "WeightGroup"]

BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP = "cbpause"  # the group a request or a fleet names when it names none


class WeightGroup:
    """Rank ``rank`` of a group of ``world_size`` (rank 0: the trainer, which also serves the group's store at
    ``master_address:master_port``).  Building it waits until every rank has joined, for at most ``timeout_s``;
    each broadcast after it too."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *,
                 group_name: str = DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 60.0,
                 device: str | None = None) -> None:  # fmt: skip
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size and world_size > 1):
            raise ValueError(f"rank {rank!r} of world_size {world_size!r}: 0 <= rank < world_size, world_size >= 2")
        if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
            raise ValueError(f"timeout_s must be a number of seconds in (0, 3600], not {timeout_s!r}")
        self.rank, self.world_size, self.backend, self.name = rank, world_size, backend, group_name
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                    timeout=self.timeout)  # fmt: skip
        store = dist.PrefixStore(group_name, self._store)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        else:  # pragma: no cover -- needs GPUs on two processes
            self._group = dist.ProcessGroupNCCL(store, rank, world_size)
        # gloo moves host tensors; NCCL this member's own device (a server's model's: two servers on two devices of one
        # machine would otherwise both use the current one), the current one by default
        self.device = "cpu" if backend == "gloo" else str(device or "cuda")
        self.timeout_s = float(timeout_s)
        # One update at a time: two routes' collectives interleaved on one group would pair the wrong messages.
        self.busy = threading.Lock()
        self.broken: str | None = None  # why a collective failed: the group is not used again (destroy and re-init)

    def vote(self, ok: bool) -> bool:
        """Every member's ``ok``, all of them (an all-reduce of the minimum); ``RuntimeError`` past the deadline or
        when a member has left."""
        import torch

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.device)
        self._collective(lambda: self._group.allreduce([flag], _min_op(self.timeout)))
        return bool(flag.item())

    def broadcast(self, tensor: Any) -> None:
        """One broadcast from rank 0 of ``tensor`` (contiguous, on this member's device), within the deadline."""
        self._collective(lambda: self._group.broadcast(tensor, 0, self.timeout))

    def send(self, tensors: list[Any], bucket_bytes: int | None = None) -> None:
        """Rank 0: broadcast ``tensors``, in the order of the receivers' manifest: packed into buckets of
        ``bucket_bytes`` (:mod:`.buckets`: each a header and its bytes), or, with ``None``, one broadcast per tensor
        (the format of a stock trainer, which carries no check)."""
        import torch

        if bucket_bytes is None:
            for tensor in tensors:
                self.broadcast(tensor.detach().contiguous().to(self.device))
            return
        manifest = [(str(i), tuple(t.shape), t.dtype) for i, t in enumerate(tensors)]
        layout = buckets.layout(manifest, bucket_bytes)
        firsts = [0]
        for bucket in layout:
            firsts.append(firsts[-1] + len(bucket.slots))
        buffers: list[Any] = [None, None]

        def packed(i: int) -> tuple[Any, Any]:  # bucket i, in buffer i % 2, and its header
            bucket = layout[i]
            if buffers[i % 2] is None or buffers[i % 2].numel() < bucket.nbytes:  # (NCCL packs on the GPU)
                buffers[i % 2] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            part = [t.to(self.device) for t in tensors[firsts[i] : firsts[i + 1]]]
            data = buckets.pack(bucket, part, buffers[i % 2])
            return torch.tensor(buckets.header(bucket, data), dtype=torch.int64, device=self.device), data

        # Bucket i+1 is packed and summed in another thread while bucket i is on the wire (the copies and the sum
        # release the GIL, and so does the collective's wait); a buffer is packed again only once the bucket it held
        # two buckets before has been sent.
        with ThreadPoolExecutor(1, thread_name_prefix=f"cbpause-group-{self.name}-pack") as packer:
            next_bucket = packer.submit(packed, 0)
            for i in range(len(layout)):
                try:
                    head, data = next_bucket.result()
                except BaseException as error:  # a tensor that cannot be packed: the receivers wait for a bucket
                    self.broken = self.broken or f"a bucket could not be packed ({type(error).__name__}: {error})"[:300]
                    raise
                if i + 1 < len(layout):
                    next_bucket = packer.submit(packed, i + 1)
                self.broadcast(head)
                self.broadcast(data)

    def receive(self, manifest: list[tuple[str, tuple[int, ...], Any]], progress: Any = None,
                bucket_bytes: int | None = None, load: Any = None) -> dict[str, Any]:  # fmt: skip
        """A receiving rank in this process: every tensor of ``manifest``, each into a buffer of its own (staging),
        packed as :meth:`send` sends them; ``RuntimeError`` if a peer leaves, a broadcast passes the deadline or a
        bucket is not what the manifest lays out (its header, its checksum), with nothing returned.  ``progress()`` is
        called after each tensor or bucket (the lease table pushes the write's deadline on).  ``load(name, tensor)``,
        if given, takes each tensor instead, once its bucket is checked, valid until it returns: nothing is staged
        then, and the returned dict is empty.  (A server receives in a process of its own over gloo, whose size check
        would end this one: ``cbpause.serve.receiver``.)"""
        import torch

        received: dict[str, Any] = {}
        if bucket_bytes is None:
            for name, shape, dtype in manifest:
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                self.broadcast(buffer)
                if load is None:
                    received[name] = buffer
                else:
                    load(name, buffer)
                if progress is not None:
                    progress()
            return received
        for bucket in buckets.layout(manifest, bucket_bytes):
            head = torch.zeros(buckets.HEADER_WORDS, dtype=torch.int64, device=self.device)
            self.broadcast(head)
            payload = torch.full((bucket.nbytes,), 255, dtype=torch.uint8, device=self.device)
            self.broadcast(payload)
            why = buckets.refusal(bucket, head.tolist(), buckets.checksum(payload))
            if why is not None:
                self.broken = why
                raise RuntimeError(why)
            for name, tensor in buckets.unpack(bucket, payload):
                if load is None:
                    received[name] = tensor.clone()
                else:
                    load(name, tensor)
            if progress is not None:
                progress()
        return received

    def destroy(self) -> None:
        """Leave the group: the process group, freed, closes its connections, so that a member still inside a
        collective with this one fails at once ("Connection closed"), not at its deadline (``abort()`` and
        ``shutdown()`` of torch 2.13's ProcessGroupGloo do not close them: measured).  Freed on a thread of its own:
        its destructor joins gloo's worker threads, and one stuck sending to a peer that hangs (a stopped process,
        whose socket no longer drains) would hold the caller for ever (found by a test)."""
        held = [self._group, self._store]
        self._group = self._store = None
        self.broken = self.broken or "destroyed"
        threading.Thread(target=held.clear, name=f"cbpause-group-{self.name}-free", daemon=True).start()

    def _collective(self, start: Any) -> None:
        if self.broken is not None or self._group is None:
            raise RuntimeError(f"the weight-update group can no longer be used ({self.broken}): destroy it and "
                               "initialise it again")  # fmt: skip
        try:
            start().wait()
        except Exception as error:
            # A failed collective leaves gloo's pairs in an unknown state: the group is not trusted again.
            self.broken = "destroyed" if self._group is None else f"{type(error).__name__}: {error}"[:300]
            raise RuntimeError(f"a collective of the weight-update group failed: {self.broken}") from error


def _min_op(timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    options = dist.AllreduceOptions()
    options.reduceOp, options.timeout = dist.ReduceOp.MIN, timeout
    return options
