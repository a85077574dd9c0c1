"""Trace scenarios on transformers' real loop, each trace validated by TLC: ``nox -s traces -- --real``.

A campaign runs the TP=2 plans of :mod:`cbpause.apps.scenarios.tp` (two processes over gloo), then single-rank
scenarios in this process, each a few episodes of :mod:`cbpause.apps.scenarios.episodes` on a tiny random Llama
with requests flowing, chosen at random but steered toward the transitions of one rank that no trace has
taken yet.  Every trace is validated against ``tla/PauseProtocol.tla``; every request must have had exactly
one terminal output, whose weight and KV labels keep R-VERSIONS and R-KV-VERSIONS (the managers have
``max_staleness=1``, and updating holders set new versions).  The run ends with the coverage of the spec's actions
and transitions, and one line::

    traces: real=N tp2=M validated=N rejected=0 steps=S

It exits 1 if a trace was rejected, a request was lost or duplicated, a scenario failed, or the traces did not
take every action of the spec and 90 % of its transitions of one rank.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...core.recorder import TraceRecorder
from ...testing import HANG_S
from ...tlc.manifest import default_tla_dir
from ...tlc.traces import Trace, TraceResult, describe_rejection, validate
from .coverage import Coverage
from .episodes import EPISODES, RealRank, quiet_logs
from .tp import TP_PLANS, load_group_trace, tp_worker

__all__ = ["main"]

COVERAGE_TARGET = 0.9

# The covering subset that CI runs (--real --covering, tests/test_sessions.py): plans chosen, not drawn, so that
# together they take every action of the spec, at TP=2 and on one rank, with a kill plan whose dead peer meets
# the driver's payload in transit (kill_payload).
COVERING_TP = ("pauses", "peer_never", "kill_payload")
COVERING_SINGLE = (
    (("holders", None), ("chain", None), ("mode_pause", "drain"), ("stop_at", "window")),
    (("skip_window", None), ("fatal_at", "body"), ("holder_dies", "inside")),
    (("interrupt_at", "read"), ("timeout_at", "decided"), ("fail_at", "decided")),
    (("holder_dies", "stopped"), ("request_at", "step"), ("mode_pause", "abort"), ("holder_dies", "draining")),
)


def choose_plan(rng: random.Random, coverage: Coverage, size: int) -> list[tuple[str, Any]]:
    """``size`` episodes (with their phase), each drawn with a weight that grows with the transitions it is there
    to take and no trace took yet."""
    candidates = [(name, phase) for name, (_, phases, _) in EPISODES.items() for phase in phases]
    missing = coverage.missing
    weights = [1 + 20 * len(EPISODES[name][2](phase) & missing) for name, phase in candidates]
    return [candidates[i] for i in rng.choices(range(len(candidates)), weights=weights, k=size)]


def run_single(model: Any, probe: Any, plan: list[tuple[str, Any]], seed: int) -> tuple[Trace, dict]:
    """One single-rank scenario: the plan's episodes on a fresh manager; its trace and what happened."""
    recorder = TraceRecorder()
    rank = RealRank(model, probe, recorder, traffic=True, seed=seed).start()
    info: dict = {"plan": plan, "errors": []}
    try:
        probe.wait_steps(2, rank.bound)
        for name, phase in plan:
            EPISODES[name][0](rank, phase)
            rank.settle()
    except Exception as error:  # noqa: BLE001 - reported; the trace so far is still validated
        info["errors"].append(f"{type(error).__name__}: {error}")
    probe.hold = probe.fail_with = probe.call_next = None
    try:
        info["lost"], info["duplicated"] = rank.finish()
        info["errors"] += [f"version labels: {fault}" for fault in rank.traffic.ledger.label_faults[:3]]
    except TimeoutError as error:
        info["errors"].append(f"HANG: {error}")
        info["lost"] = info["duplicated"] = 0
    return recorder, info


def run_tp(plan: str, checkpoint: str, seed: int, workdir: Path, deadline: float = HANG_S) -> tuple[Trace, dict]:
    """One TP=2 scenario in two spawned processes; the group's merged trace and what happened.  ``deadline``: for the
    group, loading torch and the model included (a hang, not slowness)."""
    from ...testing import free_port, spawn_ranks

    outdir = workdir / f"tp-{plan}-{seed}"
    outdir.mkdir(parents=True)
    hung = spawn_ranks(tp_worker, (2, free_port(), checkpoint, plan, seed, str(outdir)), 2, deadline)
    trace, info = load_group_trace(outdir, 2)
    info["plan"] = plan
    if hung:
        info["errors"].append(f"ranks {hung} still running after {deadline} s (a hang)")
    return trace, info


