"""Trace validation of a real server's lease table against ``tla/FleetPause.tla`` (issue 39).

``cbpause serve --lease-log FILE`` writes one JSON object per line, each an action of the lease table
(:meth:`cbpause.serve.leases.LeaseTable._record`: ``{"a": action, "e": epoch, "ver": label}``).  :func:`write_trace`
writes such a log as a TLA+ module (a sequence literal: this TLC reads no JSON) and a ``.cfg``;
``tla/TraceFleetPause.tla`` replays it, and :func:`validate` runs TLC on it.  A log is accepted when TLC reaches its
end (``TraceMatched``, shown by the witness ``NeverMatched`` breaking), as for the loop's traces
(:mod:`cbpause.tlc.traces`).  ``python -m cbpause.tlc.fleet_traces FILE...`` validates logs and exits 1 on a
rejection.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .launcher import run_tlc, trace_verdict

__all__ = ["ACTIONS", "FleetTraceResult", "read_log", "validate", "write_trace"]

# The records a lease table writes: FleetPause.tla's server steps (TraceFleetPause.tla's Recorded).
ACTIONS = ("PauseLease", "RenewLease", "RenewRefused", "WriteBegin", "WriteRefused", "Received", "WriteEnd",
           "WriteFail", "WriteCut", "LeaseExpires", "ResumeLease")  # fmt: skip


def read_log(path: Path) -> list[dict]:
    """The records of a lease log (``ValueError`` for a line that is not a record)."""
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not (isinstance(record, dict) and record.get("a") in ACTIONS and isinstance(record.get("e"), int)
                and isinstance(record.get("ver"), int) and isinstance(record.get("staged", False), bool)
                and isinstance(record.get("torn", False), bool)):  # fmt: skip
            raise ValueError(f"{path}:{n}: not a lease-log record: {line[:200]!r}")
        records.append(record)
    return records


def write_trace(records: Sequence[dict], directory: Path, name: str = "FleetTrace") -> tuple[Path, Path]:
    """``<name>.tla`` (the log as a sequence literal) and ``<name>.cfg`` in ``directory``: one server, as many
    epochs as the log's leases (at least one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # A cut write's label (negative in the log) is FleetPause's Partial(e), MaxEpoch + e: no negative number in TLA+.
    # A record without ``torn`` (a hand-written log) says what a partial label implies; the lease table writes it.
    entries = [f'[a |-> "{r["a"]}", e |-> {r["e"]}, ver |-> {_ver(r["ver"])}, '
               f'staged |-> {_bool(r.get("staged") is True)}, torn |-> {_bool(r.get("torn", r["ver"] < 0))}]'
               for r in records]  # fmt: skip
    log = "<<\n    " + ",\n    ".join(entries) + "\n>>" if entries else "<< >>"
    module = directory / f"{name}.tla"
    module.write_text(f"---- MODULE {name} ----\n\\* A lease log of cbpause serve, replayed by TraceFleetPause.\n"
                      f"EXTENDS TraceFleetPause\n\nTraceLog == {log}\n====\n")  # fmt: skip
    epochs = max([r["e"] for r in records] + [abs(r["ver"]) for r in records] + [1])
    cfg = directory / f"{name}.cfg"
    cfg.write_text(
        "CONSTANTS\n    s1 = s1\n    Servers = {s1}\n"
        f"    MaxEpoch = {epochs}\n    MaxLosses = 0\n    TTL = 1\n    MaxRestarts = 0\n    Leased = TRUE\n"
        "    WriteOrder = TRUE\n    WriteTTL = 1\n    OwnLease = TRUE\n    NTrainers = 1\n    Fence = TRUE\n"
        "    Broadcast = FALSE\n    Staged = TRUE\n    TornHold = TRUE\n"
        "    Log <- TraceLog\n"
        "INIT TraceInit\nNEXT TraceNext\n"
        "INVARIANT TypeOK\nINVARIANT NeverMatched\n"
        "PROPERTY OwnLeaseWrite\nPROPERTY GoneStaysGone\nPROPERTY TransferFailureKeepsWeights\n"
        "PROPERTY TornMendedOnlyByWrite\n"
    )
    return module, cfg


def _bool(value: bool) -> str:
    return "TRUE" if value else "FALSE"


def _ver(label: int) -> str:
    return str(label) if label >= 0 else f"Partial({-label})"


@dataclasses.dataclass
class FleetTraceResult:
    accepted: bool
    steps: int  # records in the log
    matched: int | None  # records matched: all of them when accepted, unknown otherwise
    states: int | None
    output: str


def validate(records: Sequence[dict], tla_dir: Path, workdir: Path | None = None) -> FleetTraceResult:
    """Check with TLC that the log is a behaviour of one server of ``tla/FleetPause.tla``."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cbpause-fleet-trace-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for f in ("FleetPause.tla", "TraceFleetPause.tla"):
        shutil.copy(Path(tla_dir) / f, workdir / f)
    write_trace(records, workdir)
    run = run_tlc("FleetTrace", "FleetTrace.cfg", workdir, mode="trace")
    accepted, _ = trace_verdict(run, "the lease log")
    # TLC says nothing of a log it could not match but that it could not: which record is the caller's to find.
    return FleetTraceResult(accepted, len(records), len(records) if accepted else None, run.distinct_states,
                            run.output)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbpause.tlc.fleet_traces", description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path)
    p.add_argument("--tla-dir", type=Path, default=Path("tla"))
    args = p.parse_args(argv)
    rejected = 0
    for log in args.logs:
        records = read_log(log)
        result = validate(records, args.tla_dir)
        rejected += not result.accepted
        print(f"{log}: {'accepted' if result.accepted else 'REJECTED'} ({result.steps} records, {result.states} "
              f"states)")  # fmt: skip
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())
