"""Trace validation: traces recorded from real threaded runs of ``PauseProtocol`` are behaviours of the spec.

A :class:`~cbpause.core.recorder.TraceRecorder` passed as ``PauseProtocol(trace=...)`` records every transition
the object takes.  :func:`write_trace` writes the trace as a TLA+ module (a sequence literal: this TLC
reads no JSON) and a ``.cfg``; ``tla/TracePauseProtocol.tla`` replays it, and :func:`validate` runs TLC on
it (:func:`~cbpause.tlc.launcher.run_tlc`, ``mode="trace"``).  A trace is accepted when TLC reaches the end
of the log (``TraceMatched``), i.e. finds a state that breaks the witness ``NeverMatched``.

What is recorded is every transition the object takes, all through ``PauseProtocol._apply``: the explicit
loop API (which transformers' integration drives), the holders' side (both APIs), stops, restarts, the
window and fatal errors.  A drop-in call that performs several spec steps at once (``is_pause_requested``,
``update_with_tp_status``, ``pause_and_wait``, ...) is recorded as those steps, in order.  The hot paths
replay a remembered transition without recording only while no recorder is attached
(``cbpause.core.loop``'s ``_may_remember``), so a recorded run records every step.  Each record carries every
variable the spec has for its actor (a loop record the rank's state, a holder record also the holder's
view); ``tla/TracePauseProtocol.tla`` checks them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..core.group import RANK_VARIABLES, SHARED_VARIABLES, tla_number, tla_variable
from ..core.recorder import TraceEvent, TraceRecorder
from ..core.transitions import RankState
from .launcher import run_tlc, trace_verdict

__all__ = [
    "Trace",
    "TraceResult",
    "cut_at_restarts",
    "describe_rejection",
    "event_from_json",
    "event_to_json",
    "merge",
    "request_numbers",
    "validate",
    "validate_sample",
    "write_trace",
]


@dataclasses.dataclass
class Trace:
    """A trace to validate: what a :class:`~cbpause.core.recorder.TraceRecorder` holds (its ``events``, the rank of each
    holder, the number of ranks), or several recorders' merged (:func:`merge`)."""

    events: list[TraceEvent]
    holder_rank: list[int]
    n_ranks: int


def event_to_json(e: TraceEvent) -> dict:
    """A record as JSON, for a rank's process to hand its trace to the parent."""
    return {**dataclasses.asdict(e), "state": e.state._asdict()}


def event_from_json(d: dict) -> TraceEvent:
    return TraceEvent(**{**d, "state": RankState(**d["state"])})


def merge(parts: Sequence[tuple[Sequence[TraceEvent], Sequence[int]]], n_ranks: int) -> Trace:
    """The traces of the ranks of one group, each recorded in its own process (``(events, holder_rank)`` each),
    as one trace of the group, in the order of their records' ``time_ns`` (a clock shared by the processes of
    one machine; each record was taken under its protocol's lock, when its step happened)."""
    events: list[TraceEvent] = []
    holder_rank: list[int] = []
    for part_events, part_holders in parts:
        offset = len(holder_rank)
        holder_rank.extend(part_holders)
        events.extend(e if e.holder is None else dataclasses.replace(e, holder=e.holder + offset) for e in part_events)
    events.sort(key=lambda e: e.time_ns)
    return Trace(events, holder_rank, n_ranks)


def cut_at_restarts(recorder: TraceRecorder | Trace) -> list[Trace]:
    """A long trace cut into traces that each start from ``Init``: one per run of the loop between restarts.

    ``Restart`` is enabled only when every rank has stopped and every holder is idle (so every count is 0),
    and it leaves every variable a record shows as ``Init`` has it; the records after a ``Restart`` are
    therefore a behaviour from ``Init`` on their own.  Holders are numbered again in each piece, in the
    order they first appear.  A piece without records is left out.

    One rank only: in a group, ``Restart`` is one record per rank, and a rank's records between the first
    rank's and its own are checked against the view before the restart (``TracePauseProtocol``'s ``prev``),
    which a cut would lose.
    """
    if recorder.n_ranks != 1:
        raise ValueError(f"cut_at_restarts takes one rank's trace, not {recorder.n_ranks} ranks'")
    pieces: list[list[TraceEvent]] = [[]]
    for e in recorder.events:
        if e.action == "Restart":
            pieces.append([])
            continue
        pieces[-1].append(e)
    traces = []
    for events in pieces:
        if not events:
            continue
        renumber: dict[int, int] = {}
        holder_rank: list[int] = []
        out = []
        for e in events:
            if e.holder is not None:
                if e.holder not in renumber:
                    renumber[e.holder] = len(holder_rank)
                    holder_rank.append(recorder.holder_rank[e.holder])
                e = dataclasses.replace(e, holder=renumber[e.holder])
            out.append(e)
        traces.append(Trace(out, holder_rank, recorder.n_ranks))
    return traces


