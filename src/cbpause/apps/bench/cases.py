"""The benchmark's cases: what each measures, for both implementations, interleaved.

Cases 1-6 and 8; case 7 (TP=2) is in :mod:`cbpause.apps.bench.tp`.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import threading
import time
import timeit
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...testing import percentile
from .harness import IMPLS, WAIT, Bench, Row, order, pause

if TYPE_CHECKING:
    from ...testing import ForwardProbe


def case_overhead(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 1: what the loop pays every iteration for being pausable, no pause pending (ns/iteration).

    Each implementation makes the calls its loop makes at TP=1 with work to do, on a thread that is not the
    main thread, as the loop's is: upstream's ``_update_tp_group_state`` (``local_status``,
    ``is_pause_requested``, ``update_with_tp_status``, ``tp_status``); cbpause's integration
    (``observe``, ``all_reduce``, ``no_pause``, ``start_step``, ``end_step``: every step recorded in the
    state, ExclusionInv checked where the forward step starts).  cbpause runs as shipped: trace recording off.
    A second row times cbpause's drop-in API under upstream's calls, as a manager written for upstream's
    class would drive it.
    """
    from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus

    from ...core.dropin import PauseProtocol

    def upstream_calls(status) -> Callable[[], None]:
        def one():
            local_status = status.local_status
            status.is_pause_requested()
            status.update_with_tp_status(local_status)
            if status.tp_status == status.HARD_STOP:
                raise AssertionError("unexpected stop")

        return one

    def integration_calls(status: PauseProtocol) -> Callable[[], None]:
        def one():
            tp_status, tp_pause = status.observe()  # (the all-reduce of one rank returns what it was given)
            status.all_reduce(tp_status, tp_pause)
            if tp_status == status.HARD_STOP or tp_pause:
                raise AssertionError("unexpected stop or pause")
            status.no_pause()
            status.start_step()
            status.end_step()

        return one

    n = 20_000 if quick else 200_000
    rows = [
        Row("1", "per-iteration checks", "ns", note="each loop's own calls; cbpause with trace recording off"),
        Row("1b", "per-iteration checks, drop-in", "ns", note="cbpause's drop-in API under upstream's calls"),
    ]
    loops = [
        (rows[0], "upstream", upstream_calls(BackgroundThreadStatus())),
        (rows[0], "cbpause", integration_calls(PauseProtocol())),
        (rows[1], "upstream", upstream_calls(BackgroundThreadStatus())),
        (rows[1], "cbpause", upstream_calls(PauseProtocol())),
    ]

    def measure() -> None:
        for rep in range(reps):
            for row, name, one in loops if rep % 2 == 0 else loops[::-1]:
                row.reps.setdefault(name, []).append(timeit.timeit(one, number=n) / n * 1e9)

    thread = threading.Thread(target=measure, name="bench-loop")  # off the main thread, as the real loop
    thread.start()
    thread.join()
    return rows


