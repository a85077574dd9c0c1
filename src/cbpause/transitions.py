"""The protocol's state changes as pure functions over frozen values.

This module is the Python transcription of ``tla/PauseProtocol.tla``.  Each
function is one TLA+ action, same name in snake case (``OpenWindow`` ->
:func:`open_window`), and each ``pre:`` line is the action's enabling
condition.  :func:`rank_invariant`, the per-rank parts of ``CountsInv``,
``SameWindowInv`` and ``TypeOK``, is every function's ``pre:`` and ``post:``.
The contracts are PEP 316 docstrings, which CrossHair checks
(``nox -s crosshair``).

:class:`RankState` is what one rank's :class:`cbpause.PauseProtocol` holds
and changes under its lock.  :class:`GroupState` puts ranks, holders and
requests together, as the TLA+ model does, for the Hypothesis state machine
and for comparing state graphs with TLC; the group actions are built from the
rank actions, so that there is one definition of each state change.

Requests, holders' identities and the "every rank" conditions of the
collectives are group-level, and appear only in :class:`GroupState`'s
functions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

# Stop statuses, in increasing order of urgency (transformers' constants).
DONT_STOP = 0
FLUSH_AND_STOP = 1
HARD_STOP = 2
STOPPED = 3
STOP_STATUSES = (DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED)

# Where a rank's loop is (TLA+ ``pc``).  "new" is a protocol object that was
# never cleared/started: TLA+'s Init is what clear() establishes.
PHASES = ("new", "read", "reduce", "decided", "window", "peer", "barrier", "body", "step", "stopped", "dead")
# Phases in which a loop is running (TLA+ ``Live``).
LIVE_PHASES = frozenset(PHASES) - {"new", "stopped", "dead"}
# Phases of a rank that is parked between a pause decision and the barrier.
PARKED_PHASES = frozenset({"decided", "window", "peer", "barrier"})

REQUEST_STATES = ("new", "queued", "active", "done", "delivered", "rejected")


class RankState(NamedTuple):
    """One rank's protocol state (the TLA+ variables indexed by one rank).

    ``waiting`` and ``inside`` count the holders of this rank in each state;
    ``count`` is upstream's ``_pauses_requested``.  :func:`rank_invariant`
    states what always holds.
    """

    phase: str = "new"
    stop: int = DONT_STOP
    tp_stop: int = DONT_STOP
    tp_pause: bool = False
    obs_stop: int = DONT_STOP
    obs_pause: bool = False
    fatal: bool = False
    paused: bool = False
    count: int = 0
    waiting: int = 0
    inside: int = 0


def rank_invariant(s: RankState) -> bool:
    """The per-rank parts of TypeOK, CountsInv and SameWindowInv, plus what the loop's iteration implies:
    ``stop >= tp_stop``, the group never agrees on STOPPED, and a hard-stopping group opens no window and
    runs no step.

    Every transition below has it as ``pre:`` and ``post:``.  (It is not a class ``inv:``: CrossHair
    discards a path on which a constructor's invariant fails, as the callee's fault, and would so hide the
    very bugs a transition could introduce.)
    """
    return (
        s.phase in PHASES
        and s.stop in STOP_STATUSES
        and s.tp_stop in STOP_STATUSES
        and s.obs_stop in STOP_STATUSES
        and s.tp_stop <= s.stop
        and s.tp_stop <= HARD_STOP
        and (s.phase not in ("window", "peer", "barrier", "body", "step") or s.tp_stop < HARD_STOP)
        and s.waiting >= 0
        and s.inside >= 0
        and s.count == s.waiting + s.inside
        and (not s.paused or s.count > 0)
        and (not s.paused or s.phase in ("window", "dead"))
        and (s.inside == 0 or s.phase == "dead" or (s.paused and s.phase == "window"))
    )


def _drop_waiting(s: RankState) -> RankState:
    count = s.count - 1
    return s._replace(waiting=s.waiting - 1, count=count, paused=s.paused and count > 0)


def _drop_inside(s: RankState) -> RankState:
    count = s.count - 1
    return s._replace(inside=s.inside - 1, count=count, paused=s.paused and count > 0)


def is_live(s: RankState) -> bool:
    """TLA+ ``Live(r)``: the loop runs."""
    return s.phase in LIVE_PHASES


# ----------------------------------------------------------------------------------------------------- the loop


def observe(s: RankState) -> RankState:
    """P-OBSERVE (``Observe``): send the stop status and the pending pause request.

    pre: rank_invariant(s)
    pre: s.phase == "read"
    post: __return__.phase == "reduce"
    post: __return__.obs_pause == (s.count > 0) and __return__.obs_stop == s.stop
    post: rank_invariant(__return__)
    """
    return s._replace(phase="reduce", obs_stop=s.stop, obs_pause=s.count > 0)


def all_reduce(s: RankState, tp_stop: int, tp_pause: bool) -> RankState:
    """P-ALL-REDUCE (``AllReduce``), this rank's part: take the group's MAX.

    pre: rank_invariant(s)
    pre: s.phase == "reduce"
    pre: tp_stop in STOP_STATUSES and s.obs_stop <= tp_stop < STOPPED and s.tp_stop <= tp_stop
    pre: tp_pause or not s.obs_pause
    post: __return__.phase == "decided"
    post: __return__.tp_stop == tp_stop and __return__.stop == max(s.stop, tp_stop)
    post: __return__.stop >= s.stop
    post: rank_invariant(__return__)
    """
    return s._replace(
        phase="decided", tp_stop=tp_stop, tp_pause=tp_pause, stop=max(s.stop, tp_stop), obs_stop=DONT_STOP
    )


def pause_decided(s: RankState) -> bool:
    """TLA+ ``PauseDecided(r)``."""
    return s.phase == "decided" and s.tp_stop < HARD_STOP and s.tp_pause


def open_window(s: RankState) -> RankState:
    """P-OPEN-WINDOW (``OpenWindow``): a local holder is pending; open the window.

    Keeps CountsInv: an open window has a holder to close it (the D1 guard).

    pre: rank_invariant(s)
    pre: pause_decided(s) and s.count > 0
    post: __return__.paused and __return__.phase == "window"
    post: rank_invariant(__return__)
    """
    return s._replace(paused=True, phase="window")


def skip_window(s: RankState) -> RankState:
    """P-SKIP-WINDOW (``SkipWindow``): this rank's request was withdrawn; no window (fixes D1).

    pre: rank_invariant(s)
    pre: pause_decided(s) and s.count == 0 and s.obs_pause
    post: __return__.phase == "barrier" and not __return__.paused
    post: rank_invariant(__return__)
    """
    return s._replace(phase="barrier")


def park_for_peer(s: RankState) -> RankState:
    """P-PARK-FOR-PEER (``ParkForPeer``): a peer asked; wait, bounded, for the local holder.

    pre: rank_invariant(s)
    pre: pause_decided(s) and s.count == 0 and not s.obs_pause
    post: __return__.phase == "peer"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="peer")