def _tla(value) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value) + '"'


# What a record shows of the rank (TracePauseProtocol's ``v``): every TLA+ variable of the rank and the group.
_SHOWN = RANK_VARIABLES + SHARED_VARIABLES

# What TLC checks on every replayed state: every invariant the spec's models check (PROPERTY: an action property),
# and the trace's own end condition.
TRACE_INVARIANTS = ("TypeOK", "ExclusionInv", "SameWindowInv", "CountsInv", "ModeInv", "NothingLostInv",
                    "DeliveredAtEnd")  # fmt: skip
TRACE_PROPERTIES = ("MonotoneStopInv",)


def _state(s: RankState) -> str:
    return "[" + ", ".join(f"{tla_variable(f)} |-> {_tla(getattr(s, f))}" for f in _SHOWN) + "]"


def _record(e: TraceEvent, request: int) -> str:
    holder = 0 if e.holder is None else tla_number(e.holder)
    rank, action, hs = tla_number(e.rank), _tla(e.action), _tla(e.holder_state)
    return (f"[a |-> {action}, r |-> {rank}, h |-> {holder}, hs |-> {hs}, arg |-> {e.argument}, q |-> {request}, "
            f"v |-> {_state(e.state)}]")  # fmt: skip


def request_numbers(events: Sequence[TraceEvent]) -> list[int]:
    """The TLA+ number of each record's request (0 for a record of none): requests are numbered from 1 in the order
    of their ``Submit``; an id submitted again (after its request was delivered) names a new request, and an id
    never submitted gets a number of its own (its records then match no step: the trace is rejected)."""
    numbers: list[int] = []
    current: dict[str, int] = {}
    counter = itertools.count(1)
    for e in events:
        if e.request and (e.action == "Submit" or e.request not in current):
            current[e.request] = next(counter)
        numbers.append(current[e.request] if e.request else 0)
    return numbers


def _tla_set(numbers: Sequence[int]) -> str:
    return "{" + ", ".join(str(n) for n in numbers) + "}"


def write_trace(
    recorder: TraceRecorder | Trace, directory: Path, name: str = "Trace", events: Sequence[TraceEvent] | None = None
) -> tuple[Path, Path]:
    """Write ``<name>.tla`` (the log as a sequence literal) and ``<name>.cfg`` into ``directory``.

    Ranks and holders are numbered as in TLA+ there (:func:`cbpause.core.group.tla_number`).
    """
    if not re.fullmatch(r"[A-Za-z]\w*", name):
        raise ValueError(f"not a TLA+ module name: {name!r}")
    events = recorder.events if events is None else events
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    requests = request_numbers(events)
    log = "<<\n    " + ",\n    ".join(_record(e, q) for e, q in zip(events, requests, strict=True)) + "\n>>"
    log = log if events else "<< >>"
    rank_of = "<<" + ", ".join(str(tla_number(r)) for r in recorder.holder_rank) + ">>"
    module = directory / f"{name}.tla"
    module.write_text(
        f"---- MODULE {name} ----\n"
        "\\* A trace recorded from PauseProtocol (cbpause.core.recorder), replayed by TracePauseProtocol.\n"
        "EXTENDS TracePauseProtocol\n\n"
        f"TraceRankOf == {rank_of if recorder.holder_rank else '<< >>'}\n\n"
        f"TraceLog == {log}\n"
        "====\n"
    )
    holders = _tla_set([tla_number(h) for h in range(len(recorder.holder_rank))])
    ranks = _tla_set([tla_number(r) for r in range(max(recorder.n_ranks, 1))])
    cfg = directory / f"{name}.cfg"
    cfg.write_text(
        "CONSTANTS\n"
        f"    Ranks = {ranks}\n"
        f"    Holders = {holders}\n"
        "    RankOf <- TraceRankOf\n"
        f"    Requests = {_tla_set(sorted(set(requests) - {0}))}\n"
        "    Modes = {1, 2, 3, 4}\n"
        "    Log <- TraceLog\n"
        "INIT TraceInit\n"
        "NEXT TraceNext\n"
        + "".join(f"INVARIANT {name}\n" for name in TRACE_INVARIANTS)
        + "".join(f"PROPERTY {name}\n" for name in TRACE_PROPERTIES)
        + "INVARIANT NeverMatched\n"
    )
    return module, cfg