class Campaign:
    """Runs the scenarios, validates their traces, keeps the figures."""

    def __init__(self, tla_dir: Path, workdir: Path):
        self.tla_dir, self.workdir = tla_dir, workdir
        self.coverage = Coverage()
        self.validated = self.rejected = self.steps = self.tp2 = self.real = 0
        self.labels = 0  # label logs accepted against RequestVersions (a rejected one is a problem)
        self.problems: list[str] = []

    def check(self, trace: Any, info: dict, name: str, n_ranks: int) -> None:
        result: TraceResult = validate(trace, self.tla_dir, self.workdir / f"v{self.validated + self.rejected}")
        self.steps += result.steps
        if result.accepted:
            self.validated += 1
            self.coverage.add(trace.events, n_ranks)
        else:
            self.rejected += 1
            self.problems.append(f"REJECTED {name} ({info['plan']}): matched {result.matched} of {result.steps}\n"
                                 + describe_rejection(trace, result))  # fmt: skip
        if info.get("lost") or info.get("duplicated"):
            self.problems.append(f"{name}: lost={info['lost']} duplicated={info['duplicated']}")
        self.problems += [f"{name} ({info['plan']}): {e}" for e in info["errors"]]

    def tp_scenario(self, plan: str, checkpoint: str, seed: int, name: str) -> dict:
        """Run TP=2 plan ``plan`` on ``checkpoint``, validate its trace, count it; what happened."""
        trace, info = run_tp(plan, checkpoint, seed, self.workdir)
        self.tp2 += 1
        self.real += 1
        self.check(trace, info, name, 2)
        return info

    def single_scenario(self, model: Any, probe: Any, plan: Sequence[tuple[str, Any]], seed: int, name: str) -> None:
        """Run a single-rank plan on ``model``, validate its trace, count it."""
        trace, info = run_single(model, probe, list(plan), seed)
        self.real += 1
        self.check(trace, info, name, 1)

    def label_scenario(self, model: Any, probe: Any) -> None:
        """The labels scenario (:mod:`cbpause.apps.scenarios.labels`): its label log validated against
        RequestVersions."""
        from ...tlc.label_traces import label_log
        from ...tlc.label_traces import validate as validate_labels
        from .labels import TOKENS, run_labelled

        try:
            recorder, versions = run_labelled(model, probe)
        except Exception as error:  # noqa: BLE001 - reported as the campaign's problem
            self.problems.append(f"labels: {type(error).__name__}: {error}")
            return
        result = validate_labels(label_log(recorder), self.tla_dir, TOKENS, self.workdir / "labels",
                                 max_staleness=versions.max_staleness, on_stale=versions.on_stale,
                                 max_restarts=versions.max_stale_restarts)  # fmt: skip
        if result.accepted:
            self.labels += 1
        else:
            self.problems.append(f"REJECTED labels: {result.violated or 'no step of RequestVersions matches'} "
                                 f"(about record {result.matched} of {result.steps})")  # fmt: skip

    def line(self) -> str:
        return (f"traces: real={self.real} tp2={self.tp2} validated={self.validated} rejected={self.rejected} "
                f"steps={self.steps} labels={self.labels}")  # fmt: skip


def checkout() -> str:
    """The commit of the code about to run (``with uncommitted changes`` if tracked files differ), and when."""
    import datetime
    import subprocess

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " with uncommitted changes"
    return f"commit {commit}, {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}"


def record(path: Path, options: str, started: str, campaign: Campaign, closing: str) -> None:
    """Write what a run measured, with the commit it ran (``started``, :func:`checkout` at its start), for the docs
    to include: the figures there come from a run, not from a hand."""
    lines = [f"python -m cbpause.apps.scenarios {options}", f"{started}, {os.cpu_count()} cores",
             *campaign.problems, campaign.coverage.report(), closing]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _model(workdir: Path, seed: int) -> tuple[Any, str]:
    """The tiny random model of a campaign, and the checkpoint its TP=2 ranks load."""
    from ...testing import tiny_llama

    model = tiny_llama("cpu", seed)
    checkpoint = str(workdir / "ckpt")
    model.save_pretrained(checkpoint)
    return model, checkpoint


def _probed(model: Any) -> Any:
    from ...testing import ForwardProbe

    probe = ForwardProbe()
    probe.attach(model)
    return probe


def repeat_plans(args: argparse.Namespace, rng: random.Random, began: float) -> int:
    """``--plans P --repeat N``: the TP=2 plans matching ``P``, each ``N`` times, every trace validated; one line per
    plan.  Exits 1 on any lost or duplicated request, rejected trace, hang or scenario error."""
    plans = [plan for plan in TP_PLANS if fnmatch.fnmatchcase(plan, args.plans)]
    if not plans:
        print(f"traces: no TP=2 plan matches {args.plans!r} (plans: {', '.join(TP_PLANS)})")
        return 2
    per_plan: dict[str, collections.Counter] = {plan: collections.Counter() for plan in plans}
    with tempfile.TemporaryDirectory(prefix="cbpause-real-traces-") as tmp:
        campaign = Campaign(args.tla_dir or default_tla_dir(), Path(tmp))
        _, checkpoint = _model(Path(tmp), rng.randrange(1000))
        for n in range(args.repeat):
            for plan in plans:
                rejected, problems = campaign.rejected, len(campaign.problems)
                info = campaign.tp_scenario(plan, checkpoint, rng.randrange(2**31), f"tp2 {plan} #{n + 1}")
                counts = per_plan[plan]
                counts["runs"] += 1
                counts["validated"] += campaign.rejected == rejected
                counts["lost"] += info.get("lost", 0)
                counts["duplicated"] += info.get("duplicated", 0)
                counts["problems"] += len(campaign.problems) - problems
            print(f"  round {n + 1}/{args.repeat}: {campaign.line()} ({time.monotonic() - began:.0f} s)", flush=True)
    for problem in campaign.problems:
        print(problem)
    for plan, c in per_plan.items():
        print(f"{plan}: runs={c['runs']} validated={c['validated']} lost={c['lost']} duplicated={c['duplicated']} "
              f"problems={c['problems']}")  # fmt: skip
    print(f"{campaign.line()} seconds={time.monotonic() - began:.0f}")
    if any("HANG" in problem or "still running" in problem for problem in campaign.problems):
        os._exit(1)
    return 1 if campaign.rejected or campaign.problems else 0


