"""One rank's state changes, as pure functions over a frozen value.

This module is the Python transcription of the per-rank part of ``tla/PauseProtocol.tla``.  Each function
is one TLA+ action, same name in snake case (``OpenWindow`` -> :func:`open_window`), and each ``pre:`` line
is the action's enabling condition.  :func:`rank_invariant`, the per-rank parts of ``TypeOK``,
``CountsInv`` and ``SameWindowInv``, is every function's ``pre:`` and ``post:``.  The contracts are PEP 316
docstrings, which CrossHair checks (``nox -s crosshair``).

:class:`RankState` is what one rank's :class:`cbpause.PauseProtocol` holds and changes under its lock.
The conditions that span ranks, holders and requests (the collectives' "every rank", who a holder is, the
requests) are in :mod:`cbpause.group`, which builds the whole TLA+ ``Next`` from these functions.
"""

from __future__ import annotations

from typing import NamedTuple

# Stop statuses, in increasing order of urgency (transformers' constants).
DONT_STOP = 0
FLUSH_AND_STOP = 1
HARD_STOP = 2
STOPPED = 3
STOP_STATUSES = (DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED)

# Where a rank's loop is (TLA+ ``phase``, spec section 3).  A new protocol object is at TLA+'s Init: "read".
PHASES = ("read", "reduce", "decided", "window", "peer", "barrier", "body", "step", "stopped", "dead")
# Phases in which a loop is running (TLA+ ``Live``).
LIVE_PHASES = frozenset(PHASES) - {"stopped", "dead"}
# Phases of a rank that is parked between a pause decision and the barrier.
PARKED_PHASES = frozenset({"decided", "window", "peer", "barrier"})


class RankState(NamedTuple):
    """One rank's protocol state: the TLA+ variables indexed by one rank.

    ``waiting`` and ``inside`` count the holders of this rank in each state (TLA+ derives them from
    ``hs``); ``count`` is their sum, upstream's ``_pauses_requested``.  :func:`rank_invariant` states what
    always holds.
    """

    phase: str = "read"
    local_status: int = DONT_STOP
    tp_status: int = DONT_STOP
    tp_pause: bool = False
    obs_status: int = DONT_STOP
    obs_pause: bool = False
    fatal: bool = False
    paused: bool = False
    count: int = 0
    waiting: int = 0
    inside: int = 0


