"""Case 7: pause entry under tensor parallelism, TP=2 over gloo, two worker processes per implementation."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .harness import IMPLS, WAIT, Bench, Row, pause


def tp_worker(rank: int, world: int, port: int, ckpt: str, impl: str, n: int, outdir: str) -> None:
    """Case 7, one rank: busy loop, ``n`` pauses, entry latency of each (spawned by :func:`case_tp`)."""
    record: dict = {"rank": rank, "impl": impl}
    try:
        from transformers.utils import logging as hf_logging

        from ..integrations.transformers import init_continuous_batching
        from ..testing import ForwardProbe, batching_config, greedy_config, join_tp_group, load_tp_model

        hf_logging.set_verbosity_error()
        join_tp_group(rank, world, port)
        model = load_tp_model(ckpt, world)
        gen, cb = greedy_config(512), batching_config(num_blocks=256, max_batch_tokens=512)
        if impl == "cbpause":
            manager = init_continuous_batching(model, gen, cb, peer_park_timeout=WAIT)
        else:
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        clock = ForwardProbe()
        clock.attach(model)
        manager.start()
        if rank == 0:
            for _ in range(4):
                manager.add_request(list(range(1, 9)), max_new_tokens=512)
        clock.wait_steps(3, WAIT)
        entries = []
        for _ in range(n):
            clock.wait_steps(2, WAIT)
            asked = time.perf_counter()
            with pause(manager, impl):
                entries.append(time.perf_counter() - asked)
        record["entries_ms"] = [1e3 * x for x in entries]
        manager.stop(block=True, timeout=WAIT, hard_stop=True)
        import torch.distributed as dist

        dist.barrier()
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        record["error"] = repr(error)
    Path(outdir, f"{impl}-rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip process-group teardown; the parent only reads the file


def case_tp(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 7: TP=2 over gloo, two processes per implementation: pause-entry latency per rank."""
    from ..testing import free_port, spawn_ranks

    n = 10 if quick else 40
    rows = [Row("7", f"TP=2 pause entry, rank {r}", "ms") for r in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "ckpt")
        bench.model.save_pretrained(ckpt)
        for rep in range(max(1, reps // 2)):
            for impl in IMPLS:
                outdir = Path(tmp, f"{impl}-{rep}")
                outdir.mkdir()
                spawn_ranks(tp_worker, (2, free_port(), str(ckpt), impl, n, str(outdir)), world=2, timeout=WAIT * 2)
                for r in range(2):
                    path = outdir / f"{impl}-rank{r}.json"
                    record = json.loads(path.read_text()) if path.exists() else {"error": "no result (hang?)"}
                    if "error" in record:
                        raise RuntimeError(f"TP case, {impl} rank {r}: {record['error']}")
                    rows[r].samples.setdefault(impl, []).extend(record["entries_ms"])
                    rows[r].reps.setdefault(impl, []).append(statistics.median(record["entries_ms"]))
    return rows
