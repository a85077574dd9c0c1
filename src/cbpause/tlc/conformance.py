"""Spec and code conform: the pure transitions and the TLA+ spec have the same state graph.

TLC writes a model's full state graph (:func:`~cbpause.tlc.launcher.run_tlc`, ``mode="graph"``);
:func:`python_graph` explores :func:`cbpause.core.group.next_steps` from the same initial state within the same
bounds; :func:`compare` checks that both have the same reachable states (under one shared encoding,
:func:`encode`) and the same labelled transitions, in both directions, and describes the first
differences readably.

TLC labels an edge with the action's name only (``OpenWindow``, not ``OpenWindow(1)``), and a bounded
environment action with its wrapper's name (``MCInterrupt``), so transitions are compared as (state,
action name, successor) with the wrapper's ``MC`` dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path

from ..core import group as gr
from ..core import transitions as t
from .cache import Cache, default_cache
from .launcher import protocol_action
from .manifest import Model

__all__ = [
    "DEEP_MODEL_SHAPES",
    "FAST_MODEL_SHAPES",
    "Graph",
    "Shape",
    "compare",
    "encode",
    "explore",
    "main",
    "parse_tla_value",
    "python_graph",
    "read_dot",
    "tlc_graph",
]

Encoded = tuple  # a state as a sorted tuple of (variable, value)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The constants of a model, as :mod:`cbpause.core.group` takes them."""

    n_ranks: int
    rank_of: tuple[int, ...]  # the rank index of each holder (numbered from 0, cbpause.core.group.tla_number)
    n_requests: int
    bounds: gr.Bounds


# The fast models of tla/models.toml that check our protocol (their .cfg's constants; a test checks them).
FAST_MODEL_SHAPES = {
    "PauseProtocol_1r2h": Shape(1, (0, 0), 1, gr.Bounds(frozenset({"interrupt", "timeout", "error", "stop"}), 1)),
    "PauseProtocol_2r1h": Shape(2, (0, 1), 1, gr.Bounds(frozenset({"interrupt", "crash", "stop"}), 0)),
    "PauseProtocol_peer_absent": Shape(2, (0,), 1, gr.Bounds(frozenset({"interrupt", "stop"}), 1)),
    "PauseProtocol_1r2h_deaths": Shape(
        1, (0, 0), 1, gr.Bounds(frozenset({"interrupt", "error", "stop", "death"}), 1)
    ),
    "PauseProtocol_1r2h_modes": Shape(
        1, (0, 0), 1, gr.Bounds(frozenset({"interrupt", "stop"}), 0, frozenset(t.MODES))
    ),
}

# The deep model whose graph `nox -s tlc_deep` compares too (`python -m cbpause.tlc.conformance`, minutes).
DEEP_MODEL_SHAPES = {
    "PauseProtocol_2r1h_full": Shape(
        2, (0, 1), 1, gr.Bounds(frozenset({"interrupt", "timeout", "error", "crash", "stop"}), 1)
    ),
}


@dataclasses.dataclass
class Graph:
    init: set[Encoded]
    states: set[Encoded]
    edges: set[tuple[Encoded, str, Encoded]]


# --------------------------------------------------------------------------------------------- encoding


def encode(g: gr.GroupState) -> Encoded:
    """The TLA+ variables of a :class:`~cbpause.core.group.GroupState`, as TLC prints them, parsed."""
    r = g.ranks
    variables = {gr.tla_variable(f): tuple(getattr(s, f) for s in r) for f in gr.RANK_VARIABLES}
    variables |= {gr.tla_variable(f): getattr(r[0], f) for f in gr.SHARED_VARIABLES}
    variables |= {
        "hs": tuple(gr.tla_holder_state(x) for x in g.hs), "hmode": g.hmode, "req": g.req, "out": g.out,
        "restarts": g.restarts,
    }  # fmt: skip
    return tuple(sorted(variables.items()))


_TOKEN = re.compile(r'\s*(<<|>>|\{|\}|,|"(?:[^"\\]|\\.)*"|-?\d+|TRUE|FALSE)')


@functools.lru_cache(maxsize=65536)  # a graph's states share few distinct values: parse each once
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
        if tok in ("TRUE", "FALSE"):
            return tok == "TRUE"
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
    edges = {(nodes[a], protocol_action(label), nodes[b]) for a, b, label in raw_edges}
    return Graph(init=init, states=set(nodes.values()), edges=edges)


