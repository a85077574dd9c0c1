"""Spec and code conform: the pure transitions and the TLA+ spec have the same state graph.

TLC writes a model's full state graph with ``-dump dot,actionlabels``; :func:`python_graph` explores
``cbpause.transitions.group_actions`` from the same initial state under the same bounds; :func:`compare`
checks that both have the same reachable states (under one shared encoding, :func:`encode`) and the same
labelled transitions, in both directions, and describes the first differences readably.

TLC labels an edge with the action's name only (``OpenWindow``, not ``OpenWindow(1)``), so transitions are
compared as (state, action name, successor).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
from pathlib import Path

from . import transitions as t
from .tlc import Model, find_jar, find_java

__all__ = [
    "FAST_MODEL_SHAPES",
    "Graph",
    "Shape",
    "compare",
    "encode",
    "parse_tla_value",
    "python_graph",
    "read_dot",
    "tlc_graph",
]

Encoded = tuple  # a state as a sorted tuple of (variable, value)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The constants of a model, as the pure transitions take them."""

    n_ranks: int
    rank_of: tuple[int, ...]  # 0-based rank of each holder
    n_requests: int
    faults: frozenset[str]
    max_restarts: int


# The fast models of tla/models.toml that check our protocol (the .cfg's constants, 0-based ranks).
FAST_MODEL_SHAPES = {
    "PauseProtocol_1r2h": Shape(1, (0, 0), 1, frozenset({"interrupt", "timeout", "error", "stop"}), 1),
    "PauseProtocol_2r1h": Shape(2, (0, 1), 1, frozenset({"interrupt", "crash", "stop"}), 0),
    "PauseProtocol_peer_absent": Shape(2, (0,), 1, frozenset({"interrupt", "stop"}), 1),
}


@dataclasses.dataclass
class Graph:
    init: set[Encoded]
    states: set[Encoded]
    edges: set[tuple[Encoded, str, Encoded]]


# --------------------------------------------------------------------------------------------- encoding


def encode(g: t.GroupState) -> Encoded:
    """The TLA+ variables of a :class:`~cbpause.transitions.GroupState`, as TLC prints them, parsed."""
    r = g.ranks
    return tuple(
        sorted(
            {
                "pc": tuple(s.phase for s in r),
                "stop": tuple(s.stop for s in r),
                "tpStop": r[0].tp_stop,
                "tpPause": r[0].tp_pause,
                "obsStop": tuple(s.obs_stop for s in r),
                "obsPause": tuple(s.obs_pause for s in r),
                "fatal": tuple(s.fatal for s in r),
                "paused": tuple(s.paused for s in r),
                "count": tuple(s.count for s in r),
                "hs": g.hs,
                "req": g.req,
                "out": g.out,
                "restarts": g.restarts,
                "crashes": g.crashes,
            }.items()
        )
    )


_TOKEN = re.compile(r'\s*(<<|>>|\{|\}|,|"(?:[^"\\]|\\.)*"|-?\d+|TRUE|FALSE)')


def parse_tla_value(text: str):
    """A TLA+ value as TLC prints it: integers, booleans, strings, sequences (as tuples), sets."""
    tokens = _TOKEN.findall(text)
    if "".join(tokens).replace(" ", "") != text.replace(" ", "").replace("\n", ""):
        raise ValueError(f"cannot parse TLA+ value {text!r}")
    pos = 0

    def value():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok in ("<<", "{"):
            close = ">>" if tok == "<<" else "}"
            items = []
            while tokens[pos] != close:
                items.append(value())
                if tokens[pos] == ",":
                    pos += 1
            pos += 1
            return tuple(items) if close == ">>" else frozenset(items)
        if tok == "TRUE":
            return True
        if tok == "FALSE":
            return False
        if tok.startswith('"'):
            return tok[1:-1]
        return int(tok)

    result = value()
    if pos != len(tokens):
        raise ValueError(f"trailing input in TLA+ value {text!r}")
    return result


def parse_tlc_state(label: str) -> Encoded:
    """A state as TLC writes it in a dot label: ``/\\ var = value`` lines."""
    variables = {}
    for line in label.split("\n"):
        line = line.strip()
        if not line:
            continue
        if not line.startswith("/\\ "):
            raise ValueError(f"unexpected line in a TLC state: {line!r}")
        name, _, value = line[3:].partition(" = ")
        variables[name.strip()] = parse_tla_value(value)
    return tuple(sorted(variables.items()))


_NODE = re.compile(r'^(-?\d+) \[label="(.*)"(,style = filled)?\]')
_EDGE = re.compile(r'^(-?\d+) -> (-?\d+) \[label="(\w+)"')