def join_peer_pause(s: RankState) -> RankState:
    """P-JOIN-PEER-PAUSE (``JoinPeerPause``): the local holder came; open the window.

    pre: rank_invariant(s)
    pre: s.phase == "peer" and s.count > 0
    post: __return__.paused and __return__.phase == "window"
    post: rank_invariant(__return__)
    """
    return s._replace(paused=True, phase="window")


def fail_loop(s: RankState) -> RankState:
    """P-FAIL-LOOP: record a fatal error and stop; no further collective.

    pre: rank_invariant(s)
    pre: s.inside == 0
    post: __return__.fatal and __return__.stop == STOPPED and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return s._replace(fatal=True, stop=STOPPED, phase="stopped")


def peer_park_timeout(s: RankState) -> RankState:
    """P-PEER-PARK-TIMEOUT (``PeerParkTimeout``): no local holder came in time (fixes D3).

    pre: rank_invariant(s)
    pre: s.phase == "peer" and s.count == 0
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return fail_loop(s)


def collective_timeout(s: RankState) -> RankState:
    """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined the all-reduce or barrier.

    pre: rank_invariant(s)
    pre: s.phase in ("reduce", "barrier")
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return fail_loop(s)


def close_window(s: RankState) -> RankState:
    """P-CLOSE-WINDOW (``CloseWindow``): the last holder left; go to the barrier.

    pre: rank_invariant(s)
    pre: s.phase == "window" and not s.paused
    post: __return__.phase == "barrier"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="barrier")


