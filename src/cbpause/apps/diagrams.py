"""Pictures drawn from TLC's output, never by hand: the loop's phase diagram and the defects' sequence diagrams.

* :func:`phase_edges` projects TLC's state graph of one or more models (``-dump dot,actionlabels``, read by
  :func:`~cbpause.tlc.conformance.tlc_graph`) onto one rank's loop phase: a phase is a node, and an edge
  ``read -> reduce`` carries every action that moved some rank's ``phase`` from one to the other in some
  state of the graph.  :func:`phase_dot` writes it for Graphviz, :func:`render_svg` runs ``dot``.
* :func:`sequence_svg` draws a TLC counterexample (:func:`~cbpause.tlc.launcher.parse_trace`) as a sequence
  diagram: one lifeline per thread and rank (the environment, each holder, each rank's loop, each request's
  caller), one arrow per step from the thread that takes it to the one whose state it changes, the TP
  group's collectives as a bar across the loops, and the variables the step changed on the right.

TLC prints an action's name without its arguments (``Interrupt``, not ``Interrupt(1)``); who took a step is
read from which entries of the variables it changed (``hs[1]`` changed: holder 1), with the variables' owners
in :data:`OWNERS`.  The diagrams are therefore as exact as the counterexample: a change to the spec that
changes TLC's trace or graph changes the picture (``tests/test_diagrams.py`` checks it on copies of the spec).
"""

from __future__ import annotations

import dataclasses
import html
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..core.group import HOLDER_ACTIONS
from ..tlc.cache import default_cache
from ..tlc.conformance import Graph, parse_tla_value, tlc_graph
from ..tlc.launcher import format_trace, parse_trace, protocol_action
from ..tlc.manifest import default_tla_dir, load_manifest
from ..tlc.models import run_model

__all__ = [
    "DEFECT_MODELS",
    "FAULT_ACTIONS",
    "OWNERS",
    "PHASE_MODELS",
    "Lifeline",
    "PhaseEdges",
    "SequenceStep",
    "generate",
    "main",
    "phase_dot",
    "phase_edges",
    "phase_table",
    "render_svg",
    "sequence_steps",
    "sequence_svg",
]

# Which thread a variable belongs to: a sequence-valued variable has one entry per holder, rank or request.
# A variable not named here (a model wrapper's ghost variable) is drawn as the loop's.
OWNERS = {
    # PauseProtocol and upstream's model
    "hs": "holder", "hmode": "holder",
    "phase": "loop", "localStatus": "loop", "obsStatus": "loop", "obsPause": "loop", "fatal": "loop",
    "draining": "loop", "count": "loop", "paused": "loop", "closing": "loop",
    "tpStatus": "group", "tpPause": "group",
    "req": "request", "out": "request",
    "restarts": "environment",
    # StopTeardown: the loop, its holder, the thread in stop(), the loop's batch processor, the requests
    "loop": "loop", "holder": "holder", "stopper": "environment", "processor": "loop", "request": "request",
    "delivered": "request",
    # RequestVersions: the trainer holds the weights; the loop the windows and the prefix blocks
    "wv": "holder", "changed": "holder",
    "win": "loop", "windows": "loop", "last": "loop", "prefix": "loop", "drainAsked": "loop",
    "st": "request", "outputs": "request", "kv": "request", "lab": "request", "adm": "request", "aborted": "request",
}  # fmt: skip

# Who takes each action (every other action is the loop's own); the holder actions' actors are those of
# cbpause.core.group.HOLDER_ACTIONS.
_ACTORS = {
    "environment": {"RequestStop", "RecordFatalError", "Crash", "StrayRelease", "Restart", "UpstreamInterrupt",
                    "UpstreamRestart", "StopWaitRunsOut", "StopReturns"}
                   | {a for a, (by, _) in HOLDER_ACTIONS.items() if by == "environment"},
    "holder": {"UpstreamRequestPause", "UpstreamLeavePause", "UpstreamPauseFails", "Update", "Pause", "Resume"}
              | {a for a, (by, _) in HOLDER_ACTIONS.items() if by == "holder"},
    "request": {"Submit", "Retry", "UpstreamAdmit", "UpstreamEnqueue"},
    "group": {"AllReduce", "Barrier", "Broadcast"},
}  # fmt: skip