def rank_invariant(s: RankState) -> bool:
    """The per-rank parts of TypeOK, CountsInv and SameWindowInv, plus what the loop's iteration implies:
    ``local_status >= tp_status``, the group never agrees on STOPPED, and a hard-stopping group opens no
    window and runs no step.

    Every transition below has it as ``pre:`` and ``post:``.  (It is not a class ``inv:``: CrossHair
    discards a path on which a constructor's invariant fails, as the callee's fault, and would so hide the
    very bugs a transition could introduce.)
    """
    return (
        s.phase in PHASES
        and s.local_status in STOP_STATUSES
        and s.tp_status in STOP_STATUSES
        and s.obs_status in STOP_STATUSES
        and s.tp_status <= s.local_status
        and s.tp_status <= HARD_STOP
        and (s.phase not in ("window", "peer", "barrier", "body", "step") or s.tp_status < HARD_STOP)
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


def live(s: RankState) -> bool:
    """TLA+ ``Live(r)``: the loop runs."""
    return s.phase in LIVE_PHASES


# ----------------------------------------------------------------------------------------------------- the loop


def observe(s: RankState) -> RankState:
    """P-OBSERVE (``Observe``): send the stop status and the pending pause request.

    pre: rank_invariant(s)
    pre: s.phase == "read"
    post: __return__.phase == "reduce"
    post: __return__.obs_pause == (s.count > 0) and __return__.obs_status == s.local_status
    post: rank_invariant(__return__)
    """
    return s._replace(phase="reduce", obs_status=s.local_status, obs_pause=s.count > 0)


def all_reduce(s: RankState, tp_status: int, tp_pause: bool) -> RankState:
    """P-ALL-REDUCE (``AllReduce``), this rank's part: take the group's MAX.

    pre: rank_invariant(s)
    pre: s.phase == "reduce"
    pre: tp_status in STOP_STATUSES and s.obs_status <= tp_status < STOPPED and s.tp_status <= tp_status
    pre: tp_pause or not s.obs_pause
    post: __return__.phase == "decided"
    post: __return__.tp_status == tp_status and __return__.local_status == max(s.local_status, tp_status)
    post: __return__.local_status >= s.local_status
    post: rank_invariant(__return__)
    """
    return s._replace(
        phase="decided",
        tp_status=tp_status,
        tp_pause=tp_pause,
        local_status=max(s.local_status, tp_status),
        obs_status=DONT_STOP,
    )


def pause_decided(s: RankState) -> bool:
    """TLA+ ``PauseDecided(r)``."""
    return s.phase == "decided" and s.tp_status < HARD_STOP and s.tp_pause


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
    """P-SKIP-WINDOW (``SkipWindow``): no local holder is pending and none is coming: this rank's request was
    withdrawn (fixes D1), or a stop was asked here (no new pause is admitted); no window.

    pre: rank_invariant(s)
    pre: pause_decided(s) and s.count == 0 and (s.obs_pause or s.local_status != DONT_STOP)
    post: __return__.phase == "barrier" and not __return__.paused
    post: rank_invariant(__return__)
    """
    return s._replace(phase="barrier")


def park_for_peer(s: RankState) -> RankState:
    """P-PARK-FOR-PEER (``ParkForPeer``): a peer asked; wait, bounded, for the local holder.

    pre: rank_invariant(s)
    pre: pause_decided(s) and s.count == 0 and not s.obs_pause and s.local_status == DONT_STOP
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


def _fail(s: RankState) -> RankState:
    """TLA+ ``Fail(r)``, the effect of a fatal error of the loop: recorded, stopped, no further collective."""
    return s._replace(fatal=True, local_status=STOPPED, phase="stopped")


def fail_loop(s: RankState) -> RankState:
    """P-FAIL-LOOP (``FailLoop``): the loop's thread fails outside a forward step and outside a collective.

    pre: rank_invariant(s)
    pre: live(s) and s.phase != "window"
    post: __return__.fatal and __return__.local_status == STOPPED and __return__.phase == "stopped"
    post: __return__.inside == 0
    post: rank_invariant(__return__)
    """
    return _fail(s)


def peer_park_timeout(s: RankState) -> RankState:
    """P-PEER-PARK-TIMEOUT (``PeerParkTimeout``): no local holder came in time (fixes D3).

    pre: rank_invariant(s)
    pre: s.phase == "peer" and s.count == 0
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return _fail(s)


def collective_timeout(s: RankState) -> RankState:
    """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined the all-reduce or barrier.

    pre: rank_invariant(s)
    pre: s.phase in ("reduce", "barrier")
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return _fail(s)


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
    pre: s.phase == "decided" and s.tp_status < HARD_STOP and not s.tp_pause
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
    pre: s.phase == "body" and s.tp_status == DONT_STOP
    post: __return__.phase == "read"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="read")


def may_exit(s: RankState) -> bool:
    """The guard of P-EXIT-LOOP that this rank can see: a hard stop before any window, or a flush in the body
    (the group adds "and nothing is left to generate")."""
    return (s.phase == "decided" and s.tp_status == HARD_STOP) or (
        s.phase == "body" and s.tp_status == FLUSH_AND_STOP
    )


def exit_loop(s: RankState) -> RankState:
    """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or flush with nothing left.

    pre: rank_invariant(s)
    pre: may_exit(s)
    post: __return__.phase == "stopped" and __return__.local_status == STOPPED
    post: rank_invariant(__return__)
    """
    return s._replace(phase="stopped", local_status=STOPPED)


# --------------------------------------------------------------------------------------------------- holders


def can_request_pause(s: RankState) -> bool:
    """The guard of P-REQUEST-PAUSE; ``pause()`` raises at once when it is false.  No new pause once a stop is
    asked on this rank or agreed by the group: holders that keep pausing could keep a flush stop from ever
    completing (R-STOP-RETURNS)."""
    return live(s) and s.local_status == DONT_STOP and not s.fatal


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
    count = s.count - 1
    return s._replace(inside=s.inside - 1, count=count, paused=s.paused and count > 0)


def pause_fails(s: RankState) -> RankState:
    """P-PAUSE-FAILS (``PauseFails``): the loop is gone; the waiting holder raises.

    pre: rank_invariant(s)
    pre: s.waiting > 0 and not s.paused and (s.local_status == STOPPED or s.fatal)
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


def release_dead_holder(s: RankState, inside: bool) -> RankState:
    """P-RELEASE-DEAD-HOLDER (``ReleaseDeadHolder``): the thread of a holder that was waiting (``inside`` false) or
    inside died without leaving (P-HOLDER-DIES, which changes nothing here: the rank does not know yet); the loop
    parked in its window, or ``clear()`` on a stopped loop, releases its hold.  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: s.phase in ("window", "stopped")
    pre: s.inside > 0 if inside else s.waiting > 0
    post: __return__.count == s.count - 1
    post: __return__.paused == (s.paused and __return__.count > 0)
    post: rank_invariant(__return__)
    """
    return leave_pause(s) if inside else _drop_waiting(s)


# ------------------------------------------------------------------------------------------ stoppers, faults


def request_stop(s: RankState, status: int) -> RankState:
    """P-REQUEST-STOP (``RequestStop``): the status only grows (R-MONOTONE-STOP).

    pre: rank_invariant(s)
    pre: status in (FLUSH_AND_STOP, HARD_STOP)
    pre: live(s) and s.local_status < status
    post: __return__.local_status == max(status, s.tp_status) and __return__.local_status >= s.local_status
    post: rank_invariant(__return__)
    """
    return s._replace(local_status=max(status, s.tp_status))


def record_fatal_error(s: RankState) -> RankState:
    """P-RECORD-FATAL-ERROR (``RecordFatalError``): an exception in the loop's own code between two iterations'
    collectives (the forward step, preparing the batch, starting the loop); hard-stop and join the group's next
    all-reduce with HARD_STOP.

    pre: rank_invariant(s)
    pre: s.phase in ("read", "body", "step")
    post: __return__.fatal and __return__.local_status == HARD_STOP and __return__.phase == "reduce"
    post: rank_invariant(__return__)
    """
    return s._replace(fatal=True, local_status=HARD_STOP, obs_status=HARD_STOP, obs_pause=False, phase="reduce")


def crash(s: RankState) -> RankState:
    """P-CRASH (``Crash``): the process dies.

    pre: rank_invariant(s)
    pre: live(s)
    post: __return__.phase == "dead"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="dead")


def restart(s: RankState) -> RankState:
    """P-RESTART (``Restart``, ``clear()``): start afresh; only with no holder waiting or inside.

    pre: rank_invariant(s)
    pre: s.phase == "stopped" and s.count == 0
    post: __return__ == RankState(phase="read")
    post: rank_invariant(__return__)
    """
    return RankState(phase="read")


__all__ = [
    "DONT_STOP", "FLUSH_AND_STOP", "HARD_STOP", "STOPPED", "STOP_STATUSES", "PHASES", "LIVE_PHASES",
    "PARKED_PHASES", "RankState", "rank_invariant", "live", "pause_decided", "may_exit", "can_request_pause",
    "observe", "all_reduce", "open_window", "skip_window", "park_for_peer", "join_peer_pause", "fail_loop",
    "peer_park_timeout", "collective_timeout", "close_window", "barrier", "no_pause", "start_step", "end_step",
    "idle", "exit_loop", "request_pause", "enter_pause", "leave_pause", "pause_fails", "interrupt",
    "pause_timeout", "release_dead_holder", "request_stop", "record_fatal_error", "crash", "restart",
]  # fmt: skip