def case_entry_and_resume(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Cases 2 and 3: pause-entry latency (busy and idle loop) and resume latency, in ms."""
    n = 15 if quick else 60
    busy = Row("2", "pause entry, busy loop", "ms")
    idle = Row("2", "pause entry, idle loop", "ms")
    resume = Row("3", "resume (last out to next step)", "ms")
    step = Row("2", "loop iteration (step to step)", "ms", note="a busy loop's forward starts, no pause between")
    beyond_busy = Row("2", "entry beyond the step in flight, busy", "us",
                      note="inside minus the next group step's start: what each protocol adds to the physical bound")
    beyond_idle = Row("2", "entry beyond the step in flight, idle", "us", note="the same on an idle loop (its wake-up "
                      "from the idle wait is the step in flight)")  # fmt: skip
    forward_rest = Row("2", "rest of the forward step in flight, busy", "ms", note="request to the end of the forward "
                       "step it landed in (the loop then updates the batch before its group step)")  # fmt: skip

    def beyond(row: Row, impl: str, pairs: list[tuple[float, float]], rest: Row | None = None) -> None:
        split = [bench.beyond_the_step(asked, entered) for asked, entered in pairs]
        row.add(impl, [1e6 * b for b, _ in split])
        if rest is not None:
            rest.add(impl, [1e3 * f for _, f in split if f is not None])

    for rep in range(reps):
        for impl in order(rep):
            with bench.running(impl, busy=True) as manager:
                times = [1e3 * x for x in bench.clock.step_times(40, WAIT)]
                step.add(impl, times)
                entries, resumes, pairs = [], [], []
                for _ in range(n):
                    bench.clock.wait_steps(2, WAIT)
                    asked = time.perf_counter()
                    with pause(manager, impl):
                        entered = time.perf_counter()
                        entries.append(entered - asked)
                        pairs.append((asked, entered))
                        left = time.perf_counter()
                    resumes.append(bench.clock.first_after(left, WAIT) - left)
                beyond(beyond_busy, impl, pairs, forward_rest)
                busy.add(impl, [1e3 * x for x in entries])
                resume.add(impl, [1e3 * x for x in resumes])
        _idle_alternating(bench, n, idle, beyond_idle, beyond)
    step_ms = statistics.median(step.samples["upstream"] + step.samples["cbpause"])
    for row in (busy, idle):
        row.note = "p99 / median iteration ({:.2f} ms): upstream {:.2f}, cbpause {:.2f}".format(
            step_ms, *(percentile(row.samples[i], 99) / step_ms for i in IMPLS)
        )
    busy.note += f"; target p99 <= iteration + 1 ms = {step_ms + 1:.2f} ms"
    idle.note += "; target p99 <= 1 ms"
    for row in (beyond_busy, beyond_idle):
        row.note += "; target for cbpause p50 < 50 us, p99 < 200 us: p50 {:.0f}, p99 {:.0f}".format(
            percentile(row.samples["cbpause"], 50), percentile(row.samples["cbpause"], 99)
        )
    return [busy, idle, resume, step, beyond_busy, beyond_idle, forward_rest]


def _idle_alternating(bench: Bench, n: int, idle: Row, beyond_idle: Row, beyond) -> None:
    """One repetition of the idle loop's entry: both loops run at once, idle, and are paused in turn, pause by
    pause (upstream first on even pauses), so that a drift of the machine weighs on both alike (issue 27: measured
    one loop after the other, the ratio moved 0.5-3.4 between repetitions)."""
    managers, steps = {}, {}
    with contextlib.ExitStack() as stack:
        for impl in IMPLS:
            bench.group_steps = steps[impl] = []  # each loop's group steps, for the split beyond the step in flight
            managers[impl] = stack.enter_context(bench.running(impl, busy=False))
        entries: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        pairs: dict[str, list[tuple[float, float]]] = {impl: [] for impl in IMPLS}
        for k in range(2 * n):
            impl = IMPLS[(k + k // 2) % 2]  # ABBA, pause by pause
            time.sleep(0.005)  # let the loop get back to its idle wait: the case is an idle loop
            asked = time.perf_counter()
            with pause(managers[impl], impl):
                entered = time.perf_counter()
            entries[impl].append(entered - asked)
            pairs[impl].append((asked, entered))
    for impl in IMPLS:
        bench.group_steps = steps[impl]
        beyond(beyond_idle, impl, pairs[impl])
        idle.add(impl, [1e3 * x for x in entries[impl]])
    bench.group_steps = []


def case_contention(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 4: k threads pausing concurrently on a busy loop: pauses per second."""
    rows = []
    for k in (1, 4, 16, 64):
        row = Row("4", f"{k} threads pausing", "pauses/s", higher_is_better=True)
        # Enough pauses that a measurement lasts well over the scheduler's noise (a few hundred ms).
        per_thread = max(4, (128 if quick else 1024) // k)
        for rep in range(reps):
            for impl in order(rep):
                with bench.running(impl, busy=True) as manager:
                    barrier = threading.Barrier(k + 1)
                    errors: list[BaseException] = []

                    def holder(barrier=barrier, per_thread=per_thread, impl=impl, errors=errors, manager=manager):
                        try:
                            barrier.wait(WAIT)
                            for _ in range(per_thread):
                                with pause(manager, impl):
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


def _next_steps(clock: ForwardProbe, updates: list[tuple[float, float]]) -> list[float]:
    """For each update (decided at, done at), the time from its decision to the first forward step that
    starts after it is done, i.e. with the new weights (updates with no such step are dropped)."""
    times = list(clock.times)
    firsts = [(decided, bisect.bisect_right(times, done)) for decided, done in updates]
    return [times[i] - decided for decided, i in firsts if i < len(times)]


def _generate(
    bench: Bench, impl: str, n: int, max_new: int, every: int | None, update=None, mode: str = "keep"
) -> tuple[float, list]:
    """Serve ``n`` requests; with ``every``, a trainer pauses every ``every`` steps in ``mode`` (and runs
    ``update``).  An aborted request (mode abort) is resubmitted with the tokens it has, for the rest.

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
                with pause(manager, impl, mode):
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
    tokens, owed = 0, dict.fromkeys(ids, max_new)  # request id -> tokens it still owes
    try:
        while owed:
            out = manager.get_result(timeout=WAIT)
            if out is None:
                raise RuntimeError(f"{impl}: a request did not come back")
            got = list(out.generated_tokens)
            tokens += len(got)
            want = owed.pop(out.request_id)
            if out.error and mode == "abort" and len(got) < want:  # aborted by a pause: resubmit the rest
                owed[manager.add_request(list(out.prompt_ids) + got, max_new_tokens=want - len(got))] = want - len(got)
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
        for rep in range(reps):
            for impl in order(rep):
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
    next_update = bench.clock.forwards + every
    try:
        while done < n:
            if time.perf_counter() > deadline:
                raise RuntimeError("stop/restart case: requests did not come back")
            if made < updates and bench.clock.forwards >= next_update:
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
                next_update = bench.clock.forwards + every
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
    for rep in range(reps):
        for impl in order(rep):
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


def case_tlc(quick: bool) -> list[dict]:
    """Case 8: the TLC models through the runner: distinct states, depth, seconds, states per minute."""
    from ... import tlc

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
        run = tlc.run_model(model, tla_dir).run
        out.append({
            "model": model.name, "expected": model.expect, "result": run.outcome,
            "distinct": run.distinct_states, "depth": run.depth, "seconds": round(run.seconds, 1),
            "states_per_min": round(run.states_per_minute or 0),
        })  # fmt: skip
    return out
