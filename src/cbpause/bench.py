"""``python -m cbpause.bench``: cbpause against transformers 5.23.0's own pause, side by side.

Every case runs for upstream (transformers' ``ContinuousBatchingManager`` with its
``BackgroundThreadStatus``) and for cbpause (``cbpause.integrations.transformers``), interleaved, on the
same model in the same process, for several repetitions.  On a shared machine absolute times are noisy;
the ratio within one run is the figure that counts.  ``ratio`` is always cbpause's cost over upstream's
(a time over a time, or upstream's rate over cbpause's): below 1.00 cbpause is cheaper.

Prints one table, writes it as JSON (``bench.json``) and draws the latency distributions (``bench.png``,
with matplotlib if installed) into ``--out``.  ``--quick`` finishes in under two minutes on two cores.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

IMPLS = ("upstream", "cbpause")
WAIT = 120.0


# ------------------------------------------------------------------------------------------------ results


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by nearest rank; ``nan`` for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(1, min(len(ordered), math.ceil(q / 100 * len(ordered)))) - 1]


@dataclass
class Row:
    """One line of the table.  ``reps`` holds one figure per repetition and implementation; ``samples``
    the pooled distribution where the case is one (latencies)."""

    case: str
    metric: str
    unit: str
    reps: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    higher_is_better: bool = False
    note: str = ""

    def ratios(self) -> list[float]:
        up, ours = self.reps.get("upstream", []), self.reps.get("cbpause", [])
        pairs = [(u, o) for u, o in zip(up, ours, strict=False) if u > 0 and o > 0]
        return [u / o if self.higher_is_better else o / u for u, o in pairs]

    def summary(self) -> dict:
        out = {"case": self.case, "metric": self.metric, "unit": self.unit, "note": self.note}
        for impl in IMPLS:
            if impl in self.samples:
                xs = self.samples[impl]
                out[impl] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}
            elif impl in self.reps:
                out[impl] = {"median": statistics.median(self.reps[impl]), "reps": self.reps[impl]}
        r = self.ratios()
        if r:
            out["ratio"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        return out


def _fmt(x: float, unit: str) -> str:
    if x != x:
        return "-"
    if unit == "ms":
        return f"{x:.3f}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _cell(row: Row, impl: str) -> str:
    if impl in row.samples:
        xs = row.samples[impl]
        return f"{_fmt(percentile(xs, 50), row.unit)} / {_fmt(percentile(xs, 99), row.unit)}"
    if impl in row.reps:
        return _fmt(statistics.median(row.reps[impl]), row.unit)
    return "-"


def format_table(rows: list[Row]) -> str:
    head = ("case", "metric", "unit", "upstream", "cbpause", "ratio (spread)")
    body = []
    for row in rows:
        r = row.ratios()
        ratio = f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" if r else "-"
        unit = row.unit + (" p50/p99" if row.samples else "")
        body.append((row.case, row.metric, unit, _cell(row, "upstream"), _cell(row, "cbpause"), ratio))
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [head, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {row.case} {row.metric}: {row.note}" for row in rows if row.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


# ------------------------------------------------------------------------------------------- the model


def _first_step_after(times: list[float], t: float) -> float | None:
    """The first of the (sorted) forward-step start ``times`` after ``t``, or None."""
    i = bisect.bisect_right(times, t)
    return times[i] if i < len(times) else None


class StepClock:
    """Forward pre-hook: the start time of every forward step, and a way to wait for the next ones."""

    def __init__(self):
        self.times: list[float] = []
        self.cond = threading.Condition()

    def __call__(self, module, args):
        now = time.perf_counter()
        with self.cond:
            self.times.append(now)
            self.cond.notify_all()

    def count(self) -> int:
        return len(self.times)

    def wait_steps(self, n: int, timeout: float = WAIT) -> bool:
        with self.cond:
            target = len(self.times) + n
            return self.cond.wait_for(lambda: len(self.times) >= target, timeout)

    def first_after(self, t: float, timeout: float = WAIT) -> float:
        """The start of the first forward step after ``t`` (waits for it)."""
        with self.cond:
            ok = self.cond.wait_for(lambda: bool(self.times) and self.times[-1] > t, timeout)
            if not ok:
                raise TimeoutError("no forward step within the bound")
            return _first_step_after(self.times, t)

    def step_times(self, n: int = 40) -> list[float]:
        """Times between consecutive forward starts over the next ``n`` steps of a busy loop: one whole
        iteration each (the forward step, the batch update, the next batch's preparation)."""
        start = self.count()
        self.wait_steps(n)
        xs = self.times[start : start + n]
        return [b - a for a, b in zip(xs, xs[1:], strict=False)]


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.args = args
        self.torch = torch
        torch.manual_seed(args.seed)
        self.config = LlamaConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        )  # fmt: skip
        self.model = LlamaForCausalLM(self.config).to(args.device).eval()
        self.clock = StepClock()
        self.model.register_forward_pre_hook(self.clock)
        self.rng = torch.Generator().manual_seed(args.seed)

    def prompt(self, n: int = 8) -> list[int]:
        return self.torch.randint(1, self.config.vocab_size, (n,), generator=self.rng).tolist()

    def manager(self, impl: str, max_new: int, in_flight: int):
        from transformers import ContinuousBatchingConfig, GenerationConfig

        from .integrations.transformers import init_continuous_batching

        gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        blocks = in_flight * -(-(16 + max_new) // 16) + 32
        cb = ContinuousBatchingConfig(
            use_cuda_graph=False, use_async_batching=False, num_blocks=blocks, page_size=16, max_batch_tokens=512
        )
        if impl == "cbpause":
            return init_continuous_batching(self.model, gen, cb, peer_park_timeout=WAIT)
        return self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)

    @contextmanager
    def running(self, impl: str, *, busy: bool, max_new: int = 1024, in_flight: int = 4) -> Iterator:
        """A started manager; with ``busy``, a feeder keeps ``in_flight`` requests generating."""
        manager = self.manager(impl, max_new, in_flight)
        manager.start()
        stop = threading.Event()
        feeder = None
        if busy:

            def feed():
                for _ in range(in_flight):
                    manager.add_request(self.prompt(), max_new_tokens=max_new)
                while not stop.is_set():
                    if manager.get_result(timeout=0.2) is not None and not stop.is_set():
                        manager.add_request(self.prompt(), max_new_tokens=max_new)

            feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
            feeder.start()
            self.clock.wait_steps(3)
        # One pause, not measured: the first one waits for the loop to build its cache and scheduler.
        with _pause(manager, impl):
            pass
        try:
            yield manager
        finally:
            stop.set()
            if feeder is not None:
                feeder.join(WAIT)
            manager.stop(block=True, timeout=WAIT, hard_stop=True)


