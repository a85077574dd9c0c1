"""Case 7: pause entry under tensor parallelism over gloo, one process per rank, and where its time goes.

Every rank runs a busy loop and pauses ``n`` times; each pause is asked right after a forward step of its rank
started (as in case 2).  Besides the entry, each rank records, for both implementations with the same wrappers
(a ``perf_counter`` per call, on the instance): the start of each group step (``_update_tp_group_state``), each
call of the group's all-reduce (``DistributedHelper.tp_all_reduce_state``: its start and its end), and where each
loop opens its window (upstream's ``pause_and_wait``, cbpause's ``pause_window``).  Per pause, the entry splits
into:

* **step in flight**: request to the next group step (the rest of the forward step, the batch update);
* **to the all-reduce**: group step to the all-reduce (draining the input queues, the observation);
* **all-reduce**: the collective, which returns once every rank has reached it, so a rank whose peer is still
  in its step waits here for it;
* **decision to window**: the decision applied up to the window (cbpause: the modes' effects, the window's own
  checks);
* **window to inside**: the window opens and the holder is woken.

The last row is the loop iteration (forward start to forward start, no pause) of the same processes: the target
is an entry of at most 1.5 iterations at p50.
"""

from __future__ import annotations

import bisect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from .harness import IMPLS, WAIT, Bench, Row, clock_calls, order, pause

PHASES = ("step in flight", "to the all-reduce", "all-reduce", "decision to window", "window to inside")


def _first(xs: list[float], after: float) -> float | None:
    i = bisect.bisect_left(xs, after)
    return xs[i] if i < len(xs) else None


def split_entry(asked: float, entered: float, clocks: dict[str, list[float]]) -> list[float] | None:
    """One pause's entry as the durations of :data:`PHASES` (seconds), or None where a clock has no event in
    the entry (the request landed in the group step itself)."""
    group = _first(clocks["group"], asked)
    if group is None or group > entered:
        return None
    i = bisect.bisect_left(clocks["reduce_start"], group)
    if i >= len(clocks["reduce_end"]) or clocks["reduce_end"][i] > entered:  # (an all-reduce in progress: no end)
        return None
    reduce_start, reduce_end = clocks["reduce_start"][i], clocks["reduce_end"][i]
    window = _first(clocks["window"], reduce_end)
    if window is None or window > entered:
        return None
    return [group - asked, reduce_start - group, reduce_end - reduce_start, window - reduce_end, entered - window]


def tp_worker(rank: int, world: int, port: int, ckpt: str, impl: str, n: int, outdir: str) -> None:
    """Case 7, one rank: busy loop, ``n`` pauses, entry latency of each and its split (spawned by :func:`run_group`)."""
    record: dict = {"rank": rank, "impl": impl}
    try:
        from transformers.utils import logging as hf_logging

        from ...integrations.transformers import init_continuous_batching
        from ...testing import ForwardProbe, batching_config, greedy_config, join_tp_group, load_tp_model

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
        with pause(manager, impl):  # not measured: the batch processor exists once the loop has paused
            clocks: dict[str, list[float]] = {"group": [], "reduce_start": [], "reduce_end": [], "window": []}
            processor = manager.batch_processor
            clock_calls(processor, "_update_tp_group_state", clocks["group"])
            helper = processor.distributed_helper
            clock_calls(helper, "tp_all_reduce_state", clocks["reduce_start"], clocks["reduce_end"])
            status = manager.background_thread_status
            clock_calls(status, "pause_window" if impl == "cbpause" else "pause_and_wait", clocks["window"])
        iterations = clock.step_times(41, WAIT)
        entries, splits = [], []
        for _ in range(n):
            clock.wait_steps(2, WAIT)
            asked = time.perf_counter()
            with pause(manager, impl):
                entered = time.perf_counter()
            entries.append(entered - asked)
            splits.append((asked, entered))
        record["entries_ms"] = [1e3 * x for x in entries]
        record["iterations_ms"] = [1e3 * x for x in iterations]
        split = [split_entry(a, e, clocks) for a, e in splits]
        record["split_ms"] = [[1e3 * x for x in s] for s in split if s is not None]
        manager.stop(block=True, timeout=WAIT, hard_stop=True)
        import torch.distributed as dist

        dist.barrier()
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        record["error"] = repr(error)
    Path(outdir, f"{impl}-rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip process-group teardown; the parent only reads the file


def run_group(ckpt: Path, impl: str, world: int, n: int, outdir: Path) -> list[dict]:
    """One group of ``world`` ranks of ``impl`` pausing ``n`` times: each rank's record."""
    from ...testing import free_port, spawn_ranks

    outdir.mkdir(parents=True)
    spawn_ranks(tp_worker, (world, free_port(), str(ckpt), impl, n, str(outdir)), world=world, timeout=WAIT * 2)
    records = []
    for r in range(world):
        path = outdir / f"{impl}-rank{r}.json"
        record = json.loads(path.read_text()) if path.exists() else {"error": "no result (hang?)"}
        if "error" in record:
            raise RuntimeError(f"TP case, {impl} rank {r} of {world}: {record['error']}")
        records.append(record)
    return records



def case_tp(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 7: TP=2 over gloo, pause entry per rank, its split into :data:`PHASES`, and the loop iteration."""
    n = 10 if quick else 30
    rows = [Row("7", f"TP=2 pause entry, rank {r}", "ms") for r in range(2)]
    phases = [Row("7", f"TP=2 entry: {p}", "ms", note="both ranks") for p in PHASES]
    iteration = Row("7", "TP=2 loop iteration", "ms", note="forward start to forward start, no pause; both ranks")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "ckpt")
        bench.model.save_pretrained(ckpt)
        for rep in range(reps):
            for impl in order(rep):
                records = run_group(ckpt, impl, 2, n, Path(tmp, f"{impl}-{rep}"))
                for r, record in enumerate(records):
                    rows[r].add(impl, record["entries_ms"])
                iteration.add(impl, [x for rec in records for x in rec["iterations_ms"]])
                for k, row in enumerate(phases):
                    row.add(impl, [s[k] for rec in records for s in rec["split_ms"]])
    it = {impl: statistics.median(iteration.samples[impl]) for impl in IMPLS}
    for row in rows:
        row.note = "p50 in iterations (target <= 1.5): " + ", ".join(
            f"{impl} {statistics.median(row.samples[impl]) / it[impl]:.2f}" for impl in IMPLS
        )
    return [*rows, *phases, iteration]
