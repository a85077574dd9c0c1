"""Tensor parallelism in worker processes on one machine: ports, the process group, the model, the spawn.

Each rank is a process (``torch.multiprocessing``, forked by the preloaded fork server of
:mod:`cbpause.testing.forks` where the platform has one, else spawned); ranks meet over gloo on the CPU (NCCL on
CUDA devices) at a port chosen free on this host.  The parent joins every rank within a deadline and kills what
outlives it, so a hang fails a test or a benchmark instead of freezing it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "join_tp_group", "load_tp_model", "spawn_ranks"]


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_tp_group(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """In a rank's process: join the default process group of ``world`` ranks at ``port`` on this host.

    One torch thread per rank: the ranks share the machine's cores.
    """
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)


def load_tp_model(checkpoint: str, world: int) -> Any:
    """The checkpoint's model, sharded over the ``world`` ranks of the group (transformers' TP)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=world)).eval()


def spawn_ranks(fn: Callable[..., None], args: tuple, world: int, timeout: float) -> list[int]:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes and join them within ``timeout`` seconds in all.

    Returns the ranks that were still running at the deadline (and were killed): a hang.
    """
    import torch.multiprocessing as mp

    from .forks import context, run_rank

    ctx = mp.start_processes(run_rank, args=(dict(os.environ), fn, *args), nprocs=world, join=False,
                             start_method=context().get_start_method())  # fmt: skip
    deadline = time.monotonic() + timeout
    for process in ctx.processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
    for rank in hung:
        ctx.processes[rank].kill()
        ctx.processes[rank].join(5)
    return hung