# ----------------------------------------------------------------------------------------------- cases


def case_overhead(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 1: what the loop pays every iteration for being pausable, no pause pending (ns/iteration).

    cbpause runs as shipped: trace recording off (the default), which costs one ``is not None`` test per
    transition; transformers' loop calls only the drop-in hot paths, which record nothing in any case.
    """
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    from .protocol import PauseProtocol

    def loop(status) -> Callable[[], None]:
        def one():  # the calls _update_tp_group_state makes at TP=1
            status.is_pause_requested()
            status.update_with_tp_status(status.local_status)
            if status.tp_status == status.HARD_STOP:
                raise AssertionError("unexpected stop")

        return one

    n = 20_000 if quick else 200_000
    row = Row("1", "per-iteration checks", "ns", note="cbpause with trace recording off, the default")
    impls = {"upstream": BackgroundThreadStatus(), "cbpause": PauseProtocol()}
    for status in impls.values():
        status.clear()
    for _ in range(reps):
        for name, status in impls.items():
            row.reps.setdefault(name, []).append(timeit.timeit(loop(status), number=n) / n * 1e9)
    return [row]


def _pause(manager, impl: str):
    return manager.pause(timeout=WAIT) if impl == "cbpause" else manager.pause()


def case_entry_and_resume(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Cases 2 and 3: pause-entry latency (busy and idle loop) and resume latency, in ms."""
    n = 15 if quick else 60
    busy = Row("2", "pause entry, busy loop", "ms")
    idle = Row("2", "pause entry, idle loop", "ms")
    resume = Row("3", "resume (last out to next step)", "ms")
    step = Row("2", "loop iteration (step to step)", "ms", note="a busy loop's forward starts, no pause between")
    for _ in range(reps):
        for impl in IMPLS:
            with bench.running(impl, busy=True) as manager:
                times = [1e3 * x for x in bench.clock.step_times()]
                step.samples.setdefault(impl, []).extend(times)
                step.reps.setdefault(impl, []).append(statistics.median(times))
                entries, resumes = [], []
                for _ in range(n):
                    bench.clock.wait_steps(2)
                    asked = time.perf_counter()
                    with _pause(manager, impl):
                        entries.append(time.perf_counter() - asked)
                        left = time.perf_counter()
                    resumes.append(bench.clock.first_after(left) - left)
                busy.samples.setdefault(impl, []).extend(1e3 * x for x in entries)
                busy.reps.setdefault(impl, []).append(1e3 * statistics.median(entries))
                resume.samples.setdefault(impl, []).extend(1e3 * x for x in resumes)
                resume.reps.setdefault(impl, []).append(1e3 * statistics.median(resumes))
            with bench.running(impl, busy=False) as manager:
                entries = []
                for _ in range(n):
                    time.sleep(0.005)  # let the loop get back to its idle wait: the case is an idle loop
                    asked = time.perf_counter()
                    with _pause(manager, impl):
                        entries.append(time.perf_counter() - asked)
                idle.samples.setdefault(impl, []).extend(1e3 * x for x in entries)
                idle.reps.setdefault(impl, []).append(1e3 * statistics.median(entries))
    step_ms = statistics.median(step.samples["upstream"] + step.samples["cbpause"])
    for row in (busy, idle):
        row.note = "p99 / median iteration ({:.2f} ms): upstream {:.2f}, cbpause {:.2f}".format(
            step_ms, *(percentile(row.samples[i], 99) / step_ms for i in IMPLS)
        )
    busy.note += f"; target p99 <= iteration + 1 ms = {step_ms + 1:.2f} ms"
    idle.note += "; target p99 <= 1 ms"
    return [busy, idle, resume, step]


def case_contention(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 4: k threads pausing concurrently on a busy loop: pauses per second."""
    rows = []
    for k in (1, 4, 16, 64):
        row = Row("4", f"{k} threads pausing", "pauses/s", higher_is_better=True)
        # Enough pauses that a measurement lasts well over the scheduler's noise (a few hundred ms).
        per_thread = max(4, (128 if quick else 1024) // k)
        for _ in range(reps):
            for impl in IMPLS:
                with bench.running(impl, busy=True) as manager:
                    barrier = threading.Barrier(k + 1)
                    errors: list[BaseException] = []

                    def holder(barrier=barrier, per_thread=per_thread, impl=impl, errors=errors, manager=manager):
                        try:
                            barrier.wait(WAIT)
                            for _ in range(per_thread):
                                with _pause(manager, impl):
                                    pass
                        except BaseException as error:  # noqa: BLE001 - reported below
                            errors.append(error)

                    threads = [threading.Thread(target=holder, daemon=True) for _ in range(k)]
                    for t in threads:
                        t.start()
                    barrier.wait(WAIT)
                    started = time.perf_counter()
                    for t in threads:
                        t.join(WAIT)
                    elapsed = time.perf_counter() - started
                    if errors or any(t.is_alive() for t in threads):
                        raise RuntimeError(f"contention case failed for {impl}: {errors[:1]}")
                    row.reps.setdefault(impl, []).append(k * per_thread / elapsed)
        rows.append(row)
    return rows


def _next_steps(clock: StepClock, updates: list[tuple[float, float]]) -> list[float]:
    """For each update (decided at, done at), the time from its decision to the first forward step that
    starts after it is done, i.e. with the new weights (updates with no such step are dropped)."""
    times = list(clock.times)
    firsts = [(decided, _first_step_after(times, done)) for decided, done in updates]
    return [first - decided for decided, first in firsts if first is not None]


def _generate(bench: Bench, impl: str, n: int, max_new: int, every: int | None, update=None) -> tuple[float, list]:
    """Serve ``n`` requests; with ``every``, a trainer pauses every ``every`` steps (and runs ``update``).

    Returns tokens per second and, for each pause, the time from its decision to the next forward step.
    """
    manager = bench.manager(impl, max_new, n)
    done = threading.Event()
    decisions: list[tuple[float, float]] = []

    def trainer():
        while not done.is_set():
            if not bench.clock.wait_steps(every, timeout=1.0) or done.is_set():
                continue
            decided = time.perf_counter()
            try:
                with _pause(manager, impl):
                    if update is not None:
                        update()
                    updated = time.perf_counter()
            except RuntimeError:
                return  # the loop stopped
            decisions.append((decided, updated))

    manager.start()
    started = time.perf_counter()
    ids = [manager.add_request(bench.prompt(), max_new_tokens=max_new) for _ in range(n)]
    thread = None
    if every is not None:
        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
    tokens = 0
    try:
        for _ in ids:
            out = manager.get_result(timeout=WAIT)
            if out is None:
                raise RuntimeError(f"{impl}: a request did not come back")
            tokens += len(out.generated_tokens)
        elapsed = time.perf_counter() - started
    finally:
        done.set()
        if thread is not None:
            thread.join(WAIT)
        manager.stop(block=True, timeout=WAIT)
    return tokens / elapsed, _next_steps(bench.clock, decisions)


def case_throughput(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 5: tokens per second, no pauses and a pause every 1, 10, 100 steps."""
    n, max_new = (16, 64) if quick else (32, 192)
    rows = []
    for every in (None, 1, 10, 100):
        metric = "no pauses" if every is None else f"pause every {every} steps"
        row = Row("5", metric, "tokens/s", higher_is_better=True)
        for _ in range(reps):
            for impl in IMPLS:
                row.reps.setdefault(impl, []).append(_generate(bench, impl, n, max_new, every)[0])
        rows.append(row)
    return rows


def _perturb(bench: Bench) -> Callable[[], None]:
    torch = bench.torch
    gen = torch.Generator(device=bench.args.device).manual_seed(1)

    @torch.no_grad()
    def update():
        for p in bench.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 1e-5)

    return update


def _stop_restart(bench: Bench, n: int, max_new: int, every: int, updates: int) -> tuple[float, list[float]]:
    """Case 6 without a pause mechanism: hard stop, update, restart, resubmit the unfinished (re-prefill).

    Returns tokens per second and, for each update, the time from its decision to the next forward step.
    """
    from transformers.generation.continuous_batching.requests import RequestStatus

    update = _perturb(bench)
    manager = bench.manager("upstream", max_new, n)
    manager.start()
    started = time.perf_counter()
    deadline = started + 4 * WAIT
    owed: dict[str, tuple[list[int], list[int]]] = {}  # request id -> (original prompt, tokens before it)
    for _ in range(n):
        prompt = bench.prompt()
        owed[manager.add_request(prompt, max_new_tokens=max_new)] = (prompt, [])
    tokens = done = made = 0
    decisions: list[tuple[float, float]] = []
    next_update = bench.clock.count() + every
    try:
        while done < n:
            if time.perf_counter() > deadline:
                raise RuntimeError("stop/restart case: requests did not come back")
            if made < updates and bench.clock.count() >= next_update:
                decided = time.perf_counter()
                manager.stop(block=True, timeout=WAIT, hard_stop=True, keep_for_next_session=True)
                unfinished = []
                while (out := manager.get_result(timeout=0)) is not None:
                    prompt, before = owed.pop(out.request_id)
                    got = before + list(out.generated_tokens)
                    if out.status == RequestStatus.FINISHED:
                        tokens, done = tokens + len(got), done + 1
                    else:
                        unfinished.append((prompt, got))
                update()
                manager = bench.model.init_continuous_batching()  # the cached manager, attention switched back
                manager.start()
                for prompt, got in unfinished:
                    owed[manager.add_request(prompt + got, max_new_tokens=max_new - len(got))] = (prompt, got)
                decisions.append((decided, time.perf_counter()))
                made += 1
                next_update = bench.clock.count() + every
                continue
            out = manager.get_result(timeout=0.05)
            if out is not None:
                prompt, before = owed.pop(out.request_id)
                tokens, done = tokens + len(before) + len(out.generated_tokens), done + 1
        elapsed = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=WAIT)
        bench.model.destroy_cached_continuous_batching_manager()
    return tokens / elapsed, _next_steps(bench.clock, decisions)


