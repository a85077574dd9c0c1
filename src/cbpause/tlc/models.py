"""Model checking the models of the manifest, and ``python -m cbpause.tlc``.

Usage::

    python -m cbpause.tlc                     # the fast models (what `nox -s tlc` runs)
    python -m cbpause.tlc --suite deep        # the deep models (`nox -s tlc_deep`)
    python -m cbpause.tlc --model PauseProtocol_1r2h --model Upstream_D1
    python -m cbpause.tlc --list

A model expected to fail passes only if TLC still finds that failure: that is the evidence that the
checker catches what matters (the "fails in an interesting way" models of tlaplus/Examples).  A model
expected to pass must also reach the distinct and total state counts the manifest records (a different
count means the model changed), and fire every action but those the manifest lists as ``never_fires``
(TLC's ``-coverage``: an action that never fires is a guard that became dead, and safety then holds
vacuously).  The depth is recorded and shown, not checked: with several workers TLC's
breadth-first search is not level by level, and the depth it reports varies from run to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .launcher import TLCError, TLCRun, find_jar, find_java, format_trace, run_tlc
from .manifest import SUITES, Cfg, Model, default_tla_dir, load_manifest, select

__all__ = ["Result", "format_table", "main", "run_model"]


@dataclasses.dataclass
class Result:
    """What one TLC run of a manifest model found."""

    model: Model
    run: TLCRun

    @property
    def outcome(self) -> str:
        return self.run.outcome

    @property
    def matches_expectation(self) -> bool:
        return self.run.outcome == self.model.expect

    def count_mismatches(self) -> list[str]:
        """The recorded figures this run did not reach (models expected to pass only)."""
        if self.model.expect != "ok" or self.model.simulated:
            return []
        pairs = (
            ("distinct states", self.model.distinct_states, self.run.distinct_states),
            ("total states", self.model.total_states, self.run.states_generated),
        )
        return [f"{what} {got} (manifest: {want})" for what, want, got in pairs if want is not None and want != got]

    def coverage_mismatches(self) -> list[str]:
        """Actions that never fired though the manifest expects them to, or fired though it says they never do
        (models expected to pass only)."""
        if self.model.expect != "ok" or self.run.outcome != "ok" or self.model.simulated:
            return []
        if self.run.coverage is None:
            return ["TLC printed no action coverage"]
        never = set(self.model.never_fires)
        unknown = sorted(never - self.run.coverage.keys())
        dead = sorted(a for a, n in self.run.coverage.items() if n == 0 and a not in never)
        fired = sorted(a for a in never if self.run.coverage.get(a, 0) > 0)
        return (
            [f"no action {a} in the spec" for a in unknown]
            + [f"{a} never fired" for a in dead]
            + [f"{a} fired (never_fires lists it)" for a in fired]
        )

    def mismatches(self) -> list[str]:
        return self.count_mismatches() + self.coverage_mismatches()

    @property
    def passed(self) -> bool:
        return self.matches_expectation and not self.mismatches()


def run_model(
    model: Model,
    tla_dir: Path,
    *,
    workers: int | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> Result:
    """Run TLC on one model of the manifest and classify what it found."""
    cfg = Path(tla_dir) / model.cfg
    if not cfg.is_file():
        raise TLCError(f"model {model.name}: config file {cfg} does not exist")
    text = model.cfg_text(tla_dir)
    properties = Cfg(text).names("PROPERTY")
    with tempfile.TemporaryDirectory(prefix="cbpause-cfg-") as tmp:
        if model.witness:
            cfg = Path(tmp) / f"{model.name}.cfg"
            cfg.write_text(text)
        run = run_tlc(
            model.module,
            str(cfg.resolve()),
            Path(tla_dir),
            workers=workers or max(1, min(os.cpu_count() or 1, 4)),
            options=model.options,
            on_line=on_line,
            timeout=timeout,
            single_property=properties[0] if len(properties) == 1 else None,
            coverage=model.expect == "ok" and not model.simulated,
        )
    return Result(model, run)


def simulation_summary(model: Model, run: TLCRun) -> str:
    """How many behaviours a simulated model's run checked, as its options asked."""
    opts = list(model.options)
    num = next((o.split("=", 1)[1] for o in opts if o.startswith("num=")), "?")
    depth = opts[opts.index("-depth") + 1] if "-depth" in opts[:-1] else "?"
    states = "?" if run.states_generated is None else f"{run.states_generated:,}"
    return f"simulated: {num} behaviours of up to {depth} steps, {states} states checked, no error"


def format_table(results: list[Result]) -> str:
    head = ("model", "expected", "result", "distinct", "total", "depth", "seconds", "states/min", "")
    rows = [head]
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        if r.matches_expectation and r.mismatches():
            verdict = "FAIL: " + "; ".join(r.mismatches())
        spm = r.run.states_per_minute
        rows.append((
            r.model.name,
            r.model.expect,
            r.outcome,
            "" if r.run.distinct_states is None else f"{r.run.distinct_states:,}",
            "" if r.run.states_generated is None else f"{r.run.states_generated:,}",
            "" if r.run.depth is None else str(r.run.depth),
            f"{r.run.seconds:.1f}",
            "" if spm is None else f"{spm:,.0f}",
            verdict,
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _report(result: Result) -> None:
    run = result.run
    if run.outcome in ("parse-error", "config-error", "error"):
        print(f"   {run.outcome}: {run.message}")
        return
    if result.model.simulated and run.outcome == "ok":
        print(f"   {simulation_summary(result.model, run)}")
    if run.trace:
        kind = "expected" if result.matches_expectation else "UNEXPECTED"
        print(f"   {kind} counterexample ({run.outcome}), changed variables only:")
        for line in format_trace(run.trace).splitlines():
            print(f"     {line}")
    if not result.matches_expectation:
        tail = "\n".join(run.output.splitlines()[-15:])
        print(f"   result {run.outcome}, expected {result.model.expect}; TLC's last lines:\n{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbpause.tlc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=(*SUITES, "all"), default="fast")
    parser.add_argument("--model", action="append", default=[], help="run only this model (repeatable)")
    parser.add_argument("--tla-dir", type=Path, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    parser.add_argument("--quiet", action="store_true", help="do not stream TLC's progress")
    args = parser.parse_args(argv)
    try:
        tla_dir = args.tla_dir or default_tla_dir()
        models = select(load_manifest(tla_dir), args.model, args.suite)
        if args.list:
            for m in models:
                print(f"{m.name:48} {m.suite:5} {m.expect:44} {m.description}")
            return 0
        find_java()
        find_jar()
        results = []
        for model in models:
            print(f"== {model.name}: {model.module} with {model.cfg} (expect {model.expect})", flush=True)
            on_line = None if args.quiet else (lambda line, n=model.name: print(f"   [{n}] {line}", flush=True))
            result = run_model(model, tla_dir, workers=args.workers, on_line=on_line)
            results.append(result)
            _report(result)
    except TLCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    print()
    if failed:
        print(f"{len(failed)} of {len(results)} models did not give their expected result: "
              + ", ".join(r.model.name for r in failed))  # fmt: skip
        return 1
    print(f"all {len(results)} models gave their expected result")
    return 0
