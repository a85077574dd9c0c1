"""Model checking the models of the manifest, and ``python -m cbpause.tlc``.

Usage::

    python -m cbpause.tlc                     # the main job's models (what `nox -s tlc` runs)
    python -m cbpause.tlc --suite fast        # every model that finishes in seconds
    python -m cbpause.tlc --suite deep        # the deep models (`nox -s tlc_deep`)
    python -m cbpause.tlc --model PauseProtocol_1r2h --model Upstream_D1
    python -m cbpause.tlc --list

A model expected to fail passes only if TLC still finds that failure: that is the evidence that the
checker catches what matters (the "fails in an interesting way" models of tlaplus/Examples).  A model
expected to pass must also reach the distinct and total state counts the manifest records (a different
count means the model changed), fire every action but those the manifest lists as ``never_fires``
(TLC's ``-coverage``: an action that never fires is a guard that became dead, and safety then holds
vacuously), and break each of its witnesses.  The depth is recorded and shown, not checked: with several
workers TLC's breadth-first search is not level by level, and the depth it reports varies from run to run.

Each model's state space is explored once: its run observes its witnesses (:mod:`~cbpause.tlc.witnesses`), takes
TLC's action coverage and, where the manifest asks (``graph = true``), dumps the state graph that the conformance
check and the documentation's phase diagram read.  With a cache (:mod:`~cbpause.tlc.cache`), the next reader of
the same run (the test suite after the main job, the documentation after the tests) reads it instead of running
TLC again.  Models run ``--jobs`` at a time (default: one per core), their TLC workers sharing the cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from . import witnesses as w
from .cache import Cache, default_cache
from .launcher import TLCError, TLCRun, find_jar, find_java, format_trace, read_output, run_tlc
from .manifest import SUITES, Cfg, Model, default_tla_dir, load_manifest, select

__all__ = ["Result", "format_table", "main", "run_model", "run_models"]


@dataclasses.dataclass
class Result:
    """What one TLC run of a manifest model found.

    For a witness model checked inside its parent's run (``via`` names the parent), ``run`` is the parent's, and
    the outcome is the witness's expected result if that run saw the witness broken, ``ok`` if it did not.
    """

    model: Model
    run: TLCRun
    found: frozenset[str] = frozenset()  # the witnesses the run saw broken (witness observers)
    graph: Path | None = None  # the state graph the run dumped (``graph = true``)
    cached: bool = False  # read from the cache, not run now
    via: str = ""

    @property
    def outcome(self) -> str:
        if self.via:
            name = self.model.witness.partition(":")[2]
            return self.model.expect if name in self.found else "ok"
        return self.run.outcome

    @property
    def matches_expectation(self) -> bool:
        return self.outcome == self.model.expect

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
        if self.via:
            return [] if self.run.outcome == "ok" else [f"{self.via}'s run ended with {self.run.outcome}"]
        return self.count_mismatches() + self.coverage_mismatches()

    @property
    def passed(self) -> bool:
        return self.matches_expectation and not self.mismatches()


def _observed(model: Model) -> list[tuple[str, str]]:
    """The witnesses a run of ``model`` observes, as ``(kind, name)``."""
    return [tuple(expect.split(":", 1)) for expect in model.witnesses]  # type: ignore[misc]


def _observer(model: Model, tla_dir: Path) -> str | None:
    """The text of the observer module a run of ``model`` checks (its witnesses), or None when it observes none;
    ``TLCError`` for a witness written in a form the observer cannot read."""
    observed = _observed(model) if not model.witness else []
    if not observed:
        return None
    source = "".join(p.read_text() for p in sorted(Path(tla_dir).glob("*.tla")))  # where the witnesses are defined
    return w.observer_module(model.module, observed, source)


def run_model(
    model: Model,
    tla_dir: Path,
    *,
    workers: int | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    cache: Cache | None = None,
) -> Result:
    """Run TLC on one model of the manifest (its witnesses observed, its graph dumped where the manifest asks) and
    classify what it found; with ``cache``, a run kept there with the same spec and options is read instead."""
    tla_dir = Path(tla_dir)
    cfg = tla_dir / model.cfg
    if not cfg.is_file():
        raise TLCError(f"model {model.name}: config file {cfg} does not exist")
    text = model.cfg_text(tla_dir)
    properties = Cfg(text).names("PROPERTY")
    observer = _observer(model, tla_dir)
    module = w.OBSERVER if observer else model.module
    if observer:
        text = w.observer_cfg(text)
    options = [*model.options, *(["-nowarning"] if observer else [])]
    single = properties[0] if len(properties) == 1 else None
    key = None
    if cache is not None:
        fixed = ["-workers", str(model.workers)] if model.workers else []
        # The observer's text is in the key: a witness added to or removed from the manifest is another run.
        key = Cache.key(find_jar(), tla_dir, text + "\0" + (observer or ""), model.module + "/" + module,
                        [*options, *fixed], model.graph)  # fmt: skip
        kept = cache.get(key)
        if kept is not None:
            output, seconds, graph = kept
            if on_line is not None:
                on_line(f"read from the cache ({cache.folder / key}): this spec and these options ran already")
            return Result(model, read_output(output, seconds, single), frozenset(w.found(output)), graph, cached=True)
    with tempfile.TemporaryDirectory(prefix=f"cbpause-{model.name}-") as tmp:
        work = Path(tmp)
        for f in tla_dir.glob("*.tla"):  # a private copy: the run adds its own module, and tla/ may be read-only
            shutil.copy(f, work / f.name)
        if observer:
            (work / f"{w.OBSERVER}.tla").write_text(observer)
        (work / "model.cfg").write_text(text)
        dot = work / "graph.dot" if model.graph else None
        run = run_tlc(
            module,
            "model.cfg",
            work,
            dump=dot,
            workers=model.workers or workers or max(1, min(os.cpu_count() or 1, 4)),
            options=options,
            on_line=on_line,
            timeout=timeout,
            single_property=single,
            coverage=model.expect == "ok" and not model.simulated,
        )
        graph = None
        if cache is not None and key is not None and not run.outcome.startswith(("error", "parse", "config")):
            graph = cache.put(key, run.output, run.seconds, dot)
        elif dot is not None and dot.is_file():
            kept_dot = Path(tempfile.mkdtemp(prefix=f"cbpause-graph-{model.name}-")) / "graph.dot"
            shutil.move(dot, kept_dot)
            graph = kept_dot
    return Result(model, run, frozenset(w.found(run.output)), graph)


def run_models(
    models: list[Model],
    tla_dir: Path,
    *,
    jobs: int | None = None,
    workers: int | None = None,
    on_start: Callable[[Model], None] | None = None,
    on_line: Callable[[Model, str], None] | None = None,
    on_result: Callable[[Result], None] | None = None,
    cache: Cache | None = None,
) -> list[Result]:
    """Run ``models``, ``jobs`` at a time, each of its ``workers``; in the order given.  A witness model whose parent
    is among ``models`` is not run: its result is read from the parent's run."""
    cores = os.cpu_count() or 1
    jobs = max(1, jobs or cores)
    workers = workers or max(1, cores // jobs)
    names = {m.name for m in models}
    own = [m for m in models if not (m.parent and m.parent in names)]
    for model in own:  # a witness the observer cannot read is an error before any run, not after the others
        _observer(model, tla_dir)
    results: dict[str, Result] = {}
    lock = threading.Lock()

    def one(model: Model) -> Result:
        if on_start is not None:
            with lock:
                on_start(model)
        line = None if on_line is None else (lambda text, m=model: on_line(m, text))
        result = run_model(model, tla_dir, workers=workers, on_line=line, cache=cache)
        if on_result is not None:
            with lock:
                on_result(result)
        return result

    # The longest first, so that the short ones fill in beside it (the manifest's runtime, mm:ss).
    order = sorted(own, key=lambda m: -_seconds(m.runtime))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for result in pool.map(one, order):
            results[result.model.name] = result
    out = []
    for m in models:
        if m.name in results:
            out.append(results[m.name])
        else:
            parent = results[m.parent]
            out.append(Result(m, parent.run, parent.found, None, parent.cached, via=m.parent))
    return out


def _seconds(runtime: str) -> float:
    minutes, _, seconds = runtime.partition(":")
    try:
        return int(minutes) * 60 + int(seconds) if seconds else 0.0
    except ValueError:
        return 0.0


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
        if r.via:
            figures = ("", "", "", f"in {r.via}", "")
        else:
            figures = (
                "" if r.run.distinct_states is None else f"{r.run.distinct_states:,}",
                "" if r.run.states_generated is None else f"{r.run.states_generated:,}",
                "" if r.run.depth is None else str(r.run.depth),
                f"{r.run.seconds:.1f}" + (" (cached)" if r.cached else ""),
                "" if spm is None else f"{spm:,.0f}",
            )
        rows.append((r.model.name, r.model.expect, r.outcome, *figures, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _report(result: Result) -> None:
    run = result.run
    if result.via:
        return
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
    if result.model.witnesses:
        seen = ", ".join(sorted(result.found)) or "none"
        print(f"   witnesses broken in this run: {seen}")
    if not result.matches_expectation:
        tail = "\n".join(run.output.splitlines()[-15:])
        print(f"   result {run.outcome}, expected {result.model.expect}; TLC's last lines:\n{tail}")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _usable_cache(folder: Path) -> Cache:
    """The cache in ``folder``, made and written to now: a cache that cannot keep a run is an error before TLC runs,
    not after."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise TLCError(f"the cache folder {folder} cannot keep runs: {exc}") from exc
    return Cache(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbpause.tlc", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=(*SUITES, "all"), default=None,
                        help="main (default: the main job), fast (main's and every other model of seconds), deep, all")
    parser.add_argument("--model", action="append", default=[], help="run only this model (repeatable)")
    parser.add_argument("--tla-dir", type=Path, default=None)
    parser.add_argument("--jobs", type=_positive, default=None, help="models checked at once (default: one per core)")
    parser.add_argument("--workers", type=_positive, default=None,
                        help="TLC workers of each (default: cores / jobs; a model whose manifest fixes its workers, "
                             "for a counterexample that must be the same every time, keeps them)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="keep each run in this folder, and read it back when nothing changed (default: the folder "
                             "$CBPAUSE_TLC_CACHE names, if set)")
    parser.add_argument("--fresh", action="store_true",
                        help="run TLC even where the cache has the run, and keep the new run in its place")
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    parser.add_argument("--quiet", action="store_true", help="do not stream TLC's progress")
    args = parser.parse_args(argv)  # fmt: skip
    if args.model and args.suite:
        parser.error("--model and --suite choose the models two ways: give one")
    try:
        tla_dir = args.tla_dir or default_tla_dir()
        models = select(load_manifest(tla_dir), list(dict.fromkeys(args.model)), args.suite or "main")
        if args.list:
            for m in models:
                print(f"{m.name:48} {m.suite:5} {m.expect:44} {m.description}")
            return 0
        find_java()
        find_jar()
        cache = default_cache() if args.cache is None else Cache(args.cache)
        if cache is not None:
            cache = _usable_cache(cache.folder)
        if cache is not None and args.fresh:
            cache.read = False
        start = time.monotonic()

        def started(model: Model) -> None:
            print(f"== {model.name}: {model.module} with {model.cfg} (expect {model.expect})", flush=True)

        def finished(result: Result) -> None:
            print(f"== {result.model.name}: {result.outcome} in {result.run.seconds:.1f} s", flush=True)
            _report(result)

        def line(model: Model, text: str) -> None:
            print(f"   [{model.name}] {text}", flush=True)

        results = run_models(models, tla_dir, jobs=args.jobs, workers=args.workers, on_start=started,
                             on_line=None if args.quiet else line, on_result=finished, cache=cache)  # fmt: skip
    except TLCError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    print()
    seconds = time.monotonic() - start
    if failed:
        print(f"{len(failed)} of {len(results)} models did not give their expected result: "
              + ", ".join(r.model.name for r in failed))  # fmt: skip
        return 1
    print(f"all {len(results)} models gave their expected result ({seconds:.0f} s)")
    return 0