@dataclasses.dataclass
class TraceResult:
    accepted: bool
    steps: int  # events in the trace
    matched: int  # events matched (all of them when accepted)
    states: int | None  # distinct states TLC explored
    output: str
    violated: str = ""  # the spec's invariant or action property a rejected trace broke on the way (TRACE_INVARIANTS)


def validate(
    recorder: TraceRecorder | Trace,
    tla_dir: Path,
    workdir: Path | None = None,
    name: str = "Trace",
    events: Sequence[TraceEvent] | None = None,
) -> TraceResult:
    """Check with TLC that the recorded trace is a behaviour of ``tla/PauseProtocol.tla``."""
    events = recorder.events if events is None else events
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cbpause-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for f in ("PauseProtocol.tla", "TracePauseProtocol.tla"):
        shutil.copy(Path(tla_dir) / f, workdir / f)
    write_trace(recorder, workdir, name, events)
    run = run_tlc(name, f"{name}.cfg", workdir, mode="trace")
    accepted, violated = trace_verdict(run, "the trace")
    matched = len(events) if accepted else (run.depth - 1 if run.depth else 0)
    return TraceResult(accepted, len(events), matched, run.distinct_states, run.output, violated)


def describe_rejection(
    recorder: TraceRecorder | Trace, result: TraceResult, events: Sequence[TraceEvent] | None = None
) -> str:
    """The events around the first one the spec could not match (numbered as in Python)."""
    events = recorder.events if events is None else events
    k = result.matched  # index of the first unmatched event
    lines = [f"holders' ranks: {recorder.holder_rank}"]
    if result.violated:
        lines.append(f"the trace breaks {result.violated} after record {k}")
    for n in range(max(0, k - 6), min(len(events), k + 2)):
        e = events[n]
        mark = ">>" if n == k else "  "
        request = f", request {e.request!r}" if e.request else ""
        step = f"{e.action}(rank {e.rank}, holder {e.holder}, argument {e.argument}{request})"
        lines.append(f"{mark} {n + 1:4} {step} -> {e.state}")
    return "\n".join(lines)


def validate_sample(recorder: TraceRecorder, k: int, seed: int, tla_dir: Path) -> tuple[dict, list[str]]:
    """TLC validates ``k`` of the traces of ``recorder`` (cut at its restarts): the ``k`` that add the most actions
    not yet taken, ties broken by ``seed``, so that the faults get checked.  Returns the figures (traced, rejected,
    trace_steps, traces, trace_actions) and what went wrong (each rejection described; too few traces)."""
    pieces = cut_at_restarts(recorder)
    problems = [] if len(pieces) >= k else [f"only {len(pieces)} traces to validate, not {k}"]
    order = list(range(len(pieces)))
    random.Random(seed).shuffle(order)
    actions = [{e.action for e in p.events} for p in pieces]
    chosen: list[int] = []
    seen: set[str] = set()
    for _ in range(min(k, len(pieces))):
        best = max((n for n in order if n not in chosen), key=lambda n: len(actions[n] - seen))
        chosen.append(best)
        seen |= actions[best]
    traced = rejected = steps = 0
    with tempfile.TemporaryDirectory(prefix="cbpause-sample-traces-") as tmp:
        for n in chosen:
            result = validate(pieces[n], tla_dir, Path(tmp, f"t{n}"))
            traced, steps = traced + 1, steps + result.steps
            if not result.accepted:
                rejected += 1
                problems.append(f"REJECTED trace {n} of {len(pieces)}\n" + describe_rejection(pieces[n], result))
    figures = {"traced": traced, "rejected": rejected, "trace_steps": steps, "traces": len(pieces),
               "trace_actions": sorted(seen)}  # fmt: skip
    return figures, problems