def barrier(s: RankState) -> RankState:
    """P-BARRIER (``Barrier``), this rank's part: leave the pause window with the group.

    pre: rank_invariant(s)
    pre: s.phase == "barrier"
    post: __return__.phase == "body"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="body")


def no_pause(s: RankState) -> RankState:
    """P-NO-PAUSE (``NoPause``).

    pre: rank_invariant(s)
    pre: s.phase == "decided" and s.tp_stop < HARD_STOP and not s.tp_pause
    post: __return__.phase == "body"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="body")


def start_step(s: RankState) -> RankState:
    """P-START-STEP (``StartStep``): the forward step runs.  Keeps ExclusionInv: no holder inside.

    pre: rank_invariant(s)
    pre: s.phase == "body"
    post: __return__.phase == "step" and __return__.inside == 0
    post: rank_invariant(__return__)
    """
    return s._replace(phase="step")


def end_step(s: RankState) -> RankState:
    """P-END-STEP (``EndStep``).

    pre: rank_invariant(s)
    pre: s.phase == "step"
    post: __return__.phase == "read"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="read")


def idle(s: RankState) -> RankState:
    """P-IDLE (``Idle``): no work and no stop; go round.

    pre: rank_invariant(s)
    pre: s.phase == "body" and s.tp_stop == DONT_STOP
    post: __return__.phase == "read"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="read")


def exit_loop(s: RankState) -> RankState:
    """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or flush with nothing left.

    pre: rank_invariant(s)
    pre: (s.phase == "decided" and s.tp_stop == HARD_STOP) or (s.phase == "body" and s.tp_stop == FLUSH_AND_STOP)
    post: __return__.phase == "stopped" and __return__.stop == STOPPED
    post: rank_invariant(__return__)
    """
    return s._replace(phase="stopped", stop=STOPPED)


# --------------------------------------------------------------------------------------------------- holders


def can_request_pause(s: RankState) -> bool:
    """The guard of P-REQUEST-PAUSE; ``pause()`` raises at once when it is false."""
    return is_live(s) and s.stop < HARD_STOP and not s.fatal


def request_pause(s: RankState) -> RankState:
    """P-REQUEST-PAUSE (``RequestPause``).  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: can_request_pause(s)
    post: __return__.count == s.count + 1 and __return__.waiting == s.waiting + 1
    post: rank_invariant(__return__)
    """
    return s._replace(count=s.count + 1, waiting=s.waiting + 1)


def enter_pause(s: RankState) -> RankState:
    """P-ENTER-PAUSE (``EnterPause``): the window is open.  Keeps SameWindowInv.

    pre: rank_invariant(s)
    pre: s.waiting > 0 and s.paused
    post: __return__.inside == s.inside + 1 and __return__.count == s.count
    post: rank_invariant(__return__)
    """
    return s._replace(waiting=s.waiting - 1, inside=s.inside + 1)


def leave_pause(s: RankState) -> RankState:
    """P-LEAVE-PAUSE (``LeavePause``): the last one out closes the window.  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: s.inside > 0
    post: __return__.count == s.count - 1
    post: __return__.paused == (s.paused and __return__.count > 0)
    post: rank_invariant(__return__)
    """
    return _drop_inside(s)


def pause_fails(s: RankState) -> RankState:
    """P-PAUSE-FAILS (``PauseFails``): the loop is gone; the waiting holder raises.

    pre: rank_invariant(s)
    pre: s.waiting > 0 and not s.paused and (s.stop == STOPPED or s.fatal)
    post: __return__.count == s.count - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s)


def interrupt(s: RankState) -> RankState:
    """P-INTERRUPT (``Interrupt``): a waiting holder is interrupted and withdraws.

    pre: rank_invariant(s)
    pre: s.waiting > 0
    post: __return__.count == s.count - 1 and __return__.waiting == s.waiting - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s)