# ----------------------------------------------------------------------------------------- the two graphs


def explore(shape: Shape) -> Iterator[tuple[gr.GroupState, str, gr.GroupState]]:
    """Every transition ``(state, label, successor)`` of the graph reachable with :func:`cbpause.core.group.next_steps`
    (``MCSpec``) from the shape's initial state, breadth first; each state's transitions once."""
    start = gr.initial_group(shape.n_ranks, shape.rank_of, shape.n_requests)
    seen = {start}
    frontier = [start]
    while frontier:
        nxt = []
        for g in frontier:
            for label, succ in gr.next_steps(g, shape.bounds):
                yield g, label, succ
                if succ not in seen:
                    seen.add(succ)
                    nxt.append(succ)
        frontier = nxt


def python_graph(shape: Shape) -> Graph:
    """Every state and labelled transition reachable with :func:`cbpause.core.group.next_steps` (``MCSpec``).

    In the same exploration, every invariant of :data:`cbpause.core.group.GROUP_INVARIANTS` holds in every state
    and ``MonotoneStopInv`` on every step, or ``AssertionError`` names the first that breaks (the Python transitions
    keep the TLA+ invariants on their own; the state space is explored once for both checks)."""
    start = gr.initial_group(shape.n_ranks, shape.rank_of, shape.n_requests)
    reached, edges = {start}, set()
    for g, label, succ in explore(shape):
        assert gr.monotone_stop_inv(g, succ), f"MonotoneStopInv broken by {label}: {g} -> {succ}"
        if succ not in reached:
            for name, inv in gr.GROUP_INVARIANTS.items():
                assert inv(succ), f"{name} broken by {label}: {succ}"
        edges.add((encode(g), gr.action_name(label), encode(succ)))
        reached.add(succ)
    for g in reached:
        if gr.terminated(g):
            edges.add((encode(g), "Terminated", encode(g)))  # TLA+'s stuttering Terminated step
    return Graph(init={encode(start)}, states={encode(g) for g in reached}, edges=edges)


def tlc_graph(model: Model, tla_dir: Path, *, cache: Cache | None = None) -> Graph:
    """The state graph of ``model``'s run (:func:`~cbpause.tlc.models.run_model`, which checks the model too; with
    ``cache``, a kept run of the same spec is read instead).  ``RuntimeError`` unless the run gave the model's expected
    result."""
    from .models import run_model

    result = run_model(dataclasses.replace(model, graph=True), tla_dir, cache=cache)
    if not result.passed or result.graph is None:
        raise RuntimeError(f"TLC did not check {model.name} cleanly ({result.outcome}; {result.mismatches()}):\n"
                           f"{result.run.output[-3000:]}")  # fmt: skip
    return read_dot(result.graph)


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


def main(argv: list[str] | None = None) -> int:
    """``python -m cbpause.tlc.conformance [--model NAME ...]``: compare the graphs of the deep models (or of the
    named ones, fast or deep); exit 1 on any difference."""
    import argparse
    import time

    from .manifest import default_tla_dir, load_manifest

    shapes = {**FAST_MODEL_SHAPES, **DEEP_MODEL_SHAPES}
    parser = argparse.ArgumentParser(prog="python -m cbpause.tlc.conformance", description=main.__doc__)
    parser.add_argument("--model", action="append", choices=sorted(shapes), help="default: the deep models")
    args = parser.parse_args(argv)
    tla_dir = default_tla_dir()
    models = {m.name: m for m in load_manifest(tla_dir)}
    failed = 0
    for name in args.model or sorted(DEEP_MODEL_SHAPES):
        start = time.monotonic()
        tlc = tlc_graph(models[name], tla_dir, cache=default_cache())
        py = python_graph(shapes[name])
        diffs = compare(tlc, py)
        if len(tlc.states) != models[name].distinct_states:
            recorded = models[name].distinct_states
            diffs.append(f"TLC reached {len(tlc.states):,} states, the manifest records {recorded:,}")
        seconds = time.monotonic() - start
        verdict = "same graph" if not diffs else "DIFFERENT"
        print(f"{name}: {len(tlc.states):,} states, {len(tlc.edges):,} transitions, {verdict} ({seconds:.0f} s)")
        for d in diffs:
            print("   " + d)
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
