"""TP=2 trace scenarios on the real loop: two ranks, each a process of its own (gloo on the CPU).

Each rank runs the same plan (its role by its rank), records its trace with its own
:class:`~cbpause.TraceRecorder` (``first_rank`` = its rank), and writes it as JSON for the parent, which merges
the two (:func:`cbpause.tlc.traces.merge`) and has TLC validate the group's trace.  A rank the plan kills writes
its trace and the time of its death first; the parent adds the ``Crash`` record that the dead rank cannot.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

from ...core.recorder import TraceEvent
from ...core.transitions import RankState
from ...testing import HANG_S
from ...tlc.traces import Trace, event_from_json, event_to_json, merge
from .episodes import RealRank, quiet_logs

__all__ = ["KILL_PHASES", "KILL_PLANS", "TIMEOUT_PLANS", "TP_PLANS", "load_group_trace", "tp_worker"]

KILL_PHASES = ("read", "reduce", "decided", "body", "step", "window", "peer", "barrier")
# kill_payload: rank 1 dies after the group all-reduce that agreed a non-empty payload, before the broadcast that
# would carry it: rank 0 holds the requests it drained (in transit) when the broadcast meets the death (issue 24).
KILL_PLANS = (*(f"kill_{phase}" for phase in KILL_PHASES), "kill_payload")
TP_PLANS = ("pauses", "two_holders", "peer_never", "stop", "fatal", *KILL_PLANS)
# The plans in which a peer never comes (it never pauses, its step failed, or it died): there the product's bounds on a
# peer running out is what the plan checks, and they are short.  In the others a peer is only ever slow (still
# loading, or descheduled on a loaded machine): their bounds are HANG_S, so that they never run out.
TIMEOUT_PLANS = ("peer_never", "fatal", *KILL_PLANS)
PEER_PARK_TIMEOUT = 2.0
CPU_GROUP_TIMEOUT = 4.0


def _write(outdir: str, rank: int, recorder: Any, **extra: Any) -> None:
    record = {"events": [event_to_json(e) for e in recorder.events], "holders": recorder.holder_rank, **extra}
    Path(outdir, f"rank{rank}.json").write_text(json.dumps(record))


def tp_worker(rank: int, world: int, port: int, ckpt: str, plan: str, seed: int, outdir: str) -> None:
    """One rank of a TP=2 scenario (spawned): play ``plan``, write the trace, exit."""
    from ...core.recorder import TraceRecorder
    from ...testing import ForwardProbe, join_tp_group, load_tp_model

    recorder = TraceRecorder(first_rank=rank)
    extra: dict = {}
    fault = plan in TIMEOUT_PLANS
    quiet_logs()
    try:
        join_tp_group(rank, world, port)
        model = load_tp_model(ckpt, world)
        probe = ForwardProbe()
        probe.attach(model)
        real = RealRank(model, probe, recorder, traffic=rank == 0, seed=seed + rank, bound=HANG_S,
                        peer_park_timeout=PEER_PARK_TIMEOUT if fault else HANG_S,
                        cpu_group_timeout=CPU_GROUP_TIMEOUT if fault else HANG_S).start()  # fmt: skip
        probe.wait_steps(2, HANG_S)
        _play(real, rank, plan, lambda: _die(outdir, rank, recorder))
        extra["lost"], extra["duplicated"] = real.finish()
    except BaseException:  # noqa: BLE001 - the parent reports it
        extra["error"] = traceback.format_exc()
    _write(outdir, rank, recorder, **extra)
    os._exit(0)  # a broken process group must not hold the exit


def _die(outdir: str, rank: int, recorder: Any) -> None:
    _write(outdir, rank, recorder, killed_ns=time.monotonic_ns())
    os.kill(os.getpid(), signal.SIGKILL)


def _play(real: RealRank, rank: int, plan: str, die: Any) -> None:
    from ...testing import StepGate, wait_for_phase

    status, bound = real.status, real.bound
    if plan == "pauses":  # rank 1 pauses late: it parks for rank 0's pause, then its holder joins
        if rank == 1:
            wait_for_phase(status, "peer", bound)
        real.pause_in_thread().release()
    elif plan == "two_holders":  # two holders per rank whose pauses overlap: the second enters the open window
        first = real.pause_in_thread()
        first.wait_inside()
        second = real.pause_in_thread()
        second.wait_inside()
        first.release()
        second.release()
    elif plan == "peer_never":  # rank 1 never pauses: it gives up on the peer's pause, rank 0 at the barrier
        if rank == 0:
            real.pause_in_thread().release()
        real.join()
    elif plan == "stop":
        if rank == 0:
            status.request_stop(status.HARD_STOP if real.rng.random() < 0.5 else status.FLUSH_AND_STOP)
        real.join()
    elif plan == "fatal":
        if rank == 1:
            real.probe.fail_with = RuntimeError("fault injected in rank 1's forward step")
        real.join()
    else:
        _kill(real, rank, plan.removeprefix("kill_"), die, StepGate, wait_for_phase)


def _kill(real: RealRank, rank: int, phase: str, die: Any, gate: Any, wait_for_phase: Any) -> None:
    """Rank 1 dies in ``phase``; rank 0 finds out through its collectives."""
    status, bound = real.status, real.bound
    if rank == 1 and phase == "barrier":  # before the window it is for
        gate(status, "pause_window", then=die)
    if phase in ("window", "peer", "barrier") and (rank == 0 or phase != "peer"):
        holder = real.pause_in_thread()
    if rank == 1:
        if phase == "payload":  # the broadcast is called only when the all-reduce agreed a payload
            real.manager.distributed_helper.tp_broadcast_object_from_rank_0 = lambda payload: die()
        elif phase == "step":
            real.probe.call_next = die
        elif phase in ("read", "reduce", "decided", "body"):
            method = {"read": "end_step", "reduce": "observe", "decided": "all_reduce", "body": "no_pause"}[phase]
            gate(status, method, then=die)
        elif phase == "window":
            holder.wait_inside()
            die()
        elif phase == "peer":
            wait_for_phase(status, "peer", bound)
            die()
        else:  # barrier: past the window, before the group's barrier
            holder.release()
    elif phase in ("window", "peer", "barrier"):
        holder.release()
    real.join()


def load_group_trace(outdir: Path, world: int) -> tuple[Trace, dict]:
    """The group's trace from the ranks' files (a ``Crash`` record added for a killed rank), and what they said."""
    parts, info = [], {"lost": 0, "duplicated": 0, "errors": [], "killed": []}
    crashes: list[TraceEvent] = []
    for rank in range(world):
        path = outdir / f"rank{rank}.json"
        if not path.exists():
            info["errors"].append(f"rank {rank} wrote nothing")
            continue
        record = json.loads(path.read_text())
        events = [event_from_json(e) for e in record["events"]]
        parts.append((events, record["holders"]))
        info["lost"] += record.get("lost", 0)
        info["duplicated"] += record.get("duplicated", 0)
        if "error" in record:
            info["errors"].append(f"rank {rank}: {record['error']}")
        if "killed_ns" in record:
            info["killed"].append(rank)
            state = (events[-1].state if events else RankState())._replace(phase="dead")
            crashes.append(TraceEvent("Crash", rank, None, 0, state, "", record["killed_ns"]))
    trace = merge([*parts, (crashes, [])], world)
    return trace, info
