"""Trace validation: traces recorded from real threaded runs of ``PauseProtocol`` are behaviours of the spec.

A :class:`TraceRecorder` passed as ``PauseProtocol(trace=...)`` records every transition the object takes:
the TLA+ action, the rank, the holder (each holding thread gets an id), the stop status asked for, and the
rank's state after the step -- all taken under the protocol's lock, so each record is consistent.  Several
``PauseProtocol`` objects (the ranks of a group simulated in one process) may share one recorder; the
recorder's own lock orders their records consistently with each rank's order.

:func:`write_trace` writes a trace as a TLA+ module (a sequence literal: this TLC reads no JSON) and a
``.cfg``; ``tla/TracePauseProtocol.tla`` replays it, and :func:`validate` runs TLC on it.  A trace is
accepted when TLC reaches the end of the log, i.e. finds a state that violates ``TraceNotAccepted``.

What is recorded is the explicit loop API and the holders' side.  The drop-in hot paths
(``is_pause_requested``/``update_with_tp_status`` from transformers' loop) compose several spec steps
and are not recorded (the integration drives the explicit API).
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import tempfile
import threading
from pathlib import Path

from .tlc import find_jar, find_java
from .transitions import RankState

__all__ = ["TraceEvent", "TraceRecorder", "TraceResult", "validate", "write_trace"]

HOLDER_ACTIONS = frozenset({"RequestPause", "EnterPause", "LeavePause", "PauseFails", "Interrupt", "PauseTimeout"})


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    action: str  # the TLA+ action, e.g. "OpenWindow"
    rank: int  # 1-based
    holder: int  # 1-based holder id for holder actions, else 0
    status: int  # the stop status of RequestStop, else 0
    state: RankState  # the rank's state after the step


class TraceRecorder:
    """Collects the transitions of one or more ``PauseProtocol`` objects (ranks) in one order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []
        self.n_ranks = 0
        self._holders: dict[tuple[int, int], int] = {}
        self.holder_rank: list[int] = []  # holder id - 1 -> rank

    def attach(self, protocol: object) -> int:
        with self._lock:
            self.n_ranks += 1
            return self.n_ranks

    def record(self, rank: int, fn_name: str, args: tuple, before: RankState, after: RankState) -> None:
        action = _camel(fn_name)
        if action == "Restart" and before.phase == "new":
            return  # the first clear() establishes TLA+'s Init
        holder = 0
        with self._lock:
            if action in HOLDER_ACTIONS:
                key = (rank, threading.get_ident())
                holder = self._holders.get(key, 0)
                if not holder:
                    self.holder_rank.append(rank)
                    holder = self._holders[key] = len(self.holder_rank)
            status = int(args[0]) if action == "RequestStop" else 0
            self.events.append(TraceEvent(action, rank, holder, status, after))


# --------------------------------------------------------------------------------------------- TLA+ output


def _tla(value) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    return '"' + str(value) + '"'


def _state(s: RankState) -> str:
    fields = {
        "pc": s.phase, "stop": s.stop, "tpStop": s.tp_stop, "tpPause": s.tp_pause, "obsStop": s.obs_stop,
        "obsPause": s.obs_pause, "fatal": s.fatal, "paused": s.paused, "count": s.count,
    }  # fmt: skip
    return "[" + ", ".join(f"{k} |-> {_tla(v)}" for k, v in fields.items()) + "]"


def write_trace(recorder: TraceRecorder, directory: Path, name: str = "Trace", events=None) -> tuple[Path, Path]:
    """Write ``<name>.tla`` (the log as a sequence literal) and ``<name>.cfg`` into ``directory``."""
    if not re.fullmatch(r"[A-Za-z]\w*", name):
        raise ValueError(f"not a TLA+ module name: {name!r}")
    events = recorder.events if events is None else events
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        f"a |-> {_tla(e.action)}, r |-> {e.rank}, h |-> {e.holder}, s |-> {e.status}, v |-> {_state(e.state)}"
        for e in events
    ]
    log = "<<\n    " + ",\n    ".join(f"[{ln}]" for ln in lines) + "\n>>" if lines else "<< >>"
    rank_of = "<<" + ", ".join(str(r) for r in recorder.holder_rank) + ">>" if recorder.holder_rank else "<< >>"
    module = directory / f"{name}.tla"
    module.write_text(
        f"---- MODULE {name} ----\n"
        "\\* A trace recorded from PauseProtocol (cbpause.traces), replayed by TracePauseProtocol.\n"
        "EXTENDS TracePauseProtocol\n\n"
        f"TraceRankOf == {rank_of}\n\n"
        f"TraceLog == {log}\n"
        "====\n"
    )
    holders = "{" + ", ".join(str(h) for h in range(1, len(recorder.holder_rank) + 1)) + "}"
    ranks = "{" + ", ".join(str(r) for r in range(1, max(recorder.n_ranks, 1) + 1)) + "}"
    cfg = directory / f"{name}.cfg"
    cfg.write_text(
        "CONSTANTS\n"
        f"    Ranks = {ranks}\n"
        f"    Holders = {holders}\n"
        "    RankOf <- TraceRankOf\n"
        "    Requests = {}\n"
        '    Faults = {"interrupt", "timeout", "error", "crash", "stop"}\n'
        "    MaxRestarts = 1000000\n"
        "    Log <- TraceLog\n"
        "INIT TraceInit\n"
        "NEXT TraceNext\n"
        "INVARIANT TraceNotAccepted\n"
    )
    return module, cfg


@dataclasses.dataclass
class TraceResult:
    accepted: bool
    steps: int  # events in the trace
    matched: int  # events matched (all of them when accepted)
    states: int | None  # distinct states TLC explored
    output: str


def validate(recorder: TraceRecorder, tla_dir: Path, workdir: Path | None = None, name: str = "Trace", events=None):
    """Check with TLC that the recorded trace is a behaviour of ``tla/PauseProtocol.tla``."""
    events = recorder.events if events is None else events
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cbpause-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for f in ("PauseProtocol.tla", "TracePauseProtocol.tla"):
        (workdir / f).write_text((Path(tla_dir) / f).read_text())
    write_trace(recorder, workdir, name, events)
    proc = subprocess.run(
        [find_java(), "-XX:+UseParallelGC", "-cp", str(find_jar()), "tlc2.TLC", "-workers", "1", "-deadlock",
         "-metadir", str(workdir / "meta"), "-config", f"{name}.cfg", name],
        cwd=workdir, capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    accepted = "Invariant TraceNotAccepted is violated" in out
    if not accepted and "No error has been found" not in out:
        raise RuntimeError(f"TLC could not check the trace:\n{out[-3000:]}")
    counts = re.findall(r"([\d,]+) distinct states found", out)
    depth = re.findall(r"The depth of the complete state graph search is (\d+)", out)
    states = int(counts[-1].replace(",", "")) if counts else None
    matched = len(events) if accepted else (int(depth[-1]) - 1 if depth else 0)
    return TraceResult(accepted, len(events), matched, states, out)