def read_dot(path: Path) -> Graph:
    """The state graph in a TLC ``-dump dot,actionlabels`` file."""
    nodes: dict[str, Encoded] = {}
    init: set[Encoded] = set()
    raw_edges = []
    for line in Path(path).read_text().splitlines():
        m = _EDGE.match(line)
        if m:
            raw_edges.append(m.groups())
            continue
        m = _NODE.match(line)
        if m:
            label = m.group(2).replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
            state = parse_tlc_state(label)
            nodes[m.group(1)] = state
            if m.group(3):
                init.add(state)
    edges = {(nodes[a], label, nodes[b]) for a, b, label in raw_edges}
    return Graph(init=init, states=set(nodes.values()), edges=edges)


# ----------------------------------------------------------------------------------------- the two graphs


def python_graph(shape: Shape) -> Graph:
    """Every state and labelled transition reachable with ``group_actions`` (TLA+'s ``Next``)."""
    start = t.initial_group(shape.n_ranks, shape.rank_of, shape.n_requests)
    seen = {start}
    frontier = [start]
    edges = set()
    while frontier:
        nxt = []
        for g in frontier:
            here = encode(g)
            steps = t.group_actions(g, shape.faults, shape.max_restarts)
            if all(s.phase in ("stopped", "dead") for s in g.ranks):
                steps = [*steps, ("Terminated", g)]  # TLA+'s stuttering Terminated step
            for label, succ in steps:
                edges.add((here, label.split("(", 1)[0], encode(succ)))
                if succ not in seen:
                    seen.add(succ)
                    nxt.append(succ)
        frontier = nxt
    return Graph(init={encode(start)}, states={encode(g) for g in seen}, edges=edges)


def tlc_graph(model: Model, tla_dir: Path, workdir: Path | None = None) -> Graph:
    """Run TLC on ``model`` (safety only: the properties are dropped) and read its state graph."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cbpause-graph-"))
    cfg_text = (tla_dir / model.cfg).read_text()
    safety_cfg = workdir / "graph.cfg"
    safety_cfg.write_text(_without_properties(cfg_text))
    for f in tla_dir.glob("*.tla"):
        (workdir / f.name).write_text(f.read_text())
    dot = workdir / "graph.dot"
    proc = subprocess.run(
        [find_java(), "-XX:+UseParallelGC", "-cp", str(find_jar()), "tlc2.TLC", "-workers", "1",
         "-metadir", str(workdir / "meta"), "-dump", "dot,actionlabels", str(dot),
         "-config", safety_cfg.name, model.module],
        cwd=workdir, capture_output=True, text=True,
    )  # fmt: skip
    if "No error has been found" not in proc.stdout:
        raise RuntimeError(f"TLC did not finish {model.name} cleanly:\n{proc.stdout[-3000:]}")
    return read_dot(dot)


def _without_properties(cfg: str) -> str:
    out, skipping = [], False
    for line in cfg.splitlines():
        word = line.split("\\*", 1)[0].strip().split(" ", 1)[0]
        if word in ("PROPERTY", "PROPERTIES"):
            skipping = True
            continue
        if skipping and word.isupper() and word:
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------- comparing


def _show(state: Encoded) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in state)


def _delta(a: Encoded, b: Encoded) -> str:
    da, db = dict(a), dict(b)
    return ", ".join(f"{k}: {da[k]!r} -> {db[k]!r}" for k in da if da[k] != db.get(k)) or "no change"


def compare(tlc: Graph, py: Graph, limit: int = 5) -> list[str]:
    """The differences between the two graphs, most telling first; empty when they are the same."""
    diffs = []
    if tlc.init != py.init:
        diffs.append(f"initial states differ: TLC {sorted(map(_show, tlc.init))}, Python {sorted(map(_show, py.init))}")
    for name, mine, theirs in (("TLC", tlc, py), ("Python", py, tlc)):
        # Transitions out of a state both graphs reach come first: they are where the two diverge.
        extra = sorted(mine.edges - theirs.edges, key=lambda e: (e[0] not in theirs.states, e[1], e[0], e[2]))
        for src, label, dst in extra[:limit]:
            where = "a state both reach" if src in theirs.states else "a state only " + name + " reaches"
            diffs.append(
                f"transition only in {name}: {label} from {where} [{_show(src)}] changing {_delta(src, dst)}"
            )
        if len(extra) > limit:
            diffs.append(f"... and {len(extra) - limit} more transitions only in {name}")
        only = mine.states - theirs.states
        if only:
            diffs.append(f"{len(only)} states only in {name}, e.g. [{_show(min(only))}]")
    return diffs
