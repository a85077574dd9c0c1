"""The whole TLA+ state in Python: ranks, holders and requests, and every step TLA+'s ``Next`` allows.

:class:`GroupState` puts together what ``tla/PauseProtocol.tla`` keeps in its variables: one
:class:`~cbpause.core.transitions.RankState` per rank, each holder's state (``hs``) and each request's
(``req``, ``out``).  :func:`next_steps` is TLA+'s ``Next`` built from the rank transitions of
:mod:`cbpause.core.transitions`, so that each state change has one definition; with :class:`Bounds` it is the
``MCSpec`` of ``tla/MCPauseProtocol.tla`` (the environment within its budgets).  The group invariants are
TLA+'s, one function each.  The state-graph comparison with TLC (:mod:`cbpause.tlc.conformance`) and the
Hypothesis state machine (``tests/test_protocol_machine.py``) are built on this module.

Ranks and holders are numbered from 0 in Python, as torch.distributed numbers its ranks, and from 1 in
TLA+, in TLC's output and in traces, so that TLC prints a per-rank variable as a sequence
(``<<"read", "read">>``).  :func:`tla_number` is the one place that converts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from . import transitions as t
from .transitions import (
    ABORT,
    DRAIN,
    FLUSH_AND_STOP,
    HARD_STOP,
    KEEP,
    MODES,
    PARKED_PHASES,
    PHASES,
    RankState,
)  # fmt: skip

# A dead holder (TLA+ "dead") is kept as "dead:waiting" or "dead:inside": the rank counts it where it was, and
# its release (ReleaseDeadHolder) takes it from there; tla_holder_state() gives TLA+'s value.
HOLDER_STATES = ("idle", "queued", "waiting", "inside", "dead:waiting", "dead:inside")
REQUEST_STATES = ("new", "queued", "drained", "waiting", "active", "done", "delivered", "rejected")
HELD = ("queued", "drained", "waiting", "active")  # TLA+ ``Held``: the driver's queue, its hand and its scheduler
FAULTS = frozenset({"interrupt", "timeout", "error", "crash", "stop", "death"})
DRIVER = 0  # the TP driver, TLA+'s Driver: the smallest rank


def tla_number(index: int) -> int:
    """The TLA+ number of the rank or holder with Python index ``index`` (see the module's docstring)."""
    return index + 1


# The holder actions, the one table of them: who takes each (the holder's own thread; the environment, as an
# exception, a timeout or a death that lands in that thread; or the loop), and the holder's TLA+ state ``hs[h]``
# after it.  The recorder numbers the holders of these actions, PauseProtocol sets a hold's state from it and
# wakes nobody on a step of a live holder's thread, and the docs' sequence diagrams draw each from its actor.
HOLDER_ACTIONS: dict[str, tuple[str, str]] = {
    "RequestPause": ("holder", "waiting"),
    "QueuePause": ("holder", "queued"),
    "LeaveQueue": ("environment", "idle"),
    "EnterPause": ("holder", "inside"),
    "LeavePause": ("holder", "idle"),
    "PauseFails": ("holder", "idle"),
    "Interrupt": ("environment", "idle"),
    "PauseTimeout": ("environment", "idle"),
    "HolderDies": ("environment", "dead"),
    "ReleaseDeadHolder": ("loop", "idle"),
}

# RankState's fields that are TLA+ variables indexed by rank (the others -- waiting, inside, n_keep ... -- TLA+
# derives from hs and hmode), and the two the group shares (one value in TLA+, a copy on each rank here).  Their
# TLA+ names are derived (tla_variable): the name table's rule, snake case in Python, camel case in TLA+.
RANK_VARIABLES = ("phase", "local_status", "obs_status", "obs_pause", "fatal", "draining", "count", "paused", "closing")
SHARED_VARIABLES = ("tp_status", "tp_pause")


def tla_variable(field: str) -> str:
    """The TLA+ variable of a Python field: ``local_status`` -> ``localStatus``."""
    head, *rest = field.split("_")
    return head + "".join(part.capitalize() for part in rest)


def python_name(action: str) -> str:
    """The Python function of a TLA+ action: ``OpenWindow`` -> ``open_window``."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in action).lstrip("_")


def tla_holder_state(state: str) -> str:
    """TLA+'s ``hs[h]`` for a holder state of :data:`HOLDER_STATES` (``"dead:inside"`` -> ``"dead"``)."""
    return state.split(":", 1)[0]


@dataclass(frozen=True)
class GroupState:
    """The TLA+ state: ranks, holders (``hs``, ``hmode``), requests (``req``, ``out``), and the history ``restarts``.

    ``rank_of[h]`` is the index in ``ranks`` of holder ``h``'s rank.  TLA+'s ``tpStatus`` and ``tpPause``
    are kept in every :class:`RankState` and are equal across ranks (``type_ok``).

    inv: len(self.hs) == len(self.rank_of) == len(self.hmode)
    inv: all(0 <= r < len(self.ranks) for r in self.rank_of)
    inv: len(self.req) == len(self.out)
    """

    ranks: tuple[RankState, ...]
    rank_of: tuple[int, ...]
    hs: tuple[str, ...]
    req: tuple[str, ...]
    out: tuple[int, ...]
    hmode: tuple[int, ...]
    restarts: int = 0


@dataclass(frozen=True)
class Bounds:
    """The budgets of ``tla/MCPauseProtocol.tla``: which faults the environment may inject (``Faults``), and
    how many restarts (``MaxRestarts``), and the modes holders ask for (``Modes``).  At most one rank ever
    crashes."""

    faults: frozenset[str] = FAULTS
    max_restarts: int = 1
    modes: frozenset[int] = frozenset({KEEP})


def initial_group(n_ranks: int, rank_of: tuple[int, ...], n_requests: int) -> GroupState:
    """TLA+ ``Init``: every rank cleared and at ``read``."""
    return GroupState(
        ranks=tuple(RankState(phase="read") for _ in range(n_ranks)),
        rank_of=tuple(rank_of),
        hs=("idle",) * len(rank_of),
        req=("new",) * n_requests,
        out=(0,) * n_requests,
        hmode=(0,) * len(rank_of),
    )


def _set_rank(g: GroupState, r: int, s: RankState) -> GroupState:
    return replace(g, ranks=g.ranks[:r] + (s,) + g.ranks[r + 1 :])


def _set_holder(g: GroupState, h: int, state: str, mode: int | None = None) -> GroupState:
    """Holder ``h`` is now in ``state``, with ``mode`` (0 once idle; unchanged if ``None``)."""
    if mode is None:
        mode = 0 if state == "idle" else g.hmode[h]
    return replace(g, hs=g.hs[:h] + (state,) + g.hs[h + 1 :], hmode=g.hmode[:h] + (mode,) + g.hmode[h + 1 :])


def queued_modes(g: GroupState, r: int) -> tuple[int, ...]:
    """The modes of the holders queued at rank ``r``'s closing window (TLA+ ``Queued(r)``), in holder order."""
    return tuple(g.hmode[x] for x, state in enumerate(g.hs) if state == "queued" and g.rank_of[x] == r)


def _drop(g: GroupState, h: int, fn: Callable[..., RankState], *args: object) -> GroupState:
    """TLA+ ``Drop(h)`` through ``fn`` (a drop of :mod:`~cbpause.core.transitions`): holder ``h`` is idle, and
    once the window has closed the holders queued at it are waiting."""
    r = g.rank_of[h]
    after = fn(g.ranks[r], *args, queued_modes(g, r))
    g = _set_holder(_set_rank(g, r, after), h, "idle")
    if not after.paused:
        g = replace(g, hs=tuple("waiting" if state == "queued" and g.rank_of[x] == r else state
                                for x, state in enumerate(g.hs)))  # fmt: skip
    return g


def _set_request(g: GroupState, i: int, state: str) -> GroupState:
    return replace(g, req=g.req[:i] + (state,) + g.req[i + 1 :])


def submit(g: GroupState, i: int) -> GroupState:
    """P-SUBMIT (``Submit``): request ``i`` is queued if the driver accepts requests, else rejected, in one step."""
    return _set_request(g, i, "queued" if t.can_submit(g.ranks[DRIVER]) else "rejected")


def deliver(g: GroupState, i: int) -> GroupState:
    """P-DELIVER (``Deliver``): the terminal output of request ``i`` reaches its caller."""
    return _set_request(g, i, "delivered")


def admits(g: GroupState) -> bool:
    """TLA+ ``Admits``: no drain holds admission (a drain that found work steps only the requests in flight)."""
    return not g.ranks[DRIVER].draining


def has_work(g: GroupState) -> bool:
    """TLA+ ``HasWork``: the scheduler has requests it may step (in flight, or waiting while it admits)."""
    return "active" in g.req or ("waiting" in g.req and admits(g))


def in_flight(g: GroupState) -> bool:
    """TLA+ ``InFlight``: a request has been stepped and has not ended (what a drain waits for)."""
    return "active" in g.req


def in_hand(g: GroupState) -> bool:
    """TLA+ ``InHand``: the driver drained requests that the payload broadcast has not carried yet."""
    return "drained" in g.req


def payload_pending(g: GroupState) -> bool:
    """TLA+ ``PayloadPending``: the payload of a rank's iteration is still to be broadcast (requests in hand, the
    driver not gone on to its next iteration, whose payload a peer still in the body of the one before does not
    wait for)."""
    return in_hand(g) and g.ranks[DRIVER].phase not in ("read", "reduce")


def broadcast(g: GroupState) -> GroupState:
    """P-BROADCAST (``Broadcast``): every rank at ``body`` takes part in the payload broadcast, which admits what the
    driver drained to every rank's scheduler.

    pre: in_hand(g) and all(s.phase == "body" for s in g.ranks)
    post: not in_hand(__return__) and __return__.ranks == g.ranks
    """
    return replace(g, req=tuple("waiting" if q == "drained" else q for q in g.req))


def _finish(g: GroupState, r: int, held: tuple[str, ...]) -> GroupState:
    """On the driver, every request in one of the states ``held`` gets its terminal output."""
    if r != DRIVER:
        return g
    req = tuple("done" if q in held else q for q in g.req)
    out = tuple(o + 1 if q in held else o for q, o in zip(g.req, g.out, strict=True))
    return replace(g, req=req, out=out)


def _fail_remaining(g: GroupState, r: int) -> GroupState:
    """TLA+ ``FailRemaining(r)``."""
    return _finish(g, r, HELD)



# ------------------------------------------------------------------------------------------------ Next


def _loop_steps(g: GroupState, r: int, s: RankState) -> Iterator[tuple[str, GroupState]]:
    """TLA+'s ``LoopAction(r)``."""
    tag = f"({tla_number(r)})"
    if t.can_observe(s):
        succ = _set_rank(g, r, t.observe(s))
        if r == DRIVER:
            succ = replace(succ, req=tuple("drained" if q == "queued" else q for q in g.req))
        yield "Observe" + tag, succ
    if t.can_drain_first(s):
        yield "DrainFirst" + tag, _set_rank(g, r, t.drain_first(s))
    if t.can_open_window(s):
        yield "OpenWindow" + tag, _set_rank(g, r, t.open_window(s))
    if t.can_skip_window(s):
        yield "SkipWindow" + tag, _set_rank(g, r, t.skip_window(s))
    if t.can_park_for_peer(s):
        yield "ParkForPeer" + tag, _set_rank(g, r, t.park_for_peer(s))
    if t.can_join_peer_pause(s):
        yield "JoinPeerPause" + tag, _set_rank(g, r, t.join_peer_pause(s))
    if t.can_peer_park_timeout(s):
        yield "PeerParkTimeout" + tag, _fail_remaining(_set_rank(g, r, t.peer_park_timeout(s)), r)
    collective = t.can_collective_timeout(s) and (s.phase != "body" or payload_pending(g))
    if collective and any(q.phase != s.phase for q in g.ranks):
        yield "CollectiveTimeout" + tag, _fail_remaining(_set_rank(g, r, t.collective_timeout(s)), r)
    if t.can_close_window(s):
        yield "CloseWindow" + tag, _set_rank(g, r, t.close_window(s))
    if t.can_no_pause(s):
        yield "NoPause" + tag, _set_rank(g, r, t.no_pause(s))
    if t.can_start_step(s) and has_work(g) and not payload_pending(g):
        yield "StartStep" + tag, _set_rank(g, r, t.start_step(s))
    if t.can_end_step(s):
        stepped = _finish(_set_rank(g, r, t.end_step(s)), r, ("active",))
        if r == DRIVER and admits(g):  # a request's first step puts it in flight, unless a drain holds admission
            stepped = replace(stepped, req=tuple("active" if q == "waiting" else q for q in stepped.req))
        yield "EndStep" + tag, stepped
    if t.can_idle(s) and not has_work(g) and not payload_pending(g):
        yield "Idle" + tag, _set_rank(g, r, t.idle(s))
    if t.may_exit(s) and not (s.phase == "body" and (has_work(g) or payload_pending(g))):
        yield "ExitLoop" + tag, _fail_remaining(_set_rank(g, r, t.exit_loop(s)), r)


def _holder_steps(
    g: GroupState, h: int, state: str, s: RankState, modes: frozenset[int]
) -> Iterator[tuple[str, GroupState]]:
    """The system's steps of holder ``h`` (TLA+'s ``RequestPause``, ``QueuePause``, ``HolderWakes``, ``LeavePause``)."""
    r, mode = g.rank_of[h], g.hmode[h]
    tag = f"({tla_number(h)})"
    if state == "idle" and t.can_request_pause(s):
        for m in sorted(modes):
            if s.closing:  # R-WINDOW-CLOSES: queued, not counted, until the window closes
                yield "QueuePause" + tag, _set_holder(_set_rank(g, r, t.queue_pause(s, m)), h, "queued", m)
            else:
                yield "RequestPause" + tag, _set_holder(_set_rank(g, r, t.request_pause(s, m)), h, "waiting", m)
    if state == "waiting" and t.can_enter_window(s, mode):
        yield "EnterPause" + tag, _set_holder(_set_rank(g, r, t.enter_pause(s)), h, "inside")
    if state == "inside":
        yield "LeavePause" + tag, _drop(g, h, t.leave_pause, mode)
    if state == "waiting" and t.can_pause_fails(s):
        yield "PauseFails" + tag, _drop(g, h, t.pause_fails, mode)
    if state.startswith("dead:") and t.dead_holder_releasable(s):
        yield "ReleaseDeadHolder" + tag, _drop(g, h, t.release_dead_holder, state == "dead:inside", mode)


def _system_steps(g: GroupState, modes: frozenset[int]) -> Iterator[tuple[str, GroupState]]:
    """TLA+'s ``SystemNext`` without its stuttering ``Terminated``; holders ask for ``modes``."""
    for r, s in enumerate(g.ranks):
        yield from _loop_steps(g, r, s)
    if all(t.can_all_reduce(s) for s in g.ranks):
        tp_status = max(s.obs_status for s in g.ranks)
        tp_pause = max(s.obs_pause for s in g.ranks)
        busy = in_flight(g)  # each rank's batch, a copy of the driver's
        succ = replace(g, ranks=tuple(t.all_reduce(s, tp_status, tp_pause, busy) for s in g.ranks))
        if tp_pause == ABORT and tp_status < HARD_STOP:  # every request the driver holds ends, before any window
            succ = _fail_remaining(succ, DRIVER)
        yield "AllReduce", succ
    if all(t.can_barrier(s) for s in g.ranks):
        yield "Barrier", replace(g, ranks=tuple(t.barrier(s) for s in g.ranks))
    if in_hand(g) and all(s.phase == "body" for s in g.ranks):
        yield "Broadcast", broadcast(g)
    for h, state in enumerate(g.hs):
        s = g.ranks[g.rank_of[h]]
        if s.phase != "dead":
            yield from _holder_steps(g, h, state, s, modes)
    for i, q in enumerate(g.req):
        if q == "new":
            yield f"Submit({tla_number(i)})", submit(g, i)
        if q == "done" and g.ranks[DRIVER].phase != "dead":
            yield f"Deliver({tla_number(i)})", deliver(g, i)


def _environment_steps(g: GroupState, bounds: Bounds | None) -> Iterator[tuple[str, GroupState]]:
    """TLA+'s ``EnvironmentNext``; within ``bounds``, ``MCEnvironmentNext``."""

    def allowed(fault: str) -> bool:
        return bounds is None or fault in bounds.faults

    for h, state in enumerate(g.hs):
        r = g.rank_of[h]
        s = g.ranks[r]
        if state == "waiting" and s.phase != "dead":
            tag = f"({tla_number(h)})"
            mode = g.hmode[h]
            if allowed("interrupt"):
                yield "Interrupt" + tag, _drop(g, h, t.interrupt, mode)
            if allowed("timeout"):
                yield "PauseTimeout" + tag, _drop(g, h, t.pause_timeout, mode)
        if state == "queued" and s.phase != "dead" and any(map(allowed, ("interrupt", "timeout", "stop", "error"))):
            yield f"LeaveQueue({tla_number(h)})", _set_holder(_set_rank(g, r, t.leave_queue(s)), h, "idle")
        if state in ("waiting", "inside") and s.phase != "dead" and allowed("death"):
            yield f"HolderDies({tla_number(h)})", holder_dies(g, h)
    none_dead = all(s.phase != "dead" for s in g.ranks)
    for r, s in enumerate(g.ranks):
        tag = f"({tla_number(r)})"
        if allowed("stop"):
            for status in (FLUSH_AND_STOP, HARD_STOP):
                if t.can_request_stop(s, status):
                    yield f"RequestStop({tla_number(r)}, {status})", _set_rank(g, r, t.request_stop(s, status))
        if allowed("error") and t.can_record_fatal_error(s):
            yield "RecordFatalError" + tag, _fail_remaining(_set_rank(g, r, t.record_fatal_error(s)), r)
        if allowed("error") and t.can_fail_loop(s):
            yield "FailLoop" + tag, _fail_remaining(_set_rank(g, r, t.fail_loop(s)), r)
        if allowed("crash") and (bounds is None or none_dead) and t.live(s):
            yield "Crash" + tag, _set_rank(g, r, t.crash(s))
    budget = bounds is None or g.restarts < bounds.max_restarts
    if budget and all(s.phase == "stopped" for s in g.ranks) and all(x == "idle" for x in g.hs):
        yield "Restart", replace(g, ranks=tuple(t.restart(s) for s in g.ranks), restarts=g.restarts + 1)


def holder_dies(g: GroupState, h: int) -> GroupState:
    """P-HOLDER-DIES (``HolderDies``): holder ``h``'s thread ends while it waits or is inside; only ``hs`` changes
    (the rank does not know yet; :func:`cbpause.core.transitions.release_dead_holder` is what it does once it does).

    pre: g.hs[h] in ("waiting", "inside")
    post: __return__.hs[h] == "dead:" + g.hs[h] and __return__.ranks == g.ranks
    """
    return _set_holder(g, h, "dead:" + g.hs[h])


def next_steps(g: GroupState, bounds: Bounds | None = None) -> list[tuple[str, GroupState]]:
    """Every step TLA+'s ``Next`` allows from ``g`` (``MCSpec``'s, within ``bounds``), as ``(label, successor)``.

    The label is the TLA+ action with its arguments, numbered as in TLA+ (:func:`tla_number`), e.g.
    ``"OpenWindow(1)"``.  ``Terminated`` (a stuttering step) is left out.
    """
    modes = frozenset(MODES) if bounds is None else bounds.modes
    return [*_system_steps(g, modes), *_environment_steps(g, bounds)]


def action_name(label: str) -> str:
    """``"OpenWindow(1)"`` -> ``"OpenWindow"``."""
    return label.split("(", 1)[0]


def terminated(g: GroupState) -> bool:
    """TLA+ ``Terminated``'s guard: every loop has ended for good."""
    return all(s.phase in ("stopped", "dead") for s in g.ranks)


# ------------------------------------------------------------------------------------------ group invariants


def any_inside(g: GroupState) -> bool:
    """TLA+ ``AnyInside``."""
    return any(x == "inside" and g.ranks[g.rank_of[h]].phase != "dead" for h, x in enumerate(g.hs))


def exclusion_inv(g: GroupState) -> bool:
    """R-EXCLUSION (``ExclusionInv``)."""
    return not any_inside(g) or all(s.phase != "step" for s in g.ranks)


def same_window_inv(g: GroupState) -> bool:
    """R-SAME-WINDOW (``SameWindowInv``)."""
    if any(s.paused and s.phase not in ("window", "dead") for s in g.ranks):
        return False
    for h, x in enumerate(g.hs):
        own = g.ranks[g.rank_of[h]]
        if x == "inside" and own.phase != "dead":
            if not (own.paused and own.phase == "window"):
                return False
            if not all(q.phase in PARKED_PHASES for q in g.ranks if t.live(q)):
                return False
    return True


def counts_inv(g: GroupState) -> bool:
    """R-COUNTS (``CountsInv``)."""
    for r, s in enumerate(g.ranks):
        mine = [x for h, x in enumerate(g.hs) if g.rank_of[h] == r]
        if s.count < 0 or s.count != sum(x not in ("idle", "queued") for x in mine):
            return False
        if s.paused and t.pending(s) <= 0:
            return False
        if "queued" in mine and not s.closing:  # queued only at a closing window
            return False
        if list(s.modes) != [sum(1 for h, x in enumerate(g.hs) if g.rank_of[h] == r and x not in ("idle", "queued")
                                 and g.hmode[h] == m) for m in MODES]:  # fmt: skip
            return False
    return True


def mode_inv(g: GroupState) -> bool:
    """R-MODES (``ModeInv``): a holder inside asked for a mode the window covers; in DRAIN and ABORT no request is
    in the batch while a holder is inside."""
    tp_pause = g.ranks[DRIVER].tp_pause
    if any(x == "inside" and not 1 <= g.hmode[h] <= tp_pause for h, x in enumerate(g.hs)):
        return False
    return not (tp_pause in (DRAIN, ABORT) and any_inside(g) and in_flight(g))


def nothing_lost_inv(g: GroupState) -> bool:
    """R-NOTHING-LOST-ONCE (``NothingLostInv``): at most one terminal output per request, and a stopped driver
    holds no request (D5: none is left in a queue or a batch that nobody reads again)."""
    driver_stopped = g.ranks[DRIVER].phase == "stopped"
    for q, o in zip(g.req, g.out, strict=True):
        if o > 1:
            return False
        if q in ("done", "delivered") and o != 1:
            return False
        if (q in ("new", "rejected") or q in HELD) and o != 0:
            return False
        if driver_stopped and q in HELD:
            return False
    return True


def type_ok(g: GroupState) -> bool:
    """R-TYPE (``TypeOK``)."""
    return (
        all(s.phase in PHASES for s in g.ranks)
        and all(x in HOLDER_STATES for x in g.hs)
        and all(q in REQUEST_STATES for q in g.req)
        and len({(s.tp_status, s.tp_pause) for s in g.ranks}) == 1
        and all((m == 0) == (x == "idle") for m, x in zip(g.hmode, g.hs, strict=True))
        and g.restarts >= 0
    )


def monotone_stop_inv(before: GroupState, after: GroupState) -> bool:
    """R-MONOTONE-STOP (``MonotoneStopInv``), a property of one step."""
    if after.restarts != before.restarts:
        return True
    return all(
        b.local_status <= a.local_status and b.tp_status <= a.tp_status
        for b, a in zip(before.ranks, after.ranks, strict=True)
    )


GROUP_INVARIANTS = {
    "TypeOK": type_ok,
    "ExclusionInv": exclusion_inv,
    "SameWindowInv": same_window_inv,
    "CountsInv": counts_inv,
    "ModeInv": mode_inv,
    "NothingLostInv": nothing_lost_inv,
}

__all__ = [
    "DRIVER", "FAULTS", "GROUP_INVARIANTS", "HELD", "HOLDER_STATES", "REQUEST_STATES", "Bounds", "GroupState",
    "action_name", "admits", "any_inside", "broadcast", "counts_inv", "deliver", "exclusion_inv", "has_work",
    "in_flight", "in_hand", "initial_group", "payload_pending",
    "holder_dies", "mode_inv", "monotone_stop_inv", "next_steps", "nothing_lost_inv", "same_window_inv", "submit",
    "terminated", "tla_holder_state", "tla_number", "type_ok",
]  # fmt: skip