def pause_timeout(s: RankState) -> RankState:
    """P-PAUSE-TIMEOUT (``PauseTimeout``): a waiting holder's timeout ran out; it withdraws.

    pre: rank_invariant(s)
    pre: s.waiting > 0
    post: __return__.count == s.count - 1 and __return__.waiting == s.waiting - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s)


# ------------------------------------------------------------------------------------------ stoppers, faults


def request_stop(s: RankState, status: int) -> RankState:
    """P-REQUEST-STOP (``RequestStop``): the status only grows (R-MONOTONE-STOP).

    pre: rank_invariant(s)
    pre: status in (FLUSH_AND_STOP, HARD_STOP)
    pre: is_live(s) and s.stop < status
    post: __return__.stop == max(status, s.tp_stop) and __return__.stop >= s.stop
    post: rank_invariant(__return__)
    """
    return s._replace(stop=max(status, s.tp_stop))


def fatal_error(s: RankState) -> RankState:
    """P-FATAL-ERROR (``FatalError``): hard-stop and join the group's next all-reduce with HARD_STOP.

    pre: rank_invariant(s)
    pre: s.phase == "step"
    post: __return__.fatal and __return__.stop == HARD_STOP and __return__.phase == "reduce"
    post: rank_invariant(__return__)
    """
    return s._replace(fatal=True, stop=HARD_STOP, obs_stop=HARD_STOP, obs_pause=False, phase="reduce")


def crash(s: RankState) -> RankState:
    """P-CRASH (``Crash``): the process dies.

    pre: rank_invariant(s)
    pre: is_live(s)
    post: __return__.phase == "dead"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="dead")


def restart(s: RankState) -> RankState:
    """P-RESTART (``Restart``, ``clear()``): start afresh; only with no holder waiting or inside.

    pre: rank_invariant(s)
    pre: s.phase in ("new", "stopped") and s.count == 0
    post: __return__ == RankState(phase="read")
    post: rank_invariant(__return__)
    """
    return RankState(phase="read")


# ----------------------------------------------------------------------------------------------------- group


@dataclass(frozen=True)
class GroupState:
    """The whole TLA+ state: ranks, holders (``hs``), requests (``req``, ``out``).

    ``rank_of[h]`` is the index in ``ranks`` of holder ``h``'s rank; rank 0 is the driver.
    ``tp_stop`` and ``tp_pause`` are kept per rank in :class:`RankState` and are equal across ranks.

    inv: len(self.hs) == len(self.rank_of)
    inv: all(0 <= r < len(self.ranks) for r in self.rank_of)
    inv: len(self.req) == len(self.out)
    """

    ranks: tuple[RankState, ...]
    rank_of: tuple[int, ...]
    hs: tuple[str, ...]
    req: tuple[str, ...]
    out: tuple[int, ...]
    restarts: int = 0
    crashes: int = 0


def initial_group(n_ranks: int, rank_of: tuple[int, ...], n_requests: int) -> GroupState:
    """TLA+ ``Init``: every rank cleared and at ``read``."""
    return GroupState(
        ranks=tuple(RankState(phase="read") for _ in range(n_ranks)),
        rank_of=tuple(rank_of),
        hs=("idle",) * len(rank_of),
        req=("new",) * n_requests,
        out=(0,) * n_requests,
    )


DRIVER = 0


def _set_rank(g: GroupState, r: int, s: RankState) -> GroupState:
    return replace(g, ranks=g.ranks[:r] + (s,) + g.ranks[r + 1 :])


def _set_holder(g: GroupState, h: int, state: str) -> GroupState:
    return replace(g, hs=g.hs[:h] + (state,) + g.hs[h + 1 :])


def has_work(g: GroupState) -> bool:
    """TLA+ ``HasWork``."""
    return "active" in g.req


def _fail_remaining(g: GroupState, r: int) -> GroupState:
    if r != DRIVER:
        return g
    req = tuple("done" if q in ("queued", "active") else q for q in g.req)
    out = tuple(o + 1 if q in ("queued", "active") else o for q, o in zip(g.req, g.out, strict=True))
    return replace(g, req=req, out=out)


def _finish_active(g: GroupState, r: int) -> GroupState:
    if r != DRIVER:
        return g
    req = tuple("done" if q == "active" else q for q in g.req)
    out = tuple(o + 1 if q == "active" else o for q, o in zip(g.req, g.out, strict=True))
    return replace(g, req=req, out=out)