def case_weight_update(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 6: pause, update in place, resume, against stop/update/restart/resubmit; 20 updates per run."""
    n, max_new = (8, 96) if quick else (16, 256)
    updates = 10 if quick else 20
    gap = Row("6", "update: decision to next step", "ms", note="to the first forward step with the new weights")
    rate = Row("6", f"tokens/s over a run with {updates} updates", "tokens/s", higher_is_better=True)
    restart_gaps: list[float] = []
    restart_rates: list[float] = []
    every = max(1, max_new // (updates + 1))
    for _ in range(reps):
        for impl in IMPLS:
            tps, gaps = _generate(bench, impl, n, max_new, every, update=_perturb(bench))
            gap.samples.setdefault(impl, []).extend(1e3 * g for g in gaps)
            gap.reps.setdefault(impl, []).append(1e3 * statistics.median(gaps) if gaps else float("nan"))
            rate.reps.setdefault(impl, []).append(tps)
        tps, gaps = _stop_restart(bench, n, max_new, every, updates)
        restart_gaps.extend(1e3 * g for g in gaps)
        restart_rates.append(tps)
    stop_restart = Row("6", "stop/update/restart/resubmit", "ms")
    stop_restart.samples["upstream"] = restart_gaps
    ours = percentile(gap.samples["cbpause"], 50)
    theirs = percentile(restart_gaps, 50)
    gap.note += f"; stop/restart p50 {theirs:.2f} ms = {theirs / ours:.1f}x cbpause's pause (target >= 10x)"
    rate.note = f"stop/restart: {statistics.median(restart_rates):,.0f} tokens/s"
    return [gap, rate, stop_restart]


def free_port() -> int:
    """A TCP port free on this host now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tp_worker(rank: int, world: int, port: int, ckpt: str, impl: str, n: int, outdir: str) -> None:
    """Case 7, one rank: busy loop, ``n`` pauses, entry latency of each (spawned by ``case_tp``)."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    record: dict = {"rank": rank, "impl": impl}
    try:
        import torch
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
        from transformers.distributed import DistributedConfig
        from transformers.utils import logging as hf_logging

        from .integrations.transformers import init_continuous_batching

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = AutoModelForCausalLM.from_pretrained(ckpt, distributed_config=DistributedConfig(tp_size=world)).eval()
        gen = GenerationConfig(max_new_tokens=512, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(
            use_cuda_graph=False, use_async_batching=False, num_blocks=256, page_size=16, max_batch_tokens=512
        )
        if impl == "cbpause":
            manager = init_continuous_batching(model, gen, cb, peer_park_timeout=WAIT)
        else:
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        clock = StepClock()
        model.register_forward_pre_hook(clock)
        manager.start()
        if rank == 0:
            for _ in range(4):
                manager.add_request(list(range(1, 9)), max_new_tokens=512)
        clock.wait_steps(3)
        entries = []
        for _ in range(n):
            clock.wait_steps(2)
            asked = time.perf_counter()
            with _pause(manager, impl):
                entries.append(time.perf_counter() - asked)
        record["entries_ms"] = [1e3 * x for x in entries]
        manager.stop(block=True, timeout=WAIT, hard_stop=True)
        dist.barrier()
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        record["error"] = repr(error)
    Path(outdir, f"{impl}-rank{rank}.json").write_text(json.dumps(record))
    os._exit(0)  # skip process-group teardown; the parent only reads the file


def case_tp(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 7: TP=2 over gloo, two processes per implementation: pause-entry latency per rank."""
    import torch.multiprocessing as mp

    n = 10 if quick else 40
    rows = [Row("7", f"TP=2 pause entry, rank {r}", "ms") for r in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "ckpt")
        bench.model.save_pretrained(ckpt)
        for rep in range(max(1, reps // 2)):
            for impl in IMPLS:
                outdir = Path(tmp, f"{impl}-{rep}")
                outdir.mkdir()
                ctx = mp.start_processes(
                    tp_worker, args=(2, free_port(), str(ckpt), impl, n, str(outdir)), nprocs=2, join=False,
                    start_method="spawn",
                )  # fmt: skip
                for p in ctx.processes:
                    p.join(WAIT * 2)
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for r in range(2):
                    path = outdir / f"{impl}-rank{r}.json"
                    record = json.loads(path.read_text()) if path.exists() else {"error": "no result (hang?)"}
                    if "error" in record:
                        raise RuntimeError(f"TP case, {impl} rank {r}: {record['error']}")
                    rows[r].samples.setdefault(impl, []).extend(record["entries_ms"])
                    rows[r].reps.setdefault(impl, []).append(statistics.median(record["entries_ms"]))
    return rows


def case_tlc(quick: bool) -> list[dict]:
    """Case 8: the TLC models through the runner: distinct states, depth, seconds, states per minute."""
    from . import tlc

    try:
        tlc.find_jar()
    except Exception as error:  # noqa: BLE001 - reported, not fatal: the other cases stand alone
        return [{"model": "-", "error": f"TLC not available: {error}"}]
    try:
        tla_dir = tlc.default_tla_dir()
    except tlc.TLCError as error:
        return [{"model": "-", "error": str(error)}]
    models = tlc.select(tlc.load_manifest(tla_dir), [], "fast")
    if quick:
        models = [m for m in models if m.name in ("PauseProtocol_1r2h", "Upstream_D1", "Upstream_D2", "Upstream_D3")]
    out = []
    for model in models:
        result = tlc.run_model(model, tla_dir)
        out.append({
            "model": model.name, "expected": model.expect, "result": result.outcome,
            "distinct": result.distinct_states, "depth": result.depth, "seconds": round(result.seconds, 1),
            "states_per_min": round(result.states_per_minute or 0),
        })  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------- output


def plot(rows: list[Row], path: Path) -> bool:
    """Latency distributions (empirical CDFs), upstream against cbpause; False without matplotlib or
    without a latency case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    except ImportError:
        return False
    restart = next((r for r in rows if r.metric.startswith("stop/")), None)
    dists = [r for r in rows if r.samples and r.unit == "ms" and r is not restart]
    if not dists:
        return False
    cols = 3
    nrows = -(-len(dists) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, dists, strict=False):
        colors = (("upstream", "tab:orange"), ("cbpause", "tab:blue"))
        curves = [(impl, row.samples.get(impl, []), color) for impl, color in colors]
        if row.case == "6" and restart is not None:
            curves.append(("stop/restart (no pause)", restart.samples.get("upstream", []), "tab:red"))
        for label, samples, color in curves:
            xs = sorted(samples)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label, color=color)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))  # labels even within a decade
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{row.case}: {row.metric}", fontsize=9)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(dists) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.system()} {platform.machine()} {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


CASES = {
    "overhead": case_overhead,
    "entry": case_entry_and_resume,
    "contention": case_contention,
    "throughput": case_throughput,
    "update": case_weight_update,
    "tp": case_tp,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and samples: under 2 minutes")
    p.add_argument("--repeats", type=int, default=None, help="repetitions per case (default 2 quick, 5 full)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (case 7 always runs on the CPU over gloo)")
    p.add_argument("--cases", default=",".join([*CASES, "tlc"]), help="comma-separated subset of: "
                   + ", ".join([*CASES, "tlc"]))  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where bench.json and bench.png go")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - {*CASES, "tlc"}
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.device.startswith("cuda") and not _cuda():
        p.error("--device cuda: no CUDA device here")
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reps = args.repeats or (2 if args.quick else 5)
    selected = args.cases.split(",")
    started = time.perf_counter()
    bench = Bench(args)
    rows: list[Row] = []
    for name, fn in CASES.items():
        if name in selected:
            t0 = time.perf_counter()
            rows.extend(fn(bench, reps, args.quick))
            print(f"bench: case {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    tlc_rows = case_tlc(args.quick) if "tlc" in selected else []
    print(f"machine: {machine()}; device {args.device}; {reps} interleaved repetitions")
    print(format_table(rows))
    if tlc_rows:
        print("\n8 TLC (through the runner)")
        for r in tlc_rows:
            if "error" in r:
                print(f"  {r['error']}")
            else:
                depth = "-" if r["depth"] is None else r["depth"]
                print(f"  {r['model']:<27} {r['result']:<36} distinct {r['distinct'] or 0:>9,}  depth {depth:>3}  "
                      f"{r['seconds']:>6} s  {r['states_per_min']:>9,} states/min")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(), "device": args.device, "repetitions": reps, "quick": args.quick,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.summary() for r in rows], "raw": [asdict(r) for r in rows], "tlc": tlc_rows,
    }  # fmt: skip
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    drew = plot(rows, args.out / "bench.png")
    plotted = f" and {args.out / 'bench.png'}" if drew else " (no plot: no latency case, or no matplotlib)"
    print(f"\nwrote {args.out / 'bench.json'}{plotted}")
    print(f"bench: {report['seconds']} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
