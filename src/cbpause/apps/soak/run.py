"""The soak's run: the loop, its traffic and watchdog, the choice of episodes, the figures and the last line."""


from __future__ import annotations

import argparse
import functools
import itertools
import logging
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ...testing import HANG_S, Traffic, Watchdog
from . import faults, pauses

__all__ = ["EACH", "Soak", "Tally", "main", "parse_args", "run", "summary_line"]

# The kinds of event (figures of the last line) that ``--each`` goes on for until each has happened.
EACH = "pauses interrupts timeouts stops errors_injected misuse requests deaths collected handovers stops_with_timeout"


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def wrong(self, what: str) -> None:
        with self.lock:
            self.unexpected.append(what)


# ------------------------------------------------------------------------------------------------- soak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.soak", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None, help="how long (default 10)")
    g.add_argument("--seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="replays the sequence of actions (printed); thread "
                   "timing is the machine's")  # fmt: skip
    p.add_argument("--bound", type=float, default=HANG_S, help="watchdog bound in seconds: a hang (default 300)")
    p.add_argument("--each", action="store_true", help="go on past the duration until every kind of event happened")
    p.add_argument("--trace-sample", type=int, default=0, metavar="K", help="record the run and have TLC "
                   "validate K of its traces (default 0)")  # fmt: skip
    p.add_argument("--tla-dir", type=Path, default=None, help="the spec's folder (default: ./tla)")
    args = p.parse_args(argv)
    if args.trace_sample < 0:
        p.error("--trace-sample must be >= 0")
    args.duration = args.seconds if args.seconds is not None else 60 * (10 if args.minutes is None else args.minutes)
    if not args.duration > 0 or not args.bound > 0:
        p.error("the duration and --bound must be > 0")
    args.seed = random.randrange(2**32) if args.seed is None else args.seed
    return args