def group_actions(g: GroupState, faults: frozenset[str], max_restarts: int) -> list[tuple[str, GroupState]]:
    """Every step TLA+'s ``Next`` allows from ``g``, as ``(label, successor)``.

    The label is the TLA+ action with its arguments (ranks and holders 1-based, as in the models),
    e.g. ``"OpenWindow(1)"``.  ``Terminated`` (a stuttering step) is left out.
    """
    steps: list[tuple[str, GroupState]] = []

    def add(label: str, succ: GroupState) -> None:
        steps.append((label, succ))

    for r, s in enumerate(g.ranks):
        tag = f"({r + 1})"
        if s.phase == "read":
            succ = _set_rank(g, r, observe(s))
            if r == DRIVER:
                succ = replace(succ, req=tuple("active" if q == "queued" else q for q in g.req))
            add("Observe" + tag, succ)
        if pause_decided(s):
            if s.count > 0:
                add("OpenWindow" + tag, _set_rank(g, r, open_window(s)))
            elif s.obs_pause:
                add("SkipWindow" + tag, _set_rank(g, r, skip_window(s)))
            else:
                add("ParkForPeer" + tag, _set_rank(g, r, park_for_peer(s)))
        if s.phase == "peer" and s.count > 0:
            add("JoinPeerPause" + tag, _set_rank(g, r, join_peer_pause(s)))
        if s.phase == "peer" and s.count == 0:
            add("PeerParkTimeout" + tag, _fail_remaining(_set_rank(g, r, peer_park_timeout(s)), r))
        if s.phase in ("reduce", "barrier") and any(q.phase != s.phase for q in g.ranks):
            add("CollectiveTimeout" + tag, _fail_remaining(_set_rank(g, r, collective_timeout(s)), r))
        if s.phase == "window" and not s.paused:
            add("CloseWindow" + tag, _set_rank(g, r, close_window(s)))
        if s.phase == "decided" and s.tp_stop < HARD_STOP and not s.tp_pause:
            add("NoPause" + tag, _set_rank(g, r, no_pause(s)))
        if s.phase == "body" and has_work(g):
            add("StartStep" + tag, _set_rank(g, r, start_step(s)))
        if s.phase == "step":
            add("EndStep" + tag, _finish_active(_set_rank(g, r, end_step(s)), r))
        if s.phase == "body" and not has_work(g) and s.tp_stop == DONT_STOP:
            add("Idle" + tag, _set_rank(g, r, idle(s)))
        if (s.phase == "decided" and s.tp_stop == HARD_STOP) or (
            s.phase == "body" and s.tp_stop == FLUSH_AND_STOP and not has_work(g)
        ):
            add("ExitLoop" + tag, _fail_remaining(_set_rank(g, r, exit_loop(s)), r))
        if "stop" in faults:
            for status in (FLUSH_AND_STOP, HARD_STOP):
                if is_live(s) and s.stop < status:
                    add(f"RequestStop({r + 1}, {status})", _set_rank(g, r, request_stop(s, status)))
        if "error" in faults and s.phase == "step":
            add("FatalError" + tag, _fail_remaining(_set_rank(g, r, fatal_error(s)), r))
        if "crash" in faults and g.crashes == 0 and is_live(s):
            add("Crash" + tag, replace(_set_rank(g, r, crash(s)), crashes=g.crashes + 1))

    if all(s.phase == "reduce" for s in g.ranks):
        tp_stop = max(s.obs_stop for s in g.ranks)
        tp_pause = any(s.obs_pause for s in g.ranks)
        add("AllReduce", replace(g, ranks=tuple(all_reduce(s, tp_stop, tp_pause) for s in g.ranks)))
    if all(s.phase == "barrier" for s in g.ranks):
        add("Barrier", replace(g, ranks=tuple(barrier(s) for s in g.ranks)))

    for h, state in enumerate(g.hs):
        r = g.rank_of[h]
        s = g.ranks[r]
        tag = f"({h + 1})"
        if s.phase == "dead":
            continue
        if state == "idle" and can_request_pause(s):
            add("RequestPause" + tag, _set_holder(_set_rank(g, r, request_pause(s)), h, "waiting"))
        if state == "waiting" and s.paused:
            add("EnterPause" + tag, _set_holder(_set_rank(g, r, enter_pause(s)), h, "inside"))
        if state == "inside":
            add("LeavePause" + tag, _set_holder(_set_rank(g, r, leave_pause(s)), h, "idle"))
        if state == "waiting" and not s.paused and (s.stop == STOPPED or s.fatal):
            add("PauseFails" + tag, _set_holder(_set_rank(g, r, pause_fails(s)), h, "idle"))
        if state == "waiting" and "interrupt" in faults:
            add("Interrupt" + tag, _set_holder(_set_rank(g, r, interrupt(s)), h, "idle"))
        if state == "waiting" and "timeout" in faults:
            add("PauseTimeout" + tag, _set_holder(_set_rank(g, r, pause_timeout(s)), h, "idle"))

    if g.restarts < max_restarts and all(s.phase == "stopped" for s in g.ranks) and all(x == "idle" for x in g.hs):
        add("Restart", replace(g, ranks=tuple(restart(s) for s in g.ranks), restarts=g.restarts + 1))

    driver = g.ranks[DRIVER]
    accepting = is_live(driver) and driver.stop == DONT_STOP and not driver.fatal
    for i, q in enumerate(g.req):
        if q == "new":
            new = "queued" if accepting else "rejected"
            add(f"Submit({i + 1})", replace(g, req=g.req[:i] + (new,) + g.req[i + 1 :]))
        if q == "done" and driver.phase != "dead":
            add(f"Deliver({i + 1})", replace(g, req=g.req[:i] + ("delivered",) + g.req[i + 1 :]))
    return steps