# Whose state an arrow points at first, by the kind of thread that takes the step.
_TARGET_ORDER = {
    "environment": ("holder", "loop", "request"),
    "holder": ("loop", "request", "holder"),
    "request": ("loop", "request"),
    "loop": ("request", "holder", "loop"),
}
# Calls that reach a loop even when they change only the caller's own state (a holder's reach its rank's).
_CALLS = {"RequestPause", "UpstreamRequestPause", "LeavePause", "UpstreamLeavePause", "RequestStop"}
_KINDS = ("environment", "holder", "loop", "request")


# ------------------------------------------------------------------------------------------ the phases


@dataclasses.dataclass
class PhaseEdges:
    """A state graph projected onto the loop's phases."""

    edges: dict[tuple[str, str], set[str]]  # (phase, next phase) -> the actions that move a rank so
    states: dict[str, int]  # phase -> distinct states in which some rank is in it
    initial: set[str]  # the phases of the initial states
    models: tuple[str, ...] = ()


def _phases(state) -> tuple:
    value = dict(state)["phase"]
    return value if isinstance(value, tuple) else (value,)


def phase_edges(graphs: Iterable[tuple[str, Graph]]) -> PhaseEdges:
    """Every (phase, action, phase) step of any rank in the graphs (named), with the states seen per phase."""
    edges: dict[tuple[str, str], set[str]] = {}
    states: dict[str, int] = {}
    initial: set[str] = set()
    names = []
    for name, graph in graphs:
        names.append(name)
        for s in graph.states:
            for p in set(_phases(s)):
                states[p] = states.get(p, 0) + 1
        for s in graph.init:
            initial.update(_phases(s))
        for s, action, t in graph.edges:
            for before, after in zip(_phases(s), _phases(t), strict=True):
                if before != after:
                    edges.setdefault((before, after), set()).add(action)
    return PhaseEdges(edges, states, initial, tuple(names))


# Steps that only faults, timeouts and restarts take: drawn dashed, and left out of the layout, so that the
# picture's shape is the loop's own iteration.
_NL = "\\n"  # a line break in a Graphviz label
FAULT_ACTIONS = {"FailLoop", "RecordFatalError", "CollectiveTimeout", "PeerParkTimeout", "Crash", "Restart"}