class Soak:
    """One soak run: the real loop, a feeder and a consumer of requests, and the episodes the main thread takes at
    random, weighted by ``ACTIONS``: a function each, of :mod:`~cbpause.apps.soak.pauses` (holders, chains,
    interrupts, timeouts, stops, handovers) and :mod:`~cbpause.apps.soak.faults` (fatal errors, failed collectives,
    holders that die or are collected, misuse), which takes this object."""

    ACTIONS = {
        "holders": 6, "interrupt": 2, "timeout": 2, "stop": 1, "fatal": 1, "misuse": 3, "death": 2, "collected": 1,
        "handover": 1, "stop_timeout": 1, "collective": 1, "chain": 2,
    }  # fmt: skip
    MODE_CHOICES = ("keep", "keep", "retract", "drain", "abort")  # keep is what most trainers ask
    MAX_NEW, IN_FLIGHT, MAX_STALENESS = 16, 8, 1  # R-STALENESS: a request 2 updates behind restarts
    MAX_STALE_RESTARTS = 1  # ... once: stale again, it ends with the bound's error (the budget, issue 40)

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers.utils import logging as hf_logging

        from ...integrations.sampling import SamplingParams
        from ...integrations.transformers import init_continuous_batching
        from ...integrations.weights import STALE
        from ...testing import ForwardProbe, batching_config, greedy_config, random_sampling, tiny_llama

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # Injected faults and holders that die are expected: quiet for the run, restored after it (run()).
        self._log_levels = {name: logging.getLogger(name).level for name in ("ContinuousBatchingLogger", "cbpause")}
        for name in self._log_levels:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.args, self.torch = args, torch
        self.rng = random.Random(args.seed)
        self.model = tiny_llama("cpu", args.seed)
        self.gen = greedy_config(self.MAX_NEW)
        self.cb = batching_config(num_blocks=4 * self.IN_FLIGHT * 2 + 16)
        self.probe = ForwardProbe()
        self.probe.attach(self.model)
        self._init = init_continuous_batching
        self.stale_error = STALE  # the error a request the staleness bound ended starts with
        self.recorder = None
        if args.trace_sample:
            from ...core.recorder import TraceRecorder

            self.recorder = TraceRecorder()  # the cached manager keeps it across restarts
        self.manager = init_continuous_batching(self.model, self.gen, self.cb, trace=self.recorder,
                                                max_staleness=self.MAX_STALENESS,
                                                max_stale_restarts=self.MAX_STALE_RESTARTS,
                                                per_request_sampling=True)  # R-SAMPLING  # fmt: skip
        self.status = self.manager.background_thread_status
        self.tally = Tally()
        self.traffic = Traffic(
            self.manager, self.model.config.vocab_size, self.MAX_NEW, in_flight=self.IN_FLIGHT, seed=args.seed + 1,
            join_timeout=args.bound, sampling=lambda rng: SamplingParams(**random_sampling(rng)),
        )  # fmt: skip
        self.wd = Watchdog(args.bound, self.traffic.ledger)
        self._versions = itertools.count(1)  # the weight versions updates declare
        self.resume_after_death = 0.0  # the longest time from a holder's death to the release of its hold

    def restart(self) -> None:
        self.wd.requests_expected.clear()
        with self.wd.op("stop before restart"):
            self.manager.stop(block=True, timeout=self.args.bound, keep_for_next_session=True)
        self.manager = self._init(self.model, self.gen, self.cb)  # the cached manager, attention switched back
        with self.wd.op("restart"):
            self.manager.start()
        self.tally.add("restarts")
        self.wd.requests_expected.set()

    def pause_once(self, timeout: float | None = None, update: bool = False, mode: str = "keep") -> str:
        """One pause() call in ``mode``: 'entered' or the exception's type name; an update declares a new version."""
        self.tally.add("pause_calls")
        try:
            pause = self.manager.pause(timeout=timeout if timeout is not None else self.args.bound, mode=mode)
            with self.wd.op("pause"), pause:
                self.tally.add("pauses")
                self.tally.add(f"pauses_{mode}")
                if update:
                    with self.torch.no_grad():
                        for p in self.model.parameters():
                            p.mul_(1.0)  # an in-place write of every weight; keeps generation meaningful
                    self.manager.set_weight_version(next(self._versions))  # R-VERSIONS: a new version each time
                    self.tally.add("versions_set")
            return "entered"
        except (RuntimeError, TimeoutError) as error:
            self.tally.add("pause_raised")
            return type(error).__name__

    def hold_step(self) -> threading.Event | None:
        """Hold the loop inside its next forward step; the release event, or None if the loop is idle."""
        reached, release = self.probe.hold_next()
        if reached.wait(1.0):
            return release
        self.probe.hold = None
        if reached.is_set():
            return release
        release.set()  # should the loop have taken the hold just now, it goes on at once (it would wait for HANG_S)
        return None

    def requested(self) -> threading.Event:
        """An event that the next pause() sets once its request is in (the loop is held: it clears nothing)."""
        event = self.manager._wake_up_loop
        event.clear()
        return event

    # ------------------------------------------------------------------------------------- actions


    def _run_all(self, targets: list, bound: float, hang: str) -> None:
        """Run each of ``targets`` on a thread of its own and join them, each within ``bound`` seconds."""
        threads = [threading.Thread(target=target) for target in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(bound)
        if any(t.is_alive() for t in threads):
            self.wd.hang(hang)

















    def run(self) -> dict:
        args, wd, tally = self.args, self.wd, self.tally
        actions = [functools.partial(EPISODES[name], self) for name in self.ACTIONS]
        restarts_at_cut = 0
        started = time.monotonic()
        end = started + args.duration  # and on, however long the actions take, until the cuts (and --each) are done
        # With --trace-sample K, at least one restart in each K+1-th of the run, so that there are K+1 traces.
        cuts = [started + args.duration * (j + 1) / (args.trace_sample + 1) for j in range(args.trace_sample)]
        wd.thread.start()
        self.manager.start()
        wd.requests_expected.set()
        self.traffic.start()
        try:
            while not wd.failed.is_set() and (time.monotonic() < end or cuts or self.unseen(end + args.bound)):
                if cuts and time.monotonic() >= cuts[0]:
                    cuts.pop(0)
                    if tally.counts["restarts"] == restarts_at_cut:
                        pauses.stop(self)
                    restarts_at_cut = tally.counts["restarts"]
                    continue
                self.rng.choices(actions, weights=list(self.ACTIONS.values()))[0]()
        finally:
            self.traffic.stop_feeding()
            wd.requests_expected.clear()
            with wd.op("final flush stop"):
                self.manager.stop(block=True, timeout=args.bound)
            lost, duplicated = self.traffic.finish()
            wd.stopped.set()
            self.model.destroy_cached_continuous_batching_manager()
            for name, level in self._log_levels.items():
                logging.getLogger(name).setLevel(level)
        c = tally.counts
        torn = [e for e in self.traffic.ledger.errors if "batch processor" in e]
        if torn:
            tally.wrong(f"{len(torn)} requests failed with a torn-down batch processor: {torn[0]}")
        for fault in self.traffic.ledger.label_faults[:3]:
            tally.wrong(f"version labels: {fault}")
        if c["pause_calls"] != c["pauses"] + c["pause_raised"]:
            tally.wrong(f"pause() calls {c['pause_calls']} != entered {c['pauses']} + raised {c['pause_raised']}")
        traced = self.validate_sample() if self.recorder is not None else {}
        return traced | {
            "seed": args.seed, "seconds": round(time.monotonic() - started, 1), "pauses": c["pauses"],
            "interrupts": c["interrupts"], "timeouts": c["timeouts"], "stops": c["stops"],
            "errors_injected": c["errors_injected"], "misuse": c["misuse"], "requests": self.traffic.requests,
            "lost": lost, "duplicated": duplicated, "hangs": len(wd.hangs), "cancelled": self.traffic.ledger.cancelled,
            "restarts": c["restarts"], "unexpected": list(tally.unexpected), "deaths": c["deaths"],
            "collected": c["collected"], "handovers": c["handovers"], "stops_with_timeout": c["stops_with_timeout"],
            "resume_after_death_s": round(self.resume_after_death, 3), "collective_faults": c["collective_faults"],
            "versions": c["versions_set"], "chains": c["chains"], "queued": c["queued"],
            "stale": self.manager.versions.stale,
            "stale_ended": sum(str(e).startswith(self.stale_error) for e in self.traffic.ledger.errors),
            "modes": "/".join(str(c[f"pauses_{m}"]) for m in self.MODE_CHOICES[1:]),
        }  # fmt: skip

    def unseen(self, deadline: float) -> list[str]:
        """With ``--each``: the kinds of event of ``EACH`` that have not happened yet (past ``deadline``, a hang)."""
        counts = dict(self.tally.counts, requests=self.traffic.requests)
        missing = [kind for kind in EACH.split() if self.args.each and not counts.get(kind)]
        if missing and time.monotonic() > deadline:
            self.wd.hang(f"--each: no {', '.join(missing)} by the end of the run and the bound after it")
            return []
        return missing

    def validate_sample(self) -> dict:
        """TLC validates ``--trace-sample`` of the run's traces (cut at its restarts), drawn with the seed."""
        from ...tlc import default_tla_dir
        from ...tlc.traces import validate_sample

        figures, problems = validate_sample(
            self.recorder, self.args.trace_sample, self.args.seed + 2, self.args.tla_dir or default_tla_dir()
        )
        for problem in problems:
            if problem.startswith("REJECTED"):
                print("soak: " + problem)
            else:
                self.tally.wrong(problem)
        return figures


def run(args: argparse.Namespace) -> dict:
    """One soak run (see :class:`Soak`); its figures as a dict."""
    return Soak(args).run()


def summary_line(r: dict) -> str:
    keys = ("seconds pauses modes versions stale stale_ended chains queued interrupts timeouts stops errors_injected "
            "collective_faults misuse deaths collected handovers stops_with_timeout resume_after_death_s requests lost "
            "duplicated hangs").split()  # fmt: skip
    keys += ("traced", "rejected") if "traced" in r else ()
    return "soak: " + " ".join(f"{k}={r[k]}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trace_sample:
        from ...tlc import TLCError, default_tla_dir, find_jar, find_java

        try:  # before the soak, not after it: a run without TLC at the end would be wasted
            find_java(), find_jar()
            args.tla_dir = args.tla_dir or default_tla_dir()
            for needed in ("PauseProtocol.tla", "TracePauseProtocol.tla"):
                if not (args.tla_dir / needed).is_file():
                    raise TLCError(f"no {needed} in {args.tla_dir}")
        except TLCError as error:
            print(f"soak: --trace-sample needs TLC: {error}", file=sys.stderr)
            return 2
    print(f"soak: seed {args.seed} for {args.duration:g} s (reproduce with --seed {args.seed})", flush=True)
    result = run(args)
    print(f"soak: {result['cancelled']} requests cancelled, {result['restarts']} restarts")
    if "traced" in result:
        print(f"soak: {result['traced']} of {result['traces']} traces validated by TLC, {result['trace_steps']} steps, "
              f"actions: {' '.join(result['trace_actions'])}")  # fmt: skip
    for what in result["unexpected"]:
        print(f"soak: UNEXPECTED: {what}")
    print(summary_line(result))
    bad = result["lost"] or result["duplicated"] or result["hangs"] or result["unexpected"] or result.get("rejected")
    return 1 if bad else 0


# Every episode, by name (Soak.ACTIONS weighs them).
EPISODES = {**pauses.EPISODES, **faults.EPISODES}
