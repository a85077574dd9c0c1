"""Case 10: how the cost of a pause grows with the number of holders, of waiting requests and of TP ranks.

* **Holders** (1 to 256): k threads ask for a pause at once on a busy loop; the time from their start (a barrier)
  to the last one inside, and from the first to the last one out to the next forward step.
* **Waiting requests** (0 to 1,000): a busy loop with four requests in flight and N more waiting in the scheduler
  (the benchmark keeps them waiting by offering the scheduler only requests already in flight, the same wrapper on
  both implementations); the pause entry beyond the step in flight (case 2's measure), the resume, and the loop's
  group step (``_update_tp_group_state``, which both loops run every iteration: the per-iteration checks with
  what surrounds them).
* **TP ranks** (1, 2, 4 over gloo): case 7's group, one process per rank, on a model whose four key-value heads
  split over four ranks: pause entry and loop iteration.

The per-iteration checks proper (case 1) read only the protocol's state, never the scheduler or the holders: no
holder exists while no pause is asked, so they cannot grow with either.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from .harness import IMPLS, WAIT, Bench, Row, clock_calls, order, pause
from .tp import run_group

HOLDERS = (1, 4, 16, 64, 256)
WAITING = (0, 10, 100, 1000)
RANKS = (1, 2, 4)


def _holders_at_once(bench: Bench, impl: str, manager, k: int) -> tuple[float, float]:
    """k threads ask at once: (start to the last one inside, last one out to the next forward step), seconds."""
    barrier = threading.Barrier(k + 1)
    inside = threading.Barrier(k + 1)
    leave = threading.Event()
    errors: list[BaseException] = []

    def holder() -> None:
        try:
            barrier.wait(WAIT)
            with pause(manager, impl):
                inside.wait(WAIT)
                leave.wait(WAIT)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=holder, daemon=True) for _ in range(k)]
    for t in threads:
        t.start()
    bench.clock.wait_steps(2, WAIT)
    barrier.wait(WAIT)
    started = time.perf_counter()
    inside.wait(WAIT)
    entered = time.perf_counter()
    left = time.perf_counter()
    leave.set()
    for t in threads:
        t.join(WAIT)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"scaling case, {k} holders, {impl}: {errors[:1]}")
    return entered - started, bench.clock.first_after(left, WAIT) - left


def _keep_waiting(manager) -> None:
    """Offer the scheduler only the waiting requests already in flight: the others stay waiting (the benchmark's
    own hold, the same on both implementations)."""
    from ...integrations.modes import in_flight

    scheduler = manager.batch_processor.scheduler
    candidates = scheduler._get_waiting_candidates
    scheduler._get_waiting_candidates = lambda: [s for s in candidates() if in_flight(s)]


def case_scaling(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 10: holders, waiting requests, TP ranks."""
    rows: list[Row] = []
    n = 3 if quick else 8
    for k in HOLDERS:
        entry = Row("10", f"{k} holders at once: to the last inside", "ms", scale=("holders", k))
        resume = Row("10", f"{k} holders at once: resume", "ms", scale=("holders", k))
        for rep in range(reps):
            for impl in order(rep):
                with bench.running(impl, busy=True) as manager:
                    got = [_holders_at_once(bench, impl, manager, k) for _ in range(n)]
                entry.add(impl, [1e3 * e for e, _ in got])
                resume.add(impl, [1e3 * r for _, r in got])
        rows += [entry, resume]
    n = 8 if quick else 30
    for waiting in WAITING:
        beyond = Row("10", f"{waiting} waiting: entry beyond the step in flight", "us", scale=("waiting", waiting))
        resume = Row("10", f"{waiting} waiting: resume", "ms", scale=("waiting", waiting))
        group = Row("10", f"{waiting} waiting: group step, no pause", "us", scale=("waiting", waiting))
        for rep in range(reps):
            for impl in order(rep):
                with bench.running(impl, busy=True) as manager:
                    with pause(manager, impl):
                        _keep_waiting(manager)
                        starts: list[float] = []
                        ends: list[float] = []
                        clock_calls(manager.batch_processor, "_update_tp_group_state", starts, ends)
                        for _ in range(waiting):
                            manager.add_request(bench.prompt(), max_new_tokens=8)
                    bench.clock.wait_steps(20, WAIT)
                    quiet = [end - start for start, end in zip(starts, list(ends), strict=False)]
                    added, resumed = [], []
                    for _ in range(n):
                        bench.clock.wait_steps(2, WAIT)
                        asked = time.perf_counter()
                        with pause(manager, impl):
                            entered = time.perf_counter()
                            left = time.perf_counter()
                        added.append(1e6 * bench.beyond_the_step(asked, entered)[0])
                        resumed.append(1e3 * (bench.clock.first_after(left, WAIT) - left))
                    if len(manager.batch_processor.scheduler.waiting_requests) < waiting:
                        raise RuntimeError(f"scaling case, {impl}: the waiting requests did not stay waiting")
                beyond.add(impl, added)
                resume.add(impl, resumed)
                group.add(impl, [1e6 * d for d in quiet[2:]])
        rows += [beyond, resume, group]
    rows += _ranks(bench, reps, quick)
    return rows


def _ranks(bench: Bench, reps: int, quick: bool) -> list[Row]:
    from ...testing import tiny_llama

    n = 8 if quick else 20
    model = tiny_llama("cpu", bench.args.seed, vocab_size=256, hidden_size=128, intermediate_size=256,
                       num_key_value_heads=4, max_position_embeddings=4096)  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp, "ckpt")
        model.save_pretrained(ckpt)
        for world in RANKS:
            entry = Row("10", f"TP={world}: pause entry", "ms", note="all ranks", scale=("ranks", world))
            iteration = Row("10", f"TP={world}: loop iteration", "ms", note="all ranks", scale=("ranks", world))
            for rep in range(max(1, reps // 2)):
                for impl in order(rep):
                    records = run_group(ckpt, impl, world, n, Path(tmp, f"{impl}-{world}-{rep}"))
                    entry.add(impl, [x for r in records for x in r["entries_ms"]])
                    iteration.add(impl, [x for r in records for x in r["iterations_ms"]])
            per = {impl: statistics.median(entry.samples[impl]) / statistics.median(iteration.samples[impl])
                   for impl in IMPLS}  # fmt: skip
            entry.note = "p50 in iterations: " + ", ".join(f"{impl} {v:.2f}" for impl, v in per.items())
            rows += [entry, iteration]
    return rows
