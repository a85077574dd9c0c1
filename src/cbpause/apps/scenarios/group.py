"""Random threaded scenarios of ``PauseProtocol`` in one process, recorded and validated with TLC.

Each scenario, from its own seed: 1 to 3 ranks simulated in one process (:class:`cbpause.testing.Group`,
explicit loop API), 0 to 2 holder threads per rank pausing, some with pause timeouts, some asking for
stops; on some runs a fatal error in a forward step, and a real SIGINT delivered to the main thread while
it waits for a pause.  Every thread is joined with a timeout.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

from ...core.dropin import PauseProtocol
from ...core.recorder import TraceRecorder
from ...testing import JOIN_TIMEOUT, Group, call_interrupted
from ...tlc.manifest import default_tla_dir
from ...tlc.traces import TraceResult, describe_rejection, validate

__all__ = ["main", "run_scenario"]


def holder_script(p: PauseProtocol, rng: random.Random, cycles: int) -> None:
    for _ in range(cycles):
        choice = rng.random()
        try:
            if choice < 0.6:
                p.acquire_pause(None, timeout=2.0)
                p.release_pause()
            elif choice < 0.85:
                p.acquire_pause(None, timeout=0)  # enters only if the window is open right now
                p.release_pause()
            elif choice < 0.93:
                p.request_stop(PauseProtocol.FLUSH_AND_STOP, 0)
            else:
                p.request_stop(PauseProtocol.HARD_STOP, 0)
        except (RuntimeError, TimeoutError):
            pass  # the loop is gone, or the pause timed out: both are outcomes the spec allows


def main_thread_interrupted_pause(p: PauseProtocol) -> bool:
    """The main thread waits for a pause and gets a real SIGINT once its request is in; True if interrupted.

    A pause entered before the signal came (or just as it came) is released.
    """
    requested = threading.Event()
    try:
        interrupted = call_interrupted(lambda: p.acquire_pause(requested, timeout=2.0), requested, JOIN_TIMEOUT)
    except (RuntimeError, TimeoutError):
        interrupted = False
    if p.is_pause_requested(local=True):
        p.release_pause()
    return interrupted


def run_scenario(seed: int) -> tuple[TraceRecorder, dict]:
    """Run one random scenario; return its recorder and what happened."""
    rng = random.Random(seed)
    n_ranks = rng.choice([1, 1, 2, 2, 3])
    recorder = TraceRecorder()
    fatal_at = (rng.randrange(n_ranks), rng.randint(2, 20)) if rng.random() < 0.2 else None
    group = Group(
        n_ranks, peer_park_timeout=0.2, trace=recorder, max_iterations=rng.randint(5, 60), fatal_at=fatal_at,
        wait=5.0,
    )  # fmt: skip
    group.start()
    holders = []
    for r in range(n_ranks):
        for k in range(rng.choice([0, 1, 1, 2])):
            script_rng = random.Random(rng.random())
            th = threading.Thread(
                target=holder_script, args=(group.ranks[r], script_rng, rng.randint(1, 6)), daemon=True,
                name=f"holder-{r}-{k}",
            )  # fmt: skip
            holders.append(th)
            th.start()
    interrupted = False
    if rng.random() < 0.3 and threading.current_thread() is threading.main_thread():
        interrupted = main_thread_interrupted_pause(group.ranks[0])
    for th in holders:
        th.join(JOIN_TIMEOUT)
    finished = group.join()
    alive = [th.name for th in holders if th.is_alive()]
    if alive or not finished:
        raise RuntimeError(f"scenario {seed}: threads did not end: holders {alive}, loops finished={finished}")
    return recorder, {"ranks": n_ranks, "fatal": fatal_at is not None, "interrupted": interrupted}


def run_and_validate(seed: int, workdir: Path, tla_dir: Path) -> tuple[TraceResult, TraceRecorder, dict]:
    recorder, info = run_scenario(seed)
    result = validate(recorder, tla_dir, workdir / f"s{seed}", name=f"Trace{seed}")
    return result, recorder, info


def main(args: argparse.Namespace) -> int:
    """Run ``args.count`` scenarios from ``args.seed`` and validate each trace; 1 if any is rejected."""
    tla_dir = args.tla_dir or default_tla_dir()
    master = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"traces: seed={master} (--seed {master} reproduces this run)", flush=True)
    rng = random.Random(master)
    steps = states = rejected = interrupts = fatals = 0
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cbpause-traces-") as tmp:
        for n in range(args.count):
            seed = rng.randrange(2**32)
            result, recorder, info = run_and_validate(seed, Path(tmp), tla_dir)
            steps += result.steps
            states += result.states or 0
            interrupts += info["interrupted"]
            fatals += info["fatal"]
            if not result.accepted:
                rejected += 1
                print(f"REJECTED scenario {seed}: matched {result.matched} of {result.steps} steps")
                print(describe_rejection(recorder, result))
            if (n + 1) % 20 == 0:
                print(f"  {n + 1} traces, {steps} steps, {rejected} rejected", flush=True)
    print(
        f"traces: seed={master} traces={args.count} steps={steps} states={states} interrupts={interrupts} "
        f"fatal_errors={fatals} rejected={rejected} seconds={time.monotonic() - began:.0f}"
    )
    return 1 if rejected else 0