def covering(tla_dir: Path, workdir: Path, seed: int) -> Campaign:
    """The covering subset: :data:`COVERING_TP` at TP=2 and :data:`COVERING_SINGLE` on one rank, every trace
    validated; the campaign's figures (``coverage``, ``problems``, ``rejected``) say how it went."""
    quiet_logs()
    rng = random.Random(seed)
    campaign = Campaign(tla_dir, workdir)
    model, checkpoint = _model(workdir, seed % 1000)
    for plan in COVERING_TP:
        campaign.tp_scenario(plan, checkpoint, rng.randrange(2**31), f"tp2 {plan}")
    probe = _probed(model)
    for n, plan in enumerate(COVERING_SINGLE):
        campaign.single_scenario(model, probe, plan, rng.randrange(2**31), f"single {n}")
    campaign.label_scenario(model, probe)
    return campaign


def covering_main(args: argparse.Namespace, seed: int) -> int:
    """``--real --covering``: the covering subset (what CI runs of this session).

    Exits 1 unless every trace is accepted, nothing is lost, and every action of the spec is taken (the
    transitions' 90 % is the full campaign's)."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cbpause-real-traces-") as tmp:
        campaign = covering(args.tla_dir or default_tla_dir(), Path(tmp), seed)
    _report(campaign, began)
    return _verdict(campaign, target=0.0, every_trace_validated=True)


def _report(campaign: Campaign, began: float) -> str:
    """Print a campaign's problems, its coverage and its closing line; returns the closing line."""
    for problem in campaign.problems:
        print(problem)
    closing = f"{campaign.line()} seconds={time.monotonic() - began:.0f}"
    print(campaign.coverage.report())
    print(closing)
    return closing


def _verdict(campaign: Campaign, *, target: float, every_trace_validated: bool = False) -> int:
    """The exit status: 1 on a rejected trace, a problem, an action of the spec not taken, the transitions' coverage
    under ``target`` or (``every_trace_validated``) a real trace not validated; a hang exits the process at once."""
    _, unseen = campaign.coverage.actions()
    covered = not unseen and campaign.coverage.fraction() >= target
    validated = not every_trace_validated or campaign.validated == campaign.real
    code = 1 if campaign.rejected or campaign.problems or not covered or not validated or not campaign.labels else 0
    if any("HANG" in problem for problem in campaign.problems):
        os._exit(code)  # a loop thread still parked would hold the interpreter's exit
    return code


def main(args: argparse.Namespace) -> int:
    """A campaign of ``args.count`` scenarios (at least the TP=2 plans), from ``args.seed``."""
    quiet_logs()
    master = args.seed if args.seed is not None else random.randrange(2**32)
    rng = random.Random(master)
    print(f"traces: real loop, seed={master} (--seed {master} reproduces the plans)", flush=True)
    started = checkout() if args.record is not None else ""
    if args.plans is not None:
        return repeat_plans(args, rng, time.monotonic())
    if args.covering:
        return covering_main(args, master)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cbpause-real-traces-") as tmp:
        campaign = Campaign(args.tla_dir or default_tla_dir(), Path(tmp))
        model, checkpoint = _model(Path(tmp), master % 1000)
        for plan in TP_PLANS[: len(TP_PLANS) if args.tp is None else max(args.tp, 0)]:
            campaign.tp_scenario(plan, checkpoint, rng.randrange(2**31), f"tp2 {plan}")
        probe = _probed(model)
        for n in range(max(args.count - campaign.tp2, 0)):
            plan = choose_plan(rng, campaign.coverage, 3)
            campaign.single_scenario(model, probe, plan, rng.randrange(2**31), f"single {n}")
            if (n + 1) % 10 == 0:
                print(f"  {campaign.line()} ({time.monotonic() - began:.0f} s)", flush=True)
        campaign.label_scenario(model, probe)
    closing = _report(campaign, began)
    if args.record is not None:
        record(args.record, f"--real --seed {master} --count {args.count}", started, campaign, closing)
    return _verdict(campaign, target=COVERAGE_TARGET)
