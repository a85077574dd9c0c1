"""Trace validation of the real loop's labels against ``tla/RequestVersions.tla`` (issue 40, point 2).

A traced :class:`~cbpause.integrations.transformers.PausableContinuousBatchingManager` (``trace=TraceRecorder()``)
writes, beside its PauseProtocol trace, RequestVersions' steps (:data:`cbpause.core.recorder.LABEL_RECORDS`): each
forward step's Launch (the requests it computes) and Land (the weight and KV label of each new token), each window's
OpenWindow (its mode) or DrainFirst and CloseWindow, each weight version set inside a window (Update), each terminal
output with its label sequences (Output).  :func:`write_trace` merges them, in the order of one clock, with the
driver's Submit records and writes the log as a TLA+ module; ``tla/TraceRequestVersions.tla`` replays it, and
:func:`validate` runs TLC on it.  A trace is accepted when TLC reaches the end of the log.

Requests are numbered from 1 in the order of their Submit, as in :func:`cbpause.tlc.traces.request_numbers`.  Weight
versions are numbered in the order the holders set them: the version in force when the trace starts is 0, and each
Update the next number (the spec's ``wv``); the first label seen before any Update is taken for the version in force
at the start, and any other label the trace never saw set is numbered 98, no version (TLC rejects it).  A token's
number is the one its Land gave it, so a version set again later (weights rolled back) does not renumber it.

What a traced run must be (docs/verification.md, section 9, lists what the spec does not model): every request asks
for the same number of new tokens (the spec's ``Tokens``, the caller's ``tokens``), with no end-of-sequence stop
(``cbpause.testing.greedy_config``), a prompt prefilled in one step, and its output collected; no cancellation, no
hard stop, no request refused at admission or taken out of the batch under cache pressure, no async batching; with a
staleness bound, integer versions one apart, the first set before any request (the loop counts the distance of the
integers, the spec the updates).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path

from ..core.recorder import TraceRecorder
from .launcher import run_tlc, trace_verdict

__all__ = ["LabelTraceResult", "label_log", "validate", "write_trace"]

NONE = 99  # RequestVersions' NONE: no staleness bound
MODES = {"keep": 1, "retract": 2, "drain": 3, "abort": 4}
INVARIANTS = ("TypeOK", "NothingLostInv", "LabelInv", "KvLabelInv", "StalenessInv", "NoStalePrefixInv",
              "ModeEffectInv", "RetractInv", "DeliveredAtEnd")  # fmt: skip
UNKNOWN = 98  # the number of a label that is neither the version in force at the start nor one set since: no version
PROPERTIES = ("LabelProp", "KvLabelProp")


def _expand(spans: Sequence[tuple[int, Hashable]], n: int) -> list[Hashable]:
    """A span list ``[(first token index, version), ...]`` as one version per token, for ``n`` tokens."""
    labels: list[Hashable] = []
    for k, (start, version) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else n
        labels.extend([version] * max(0, end - start))
    return labels


def _numbered(spans: Sequence[tuple[int, Hashable]], n: int, landed: list[tuple[Hashable, int]]) -> list[int]:
    """An output's labels as numbers: each token's as its Land numbered it (the output's ``n`` tokens are the request's
    last ``n`` landed: a restart starts them again), where the output's version is the one landed; UNKNOWN where it
    is not (the output then disagrees with the steps, and TLC rejects it).  Numbering at the Land keeps a version
    set again later (weights rolled back) from renumbering the tokens of before."""
    raw = _expand(spans, n)
    last = landed[-len(raw):] if raw else []
    if len(last) < len(raw):
        last = [(object(), UNKNOWN)] * (len(raw) - len(last)) + last
    return [number if _same(version, was) else UNKNOWN for version, (was, number) in zip(raw, last, strict=True)]


def label_log(recorder: TraceRecorder, rank: int = 0) -> list[dict]:
    """The log TraceRequestVersions replays: rank ``rank``'s Submit records and label records in time order, with
    requests and weight versions numbered (see the module's docstring)."""
    submits = [(e.time_ns, 0, "Submit", {"id": e.request, "accepted": e.argument}) for e in recorder.events
               if e.action == "Submit" and e.rank == rank]  # fmt: skip
    labels = [(e.time_ns, 1, e.action, e.fields) for e in recorder.labels if e.rank == rank]
    requests: dict[str, int] = {}
    counter = itertools.count(1)
    versions: dict[Hashable, int] = {}
    updates = itertools.count(1)

    def request(request_id: str, new: bool = False) -> int:
        if new or request_id not in requests:
            requests[request_id] = next(counter)
        return requests[request_id]

    initial: list = []  # the version in force at the start: the first label seen before any Update

    def number(version: Hashable) -> int:
        try:
            if version in versions:
                return versions[version]
        except TypeError:  # unhashable: never set by a holder (set() refuses those)
            return UNKNOWN
        if not versions and not initial:
            initial.append(version)
        return 0 if initial and _same(version, initial[0]) else UNKNOWN

    landed: dict[int, list] = {}  # request number -> ((weight, its number), (kv, its number)) of each token landed
    kv_numbers: dict[int, tuple] = {}  # request number -> (its KV label, that label's number) at its last Land
    log = []
    for _, _, action, f in sorted(submits + labels, key=lambda r: (r[0], r[1])):
        rec = {"a": action, "q": 0, "arg": 0, "set": [], "labs": [], "w": [], "kv": []}
        if action == "Submit":
            rec.update(q=request(f["id"], new=True), arg=int(f["accepted"]))
        elif action == "Launch":
            rec["set"] = sorted({request(i) for i in f["ids"]})
        elif action == "Land":
            labs = set()
            for i, w, kv, *draw in f["labels"]:
                q = request(i)
                # A request's KV label names the version its KV started with: numbered once, at the first Land that
                # shows it, so that weights rolled back to that value later do not renumber it.
                was = kv_numbers.get(q)
                kv_number = was[1] if was is not None and _same(was[0], kv) else number(kv)
                kv_numbers[q] = (kv, kv_number)
                labs.add((q, number(w), kv_number, draw[0] if draw else -1))
                landed.setdefault(q, []).append(((w, number(w)), (kv, kv_number)))
            rec["labs"] = sorted(labs)
        elif action in ("OpenWindow", "DrainFirst"):
            rec["arg"] = int(f["mode"])
        elif action == "Update":
            versions[f["version"]] = next(updates)
        elif action == "Output":
            n, q = int(f["tokens"]), request(f["id"])
            seen = landed.pop(q, [])
            kv_numbers.pop(q, None)
            rec.update(q=q, arg=int(bool(f["failed"])), w=_numbered(f["weights"], n, [w for w, _ in seen]),
                       kv=_numbered(f["kv"], n, [kv for _, kv in seen]))  # fmt: skip
        log.append(rec)
    return log


def _same(a: Hashable, b: Hashable) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a version whose equality raises is no version
        return False


def _tla_record(rec: dict) -> str:
    def seq(xs) -> str:
        return "<<" + ", ".join(str(x) for x in xs) + ">>"

    labs = "{" + ", ".join(seq(t) for t in rec["labs"]) + "}"
    ids = "{" + ", ".join(map(str, rec["set"])) + "}"
    return (f'[a |-> "{rec["a"]}", q |-> {rec["q"]}, arg |-> {rec["arg"]}, set |-> {ids}, labs |-> {labs}, '
            f"w |-> {seq(rec['w'])}, kv |-> {seq(rec['kv'])}]")  # fmt: skip


def write_trace(log: Sequence[dict], directory: Path, tokens: int, name: str = "LabelTrace",
                max_staleness: int | None = None, on_stale: str = "restart", max_restarts: int = 0,
                ) -> tuple[Path, Path]:  # fmt: skip
    """``<name>.tla`` (the log as a sequence literal) and ``<name>.cfg`` in ``directory``; ``tokens`` is the number of
    new tokens every request asked for, the rest the manager's staleness bound (``max_staleness=None``: none)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    entries = ",\n    ".join(_tla_record(r) for r in log)
    module = directory / f"{name}.tla"
    module.write_text(f"---- MODULE {name} ----\n\\* The real loop's labels, replayed by TraceRequestVersions.\n"
                      f"EXTENDS TraceRequestVersions\n\nTraceLog == <<\n    {entries}\n>>\n====\n")  # fmt: skip
    n_requests = max([r["q"] for r in log] + [1])
    updates = sum(r["a"] == "Update" for r in log)
    windows = sum(r["a"] == "OpenWindow" for r in log)
    cfg = directory / f"{name}.cfg"
    cfg.write_text(
        "CONSTANTS\n"
        f"    Requests = {{{', '.join(str(q) for q in range(1, n_requests + 1))}}}\n"
        f"    Tokens = {tokens}\n    MaxVersion = {updates}\n    MaxWindows = {max(windows, 1)}\n"
        "    Modes = {1, 2, 3, 4}\n    Forget = TRUE\n    Reject = FALSE\n    Async = TRUE\n    LabelAtLaunch = TRUE\n"
        f"    MaxStaleness = {NONE if max_staleness is None else max_staleness}\n    OnStale = \"{on_stale}\"\n"
        f"    MaxRestarts = {max_restarts}\n"
        "    Log <- TraceLog\n"
        "INIT TraceInit\nNEXT TraceNext\n"
        + "".join(f"INVARIANT {i}\n" for i in INVARIANTS)
        + "".join(f"PROPERTY {p}\n" for p in PROPERTIES)
        + "INVARIANT NeverMatched\n"
    )
    return module, cfg


@dataclasses.dataclass
class LabelTraceResult:
    accepted: bool
    steps: int  # records in the log
    matched: int  # records matched (all of them when accepted)
    states: int | None  # distinct states TLC explored
    output: str
    violated: str = ""  # the invariant or property a rejected trace broke on the way


def validate(
    log: Sequence[dict], tla_dir: Path, tokens: int, workdir: Path | None = None, **constants: object
) -> LabelTraceResult:
    """Check with TLC that ``log`` (:func:`label_log`) is a behaviour of ``tla/RequestVersions.tla``."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="cbpause-labels-"))
    workdir.mkdir(parents=True, exist_ok=True)
    for f in ("RequestVersions.tla", "TraceRequestVersions.tla"):
        shutil.copy(Path(tla_dir) / f, workdir / f)
    write_trace(log, workdir, tokens, **constants)
    run = run_tlc("LabelTrace", "LabelTrace.cfg", workdir, mode="trace")
    accepted, violated = trace_verdict(run, "the label trace")
    matched = len(log) if accepted else _matched(run.output)
    return LabelTraceResult(accepted, len(log), matched, run.distinct_states, run.output, violated)


def _matched(output: str) -> int:
    """How many records the longest replay matched: the largest ``vi`` TLC printed in a state, minus one (TLC prints
    states only with a violation; without one, the depth of its search: silent admissions counted too)."""
    shown = [int(v) for v in re.findall(r"/\\ vi = (\d+)", output)]
    if shown:
        return max(shown) - 1
    depth = re.search(r"depth of the complete state graph search is (\d+)", output)
    return int(depth.group(1)) - 1 if depth else 0