# ------------------------------------------------------------------------------------------ group invariants


def any_inside(g: GroupState) -> bool:
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
            if not all(q.phase in PARKED_PHASES for q in g.ranks if is_live(q)):
                return False
    return True


def counts_inv(g: GroupState) -> bool:
    """R-COUNTS (``CountsInv``)."""
    for r, s in enumerate(g.ranks):
        mine = [x for h, x in enumerate(g.hs) if g.rank_of[h] == r]
        if s.count < 0 or s.count != sum(x != "idle" for x in mine):
            return False
        if s.paused and s.count <= 0:
            return False
    return True


def nothing_lost_inv(g: GroupState) -> bool:
    """R-NOTHING-LOST-ONCE (``NothingLostInv``)."""
    for q, o in zip(g.req, g.out, strict=True):
        if o > 1:
            return False
        if q in ("done", "delivered") and o != 1:
            return False
        if q in ("new", "queued", "active", "rejected") and o != 0:
            return False
    return True


def type_ok(g: GroupState) -> bool:
    """R-TYPE (``TypeOK``)."""
    return (
        all(s.phase in PHASES and s.phase != "new" for s in g.ranks)
        and all(x in ("idle", "waiting", "inside") for x in g.hs)
        and all(q in REQUEST_STATES for q in g.req)
        and len({(s.tp_stop, s.tp_pause) for s in g.ranks}) == 1
    )


def monotone_stop_inv(before: GroupState, after: GroupState) -> bool:
    """R-MONOTONE-STOP (``MonotoneStopInv``), a property of one step."""
    if after.restarts != before.restarts:
        return True
    return all(b.stop <= a.stop and b.tp_stop <= a.tp_stop for b, a in zip(before.ranks, after.ranks, strict=True))


GROUP_INVARIANTS = {
    "TypeOK": type_ok,
    "ExclusionInv": exclusion_inv,
    "SameWindowInv": same_window_inv,
    "CountsInv": counts_inv,
    "NothingLostInv": nothing_lost_inv,
}

__all__ = [
    "DONT_STOP", "FLUSH_AND_STOP", "HARD_STOP", "STOPPED", "STOP_STATUSES", "PHASES", "LIVE_PHASES",
    "PARKED_PHASES", "REQUEST_STATES", "DRIVER", "GROUP_INVARIANTS", "RankState", "GroupState", "rank_invariant",
    "is_live", "pause_decided", "can_request_pause", "has_work", "initial_group", "group_actions",
    "observe", "all_reduce", "open_window", "skip_window", "park_for_peer", "join_peer_pause", "fail_loop",
    "peer_park_timeout", "collective_timeout", "close_window", "barrier", "no_pause", "start_step", "end_step",
    "idle", "exit_loop", "request_pause", "enter_pause", "leave_pause", "pause_fails", "interrupt",
    "pause_timeout", "request_stop", "fatal_error", "crash", "restart", "any_inside", "exclusion_inv",
    "same_window_inv", "counts_inv", "nothing_lost_inv", "type_ok", "monotone_stop_inv",
]  # fmt: skip
