"""Where a resume's time goes, upstream's loop beside cbpause's (issue 38, docs/benchmarks.md).

A resume is case 3 of the bench: from the last holder's exit to the loop's next forward step.  Split here, per
pause, into: the holder's exit to the end of the loop's window (``wake``), to the end of the group step (``to
group end``: for cbpause, the barrier and the forgetting of shared prefixes, D6; since issue 38 the model check
runs once the forward step is launched, outside the resume), to the end of ``prepare_next_batch`` (the scheduler's
batch), to the forward step.  Medians in microseconds over 3 interleaved repetitions of 60 pauses on a busy loop.
``--no-check`` and ``--no-forget`` replace the model check and the forgetting with no-ops (to see their share;
never in production)::

    python scripts/resume_breakdown.py [--no-check] [--no-forget]
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time

from cbpause.apps.bench.harness import WAIT, Bench, pause
from cbpause.integrations import weights

PHASES = ("wake", "to group end", "to batch ready", "to forward")


def _stamped(owner: object, name: str, ends: list[float]) -> None:
    original = getattr(owner, name)

    def stamped(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            ends.append(time.perf_counter())

    setattr(owner, name, stamped)


def _after(times: list[float], t: float) -> float | None:
    i = bisect.bisect_left(times, t)
    return times[i] if i < len(times) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-forget", action="store_true")
    parser.add_argument("--pauses", type=int, default=60)
    args = parser.parse_args()
    if args.no_check:
        weights.check_model_unchanged = lambda *a, **k: None
    if args.no_forget:  # (the loop reads its verdict as the window opens, and forgets only where it says to)
        weights.nothing_to_forget = lambda *a, **k: True
        weights.forget_shared_prefixes = lambda *a, **k: None
    bench = Bench(argparse.Namespace(device="cpu", seed=0))
    figures: dict[str, dict[str, list[float]]] = {}
    for rep in range(3):
        for impl in ("upstream", "cbpause") if rep % 2 == 0 else ("cbpause", "upstream"):
            with bench.running(impl, busy=True) as manager:
                window, group, batch = [], [], []
                status = manager.background_thread_status
                _stamped(status, "pause_window" if impl == "cbpause" else "pause_and_wait", window)
                _stamped(manager.batch_processor, "_update_tp_group_state", group)
                _stamped(manager.batch_processor, "prepare_next_batch", batch)
                phases = figures.setdefault(impl, {p: [] for p in PHASES})
                for _ in range(args.pauses):
                    bench.clock.wait_steps(2, WAIT)
                    with pause(manager, impl):
                        left = time.perf_counter()
                    forward = bench.clock.first_after(left, WAIT)
                    marks = [_after(window, left), _after(group, left), _after(batch, left)]
                    if None in marks or not left <= marks[0] <= marks[1] <= marks[2] <= forward:
                        continue
                    for phase, start, end in zip(PHASES, [left, *marks], [*marks, forward], strict=True):
                        phases[phase].append(end - start)
    for impl, phases in figures.items():
        medians = ", ".join(f"{p} {1e6 * statistics.median(v):.1f}" for p, v in phases.items())
        total = sum(statistics.median(v) for v in phases.values())
        print(f"{impl:9} {medians}; sum {1e6 * total:.1f} us ({len(phases['wake'])} pauses)")


if __name__ == "__main__":
    main()