def phase_dot(p: PhaseEdges) -> str:
    """The projected graph in Graphviz's language: one box per phase, one edge per pair of phases (and one
    more, dashed, for the faults' steps between them)."""
    lines = [
        "digraph phases {",
        '  graph [rankdir=TB, fontname="Helvetica", nodesep=0.5, ranksep=0.55, bgcolor="transparent"];',
        '  node [shape=box, style="rounded,filled", fillcolor="#eef3fb", color="#3f6fb5", fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10, color="#555555"];',
    ]
    for phase in sorted(p.states):
        extra = ', penwidth=2.5, fillcolor="#d6e6ff"' if phase in p.initial else ""
        lines.append(f'  "{phase}" [label="{phase}\\n{p.states[phase]:,} states"{extra}];')
    spread: dict[tuple[str, str], list[str]] = {}  # (fault action, target) -> its sources
    for (a, b), actions in sorted(p.edges.items()):
        for x in actions & FAULT_ACTIONS:
            spread.setdefault((x, b), []).append(a)
    fault = 'style=dashed, color="#b03a2e", fontcolor="#b03a2e", constraint=false'
    for (a, b), actions in sorted(p.edges.items()):
        names = sorted(actions - FAULT_ACTIONS)
        if names:
            lines.append(f'  "{a}" -> "{b}" [label="{_NL.join(names)}"];')
        few = sorted(x for x in actions & FAULT_ACTIONS if len(spread[(x, b)]) < 3)
        if few:
            lines.append(f'  "{a}" -> "{b}" [label="{_NL.join(few)}", {fault}];')
    for (x, b), sources in sorted(spread.items()):
        if len(sources) >= 3:  # one arrow from a note, not one from every phase
            note = f"{x}:{b}"
            lines.append(f'  "{note}" [label="{x}\\nfrom {", ".join(sorted(sources))}", shape=note, style=dashed, '
                         'color="#b03a2e", fontcolor="#b03a2e", fontsize=10];')  # fmt: skip
            lines.append(f'  "{note}" -> "{b}" [{fault.replace(", constraint=false", "")}];')
    ends = " ".join(f'"{x}";' for x in ("stopped", "dead") if x in p.states)
    if "read" in p.states:
        lines.append('  { rank=min; "read"; }')
    if ends:
        lines.append(f"  {{ rank=max; {ends} }}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def phase_table(p: PhaseEdges) -> str:
    """The same graph as a Markdown table (the picture's text, for readers and for diffs)."""
    rows = ["| from | to | actions |", "|---|---|---|"]
    for (a, b), acts in sorted(p.edges.items()):
        rows.append(f"| `{a}` | `{b}` | {', '.join(f'`{x}`' for x in sorted(acts))} |")
    return "\n".join(rows) + "\n"


def render_svg(dot_text: str, out: Path) -> Path:
    """Run Graphviz's ``dot`` on ``dot_text`` and write the SVG to ``out``."""
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError("Graphviz's `dot` is not installed (Debian: apt-get install -y graphviz)")
    done = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed: {done.stderr.strip()}")
    out.write_text(done.stdout)
    return out


# ------------------------------------------------------------------------------------- the sequences


@dataclasses.dataclass(frozen=True)
class Lifeline:
    kind: str  # environment, holder, loop, request
    index: int = 1

    def name(self, counts: dict[str, int]) -> str:
        if self.kind == "environment":
            return "environment"
        if self.kind == "loop":
            return "loop" if counts.get("loop", 1) == 1 else f"loop, rank {self.index}"
        if self.kind == "holder":
            return "holder" if counts.get("holder", 1) == 1 else f"holder {self.index}"
        return "request" if counts.get("request", 1) == 1 else f"request {self.index}"


@dataclasses.dataclass
class SequenceStep:
    """One step of a counterexample, as the diagram draws it."""

    number: int
    action: str  # the protocol's name, "initial state", "Stuttering" or "Back to state N by Action"
    actor: Lifeline | None  # None: the TP group (a bar across the loops) or a closing line
    target: Lifeline | None
    touched: tuple[Lifeline, ...]  # every lifeline whose state changed
    changes: dict[str, str]  # variable -> its new value, as TLC printed it


def _value(text: str):
    try:
        return parse_tla_value(text)
    except (ValueError, IndexError):
        return text


def _changed_entries(name: str, before: str | None, after: str) -> list[Lifeline]:
    kind = OWNERS.get(name, "loop")
    if kind == "group":
        return []
    old, new = _value(before) if before is not None else None, _value(after)
    if isinstance(new, tuple) and kind != "environment" and (old is None or isinstance(old, tuple)):
        if old is None or len(old) != len(new):
            return [Lifeline(kind, i + 1) for i in range(len(new))]
        return [Lifeline(kind, i + 1) for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    return [Lifeline(kind, 1)]


def _header(header: str) -> tuple[int, str]:
    """A counterexample step's number and name: the action, ``initial state``, ``Stuttering``, or ``Back to
    state N by Action`` (a liveness trace's loop: the action leads back to state N)."""
    number = int(header.split(":")[0].split()[-1]) if header.startswith("State") else 0
    action = protocol_action(header.split("<", 1)[1].split()[0]) if "<" in header else ""
    if header.endswith("<Initial predicate>"):
        return number, "initial state"
    if header.startswith("Back to"):
        back = header.split(":")[0].strip()
        return number, f"{back} by {action}" if action else back
    return number, action or header.split(":")[-1].strip()


def _actor(action: str, touched: Sequence[Lifeline]) -> Lifeline | None:
    kind = next((k for k, names in _ACTORS.items() if action in names), "loop")
    if kind == "group":
        return None
    if kind == "environment":
        return Lifeline("environment")
    own = [t for t in touched if t.kind == kind]
    return own[0] if own else Lifeline(kind, 1)


def sequence_steps(trace: Sequence[tuple[str, dict[str, str]]]) -> list[SequenceStep]:
    """The counterexample's steps with their actor, target and changed variables."""
    steps: list[SequenceStep] = []
    previous: dict[str, str] = {}
    rank_of: dict[int, int] = {}  # holder -> rank, learnt from the steps that change both
    for header, state in trace:
        number, action = _header(header)
        changes = state if not previous else {k: v for k, v in state.items() if previous.get(k) != v}
        if not previous or not state:
            steps.append(SequenceStep(number, action, None, None, (), dict(changes)))
            previous = state or previous
            continue
        touched = tuple(dict.fromkeys(e for k, v in changes.items() for e in _changed_entries(k, previous.get(k), v)))
        actor = _actor(action, touched)
        target = None
        if actor is not None:
            others = [t for t in touched if t != actor]
            for kind in _TARGET_ORDER[actor.kind]:
                target = next((t for t in others if t.kind == kind), None)
                if target is not None:
                    break
            if actor.kind == "holder" and target is not None and target.kind == "loop":
                rank_of[actor.index] = target.index
            if target is None and actor.kind == "request":  # a caller's step is a call into the driver's loop
                target = Lifeline("loop", 1)
            if target is None and action in _CALLS:
                target = Lifeline("loop", rank_of.get(actor.index, 1) if actor.kind == "holder" else 1)
        steps.append(SequenceStep(number, action, actor, target, touched, dict(changes)))
        previous = state
    return steps


def _ends_a_liveness_trace(action: str) -> bool:
    return action == "Stuttering" or action.startswith("Back to")


def _lifelines(steps: Sequence[SequenceStep]) -> list[Lifeline]:
    initial = steps[0].changes if steps else {}
    lines: set[Lifeline] = set()
    for name, value in initial.items():  # every entry of every variable is "changed" from nothing
        lines.update(e for e in _changed_entries(name, None, value) if e.kind != "environment")
    if any(s.actor and s.actor.kind == "environment" for s in steps):
        lines.add(Lifeline("environment"))
    for s in steps:
        lines.update(x for x in (s.actor, s.target) if x is not None)
    return sorted(lines, key=lambda x: (_KINDS.index(x.kind), x.index))


def _wrap(items: list[str], width: int) -> list[str]:
    """``items`` joined with ``;`` into lines of about ``width`` characters (an item is never split)."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + len(item) + 2 <= width:
            lines[-1] += f";  {item}"
        else:
            lines.append(item)
    return lines


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "middle", weight: str = "normal",
          fill: str = "#222") -> str:  # fmt: skip
    return (f'<text x="{x:.0f}" y="{y:.0f}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{fill}">{html.escape(s)}</text>')  # fmt: skip


def sequence_svg(trace: Sequence[tuple[str, dict[str, str]]], title: str = "", verdict: str = "") -> str:
    """A counterexample as an SVG sequence diagram (see the module's docstring); ``verdict``, when given, closes
    a trace that ends in a bad state (an invariant violated) with a line saying so."""
    steps = sequence_steps(trace)
    if verdict and steps and _ends_a_liveness_trace(steps[-1].action):
        verdict = ""  # a liveness trace already ends in its stuttering or loop-back line
    if verdict:
        steps.append(SequenceStep(0, verdict, None, None, (), {}))
    lines = _lifelines(steps)
    counts = {k: sum(1 for x in lines if x.kind == k) for k in _KINDS}
    col, left, top, note_w = 150, 60, 70 if title else 40, 360
    x_of = {line: left + col * i + col / 2 for i, line in enumerate(lines)}
    notes_x = left + col * len(lines) + 110  # room for the last lifeline's own steps' names
    loops = [x for x in lines if x.kind == "loop"]
    body: list[str] = []
    y = top + 40
    for s in steps:
        notes = _wrap([f"{k} = {v}" for k, v in sorted(s.changes.items())], 58) or [""]
        height = max(34, 15 * len(notes) + 16)
        mid = y + 18
        body.append(_text(left - 30, mid + 4, str(s.number) if s.number else "", 11, fill="#777"))
        body += _draw_step(s, x_of, loops, mid, col)
        for j, note in enumerate(notes):
            body.append(_text(notes_x, y + 14 + 15 * j, note, 11, anchor="start", fill="#444"))
        y += height
    width, height = notes_x + note_w, y + 20
    head = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif">',
        '<defs><marker id="arrow" markerWidth="10" markerHeight="8" refX="9" refY="4" orient="auto">'
        '<path d="M0,0 L10,4 L0,8 z" fill="#3f6fb5"/></marker></defs>',
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
    ]
    if title:
        head.append(_text(left, 28, title, 15, anchor="start", weight="bold"))
    for line, x in x_of.items():
        head.append(f'<line x1="{x:.0f}" y1="{top + 30}" x2="{x:.0f}" y2="{y:.0f}" stroke="#aaa" '
                    'stroke-dasharray="4 4"/>')  # fmt: skip
        head.append(f'<rect x="{x - col / 2 + 8:.0f}" y="{top}" width="{col - 16}" height="28" rx="5" '
                    'fill="#eef3fb" stroke="#3f6fb5"/>')  # fmt: skip
        head.append(_text(x, top + 19, line.name(counts), 12, weight="bold"))
    head.append(_text(notes_x, top + 19, "variables changed", 12, anchor="start", weight="bold"))
    return "\n".join(head + body + ["</svg>"]) + "\n"


def _draw_step(
    s: SequenceStep, x_of: dict[Lifeline, float], loops: list[Lifeline], mid: float, col: float
) -> list[str]:
    """One row of the diagram: a bar for the group's collectives, a line for the first and last rows, an arrow
    (or a bar on its own lifeline) for a thread's step."""
    out: list[str] = []
    xs = list(x_of.values())
    if s.actor is None and s.action in ("AllReduce", "Barrier") and loops:
        a, b = min(x_of[x] for x in loops) - 65, max(x_of[x] for x in loops) + 65
        out.append(f'<rect x="{a:.0f}" y="{mid - 10:.0f}" width="{b - a:.0f}" height="20" rx="4" fill="#fff2cc" '
                   'stroke="#c9a227"/>')  # fmt: skip
        out.append(_text((a + b) / 2, mid + 4, f"{s.action} (TP group)", 11, weight="bold"))
        return out
    if s.actor is None:  # the initial state, the verdict, stuttering, a loop back
        label = s.action
        if s.action == "Stuttering":
            label = "nothing can change any more (stuttering, for ever)"
        elif _ends_a_liveness_trace(s.action):
            label = f"{s.action}: the behaviour repeats from there for ever"
        out.append(f'<line x1="{xs[0] - col / 2 + 8:.0f}" y1="{mid:.0f}" x2="{xs[-1] + col / 2 - 8:.0f}" '
                   f'y2="{mid:.0f}" stroke="#c0392b" stroke-width="1.5"/>')  # fmt: skip
        w = max(380, 6.5 * len(label) + 24)  # about 6.5 px a character at 11 px, bold
        out.append(f'<rect x="{(xs[0] + xs[-1]) / 2 - w / 2:.0f}" y="{mid - 11:.0f}" width="{w:.0f}" height="22" '
                   'fill="white" stroke="#c0392b" rx="4"/>')  # fmt: skip
        out.append(_text((xs[0] + xs[-1]) / 2, mid + 4, label, 11, weight="bold", fill="#c0392b"))
        return out
    x0 = x_of.get(s.actor, xs[0])
    for t in s.touched:
        if t not in (s.actor, s.target) and t in x_of:
            out.append(f'<circle cx="{x_of[t]:.0f}" cy="{mid:.0f}" r="4" fill="#3f6fb5"/>')
    if s.target is None or s.target not in x_of:
        out.append(f'<rect x="{x0 - 6:.0f}" y="{mid - 12:.0f}" width="12" height="24" fill="#3f6fb5" rx="2"/>')
        out.append(_text(x0 + 12, mid - 6, s.action, 11, anchor="start", weight="bold"))
        return out
    x1 = x_of[s.target]
    end = x1 - 6 if x1 > x0 else x1 + 6
    out.append(f'<line x1="{x0:.0f}" y1="{mid:.0f}" x2="{end:.0f}" y2="{mid:.0f}" stroke="#3f6fb5" '
               'stroke-width="1.6" marker-end="url(#arrow)"/>')  # fmt: skip
    out.append(_text((x0 + x1) / 2, mid - 5, s.action, 11, weight="bold"))
    return out


# ------------------------------------------------------------------------------------------- generating

# The upstream defects TLC finds, with the model that finds each (tla/models.toml).
DEFECT_MODELS = {
    "D1": "Upstream_D1",
    "D2": "Upstream_D2",
    "D3": "Upstream_D3",
    "D4": "Upstream_D4",
    "D5": "Upstream_D5",
    "D7": "Upstream_D7",
    "D8": "Upstream_D8",
    "D9": "Upstream_D9",
    "D10": "Upstream_D10",
    "D11": "Upstream_D11",
    "D6": "RequestVersions_upstream_D6",
}
# The models whose state graphs the phase diagram projects: one rank with every fault a single rank has
# (timeouts, errors, a restart), and two ranks with a peer's pause and no local holder (the TP phases).
PHASE_MODELS = ("PauseProtocol_1r2h", "PauseProtocol_peer_absent")


def generate(out: Path, tla_dir: Path | None = None, *, phase_models: Sequence[str] = PHASE_MODELS,
             defects: dict[str, str] | None = None, on_line=None) -> list[Path]:  # fmt: skip
    """Run TLC and write ``phases.svg``, ``phases.md`` and, per defect, ``D<n>.svg`` and ``D<n>.txt`` (TLC's
    counterexample as the runner prints it) into ``out``.  Raises ``RuntimeError`` when a defect's model no
    longer gives its expected counterexample: a picture of the wrong behaviour is worse than none."""
    tla_dir = Path(tla_dir or default_tla_dir())
    cache = default_cache()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    models = {m.name: m for m in load_manifest(tla_dir)}
    written = []
    graphs = []
    for name in phase_models:
        if on_line:
            on_line(f"state graph of {name}")
        graphs.append((name, tlc_graph(models[name], tla_dir, cache=cache)))
    p = phase_edges(graphs)
    written.append(render_svg(phase_dot(p), out / "phases.svg"))
    (out / "phases.md").write_text(phase_table(p))
    written.append(out / "phases.md")
    for defect, name in (DEFECT_MODELS if defects is None else defects).items():
        if on_line:
            on_line(f"counterexample of {name} ({defect})")
        # The manifest gives a defect's model one worker and a fixed fingerprint function (TLC draws one at random
        # per run otherwise, and the order of its liveness search follows it): the same counterexample every time,
        # and the shortest for safety.  With a cache, the run the main job or the tests kept is drawn.
        model = models[name]
        if model.workers != 1 or "-fp" not in model.options:
            raise RuntimeError(f"{name}: a defect's model runs with workers = 1 and -fp (tla/models.toml)")
        result = run_model(model, tla_dir, cache=cache)
        trace = parse_trace(result.run.output)
        if not result.matches_expectation or not trace:
            raise RuntimeError(f"{name} gave {result.outcome}, not {models[name].expect}: no picture of {defect}")
        title = f"{defect}: {name}, TLC finds {result.outcome}"
        kind, _, prop = result.outcome.partition(":")
        verdict = f"{prop} is violated in this state" if kind == "invariant" else ""
        (out / f"{defect}.svg").write_text(sequence_svg(trace, title, verdict))
        (out / f"{defect}.txt").write_text(f"{title}\n\n{format_trace(trace)}\n")
        written += [out / f"{defect}.svg", out / f"{defect}.txt"]
    return written


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cbpause.apps.diagrams", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="folder for the SVG files")
    parser.add_argument("--tla-dir", type=Path, default=None, help="the TLA+ folder (default: the project's tla/)")
    args = parser.parse_args(argv)
    for path in generate(args.out, args.tla_dir, on_line=print):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
