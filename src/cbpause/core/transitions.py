"""One rank's state changes, as pure functions over a frozen value.

This module is the Python transcription of the per-rank part of ``tla/PauseProtocol.tla``.  Each function
is one TLA+ action, same name in snake case (``OpenWindow`` -> :func:`open_window`), and each ``pre:`` line
is the action's enabling condition.  :func:`rank_invariant`, the per-rank parts of ``TypeOK``,
``CountsInv`` and ``SameWindowInv``, is every function's ``pre:`` and ``post:``.  The contracts are PEP 316
docstrings, which CrossHair checks (``nox -s crosshair``).

:class:`RankState` is what one rank's :class:`cbpause.PauseProtocol` holds and changes under its lock.
The conditions that span ranks, holders and requests (the collectives' "every rank", who a holder is, the
requests) are in :mod:`cbpause.core.group`, which builds the whole TLA+ ``Next`` from these functions.
"""

from __future__ import annotations

from typing import NamedTuple

# Stop statuses, in increasing order of urgency (transformers' constants).
DONT_STOP = 0
FLUSH_AND_STOP = 1
HARD_STOP = 2
STOPPED = 3
STOP_STATUSES = (DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED)

# Pause modes (TLA+ KEEP..ABORT, spec R-MODES), in the order in which they combine: the group's window takes the
# strongest mode its holders asked for, through the same MAX all-reduce as the pause request (0: no pause).
KEEP = 1
RETRACT = 2
DRAIN = 3
ABORT = 4
MODES = (KEEP, RETRACT, DRAIN, ABORT)
MODE_NAMES = {KEEP: "keep", RETRACT: "retract", DRAIN: "drain", ABORT: "abort"}

# Where a rank's loop is (TLA+ ``phase``, spec section 3).  A new protocol object is at TLA+'s Init: "read".
PHASES = ("read", "reduce", "decided", "window", "peer", "barrier", "body", "step", "stopped", "dead")
# Phases in which a loop is running (TLA+ ``Live``).
LIVE_PHASES = frozenset(PHASES) - {"stopped", "dead"}
# Phases of a rank that is parked between a pause decision and the barrier.
PARKED_PHASES = frozenset({"decided", "window", "peer", "barrier"})


class RankState(NamedTuple):
    """One rank's protocol state: the TLA+ variables indexed by one rank.

    ``waiting`` and ``inside`` count the holders of this rank in each state (TLA+ derives them from
    ``hs``); ``count`` is their sum, upstream's ``_pauses_requested``; ``n_keep`` ... ``n_abort`` count those
    that asked for each mode (TLA+ derives them from ``hmode``; ``modes`` gives the four).  ``obs_pause`` and
    ``tp_pause`` are modes (0: no pause).  ``closing``: the open window admits no newcomer, a holder has left it
    or given up on it (R-WINDOW-CLOSES).  :func:`rank_invariant` states what always holds.
    """

    phase: str = "read"
    local_status: int = DONT_STOP
    tp_status: int = DONT_STOP
    tp_pause: int = 0
    obs_status: int = DONT_STOP
    obs_pause: int = 0
    fatal: bool = False
    paused: bool = False
    count: int = 0
    waiting: int = 0
    inside: int = 0
    n_keep: int = 0
    n_retract: int = 0
    n_drain: int = 0
    n_abort: int = 0
    draining: bool = False
    closing: bool = False

    @property
    def modes(self) -> tuple[int, int, int, int]:
        """How many of this rank's holders (waiting or inside) asked for each mode, KEEP first."""
        return (self.n_keep, self.n_retract, self.n_drain, self.n_abort)


def pending(s: RankState) -> int:
    """TLA+ ``Cardinality(Pending(r))``: the holders waiting or inside whose mode the group's decision covers (those
    the window is for); the others asked for a stronger mode and wait for the next window."""
    # Written out, not a slice: CrossHair reasons about it in seconds, where a symbolic slice takes minutes.
    p = s.tp_pause
    return s.n_keep * (p >= KEEP) + s.n_retract * (p >= RETRACT) + s.n_drain * (p >= DRAIN) + s.n_abort * (p >= ABORT)


def asked(s: RankState) -> int:
    """TLA+ ``Asked(r)``: the strongest mode this rank's holders asked for, 0 if none."""
    return ABORT if s.n_abort else DRAIN if s.n_drain else RETRACT if s.n_retract else KEEP if s.n_keep else 0


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
        and s.n_keep >= 0
        and s.n_retract >= 0
        and s.n_drain >= 0
        and s.n_abort >= 0
        and s.n_keep + s.n_retract + s.n_drain + s.n_abort == s.count
        and 0 <= s.obs_pause <= ABORT
        and 0 <= s.tp_pause <= ABORT
        and s.inside <= pending(s)
        and (not s.draining or s.tp_pause == DRAIN)
        and (not s.paused or pending(s) > 0)
        and (not s.closing or s.paused)
        and (not s.paused or s.phase in ("window", "dead"))
        and (s.inside == 0 or s.phase == "dead" or (s.paused and s.phase == "window"))
    )


def _plus(s: RankState, mode: int, n: int, **changes: object) -> RankState:
    """``s`` with ``n`` added to the count of holders of ``mode``, and ``changes``."""
    if mode == KEEP:
        return s._replace(n_keep=s.n_keep + n, **changes)
    if mode == RETRACT:
        return s._replace(n_retract=s.n_retract + n, **changes)
    if mode == DRAIN:
        return s._replace(n_drain=s.n_drain + n, **changes)
    return s._replace(n_abort=s.n_abort + n, **changes)


def _count_of(s: RankState, mode: int) -> int:
    """How many of the rank's holders asked for ``mode``."""
    if mode == KEEP:
        return s.n_keep
    if mode == RETRACT:
        return s.n_retract
    return s.n_drain if mode == DRAIN else s.n_abort


def _drop(after: RankState, s: RankState) -> RankState:
    """TLA+ ``Drop(h)``: ``after`` (``s`` less one holder) with the window still open while a holder it is for
    remains, and then closing: it admits no newcomer (R-WINDOW-CLOSES).  A closed window is not closing."""
    still_open = s.paused and pending(after) > 0
    return after._replace(paused=still_open, closing=still_open)


def _drop_waiting(s: RankState, mode: int) -> RankState:
    return _drop(_plus(s, mode, -1, waiting=s.waiting - 1, count=s.count - 1), s)


def can_drop_waiting(s: RankState, mode: int) -> bool:
    """A waiting holder of ``mode`` may be dropped: the rank has one (a holder whose mode the decision covers is
    waiting, rather than inside, when fewer are inside than are pending)."""
    return (
        KEEP <= mode <= ABORT
        and s.waiting > 0
        and _count_of(s, mode) > 0
        and (mode > s.tp_pause or pending(s) > s.inside)
    )


def live(s: RankState) -> bool:
    """TLA+ ``Live(r)``: the loop runs."""
    return s.phase in LIVE_PHASES


# ------------------------------------------------------------------------------------------ the loop's guards
# One named guard per loop action, its enabling condition on what this rank sees: the action's ``pre:`` (beside
# rank_invariant), the explicit loop API (loop.py), the group's Next (group.py, which adds what one rank cannot
# see: the batch, a payload in hand) and the drop-in planner (dropin.py) call it; none restates it.


def can_observe(s: RankState) -> bool:
    return s.phase == "read"


def can_all_reduce(s: RankState) -> bool:  # (and the arguments' conditions: all_reduce's pre)
    return s.phase == "reduce"


def can_open_window(s: RankState) -> bool:
    return pause_decided(s) and not s.draining and pending(s) > 0


def can_drain_first(s: RankState) -> bool:
    return pause_decided(s) and s.draining


def can_skip_window(s: RankState) -> bool:
    return pause_decided(s) and not s.draining and pending(s) == 0 and (s.obs_pause > 0 or s.local_status != DONT_STOP)


def can_park_for_peer(s: RankState) -> bool:
    return pause_decided(s) and not s.draining and pending(s) == 0 and s.obs_pause == 0 and s.local_status == DONT_STOP


def can_join_peer_pause(s: RankState) -> bool:
    return s.phase == "peer" and pending(s) > 0


def can_peer_park_timeout(s: RankState) -> bool:
    return s.phase == "peer" and pending(s) == 0


def can_collective_timeout(s: RankState) -> bool:
    return s.phase in ("reduce", "barrier", "body")


def can_fail_loop(s: RankState) -> bool:
    return live(s) and s.phase != "window"


def can_close_window(s: RankState) -> bool:
    return s.phase == "window" and not s.paused


def can_barrier(s: RankState) -> bool:
    return s.phase == "barrier"


def can_no_pause(s: RankState) -> bool:
    return s.phase == "decided" and s.tp_status < HARD_STOP and s.tp_pause == 0


def can_start_step(s: RankState) -> bool:
    return s.phase == "body"


def can_end_step(s: RankState) -> bool:
    return s.phase == "step"


def can_idle(s: RankState) -> bool:
    return s.phase == "body" and s.tp_status == DONT_STOP


def can_record_fatal_error(s: RankState) -> bool:
    return s.phase in ("read", "body", "step")


# The holders' guards that depend on a holder's mode (the rank-level part is each action's pre:).
def can_enter_window(s: RankState, mode: int) -> bool:  # EnterPause: the open window covers the mode (R-MODES)
    return s.paused and mode <= s.tp_pause


def can_pause_fails(s: RankState) -> bool:  # PauseFails: no window, and the loop has stopped or failed
    return not s.paused and (s.local_status == STOPPED or s.fatal)


def can_request_stop(s: RankState, status: int) -> bool:  # RequestStop: a stop above the one asked, on a live loop
    return live(s) and s.local_status < status


# ----------------------------------------------------------------------------------------------------- the loop


def observe(s: RankState) -> RankState:
    """P-OBSERVE (``Observe``): send the stop status and the pending pause request: the strongest mode asked.

    pre: rank_invariant(s)
    pre: can_observe(s)
    post: __return__.phase == "reduce"
    post: (__return__.obs_pause > 0) == (s.count > 0) and __return__.obs_status == s.local_status
    post: rank_invariant(__return__)
    """
    return s._replace(phase="reduce", obs_status=s.local_status, obs_pause=asked(s))


def all_reduce(s: RankState, tp_status: int, tp_pause: int, busy: bool = False) -> RankState:
    """P-ALL-REDUCE (``AllReduce``), this rank's part: take the group's MAX of stop statuses and modes.  A drain
    decided while this rank's batch is ``busy`` (it has requests in flight) is ``draining``: see
    :func:`drain_first`.  (The batches of a TP group are copies of the driver's, at the same iteration.)

    pre: rank_invariant(s)
    pre: can_all_reduce(s)
    pre: tp_status in STOP_STATUSES and s.obs_status <= tp_status < STOPPED and s.tp_status <= tp_status
    pre: 0 <= tp_pause <= ABORT and s.obs_pause <= tp_pause
    post: __return__.draining == (tp_pause == DRAIN and busy)
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
        draining=tp_pause == DRAIN and bool(busy),
    )


def pause_decided(s: RankState) -> bool:
    """TLA+ ``PauseDecided(r)``."""
    return s.phase == "decided" and s.tp_status < HARD_STOP and s.tp_pause > 0


def open_window(s: RankState) -> RankState:
    """P-OPEN-WINDOW (``OpenWindow``): a local holder is pending; open the window (in DRAIN, once the batch is empty).

    Keeps CountsInv: an open window has a holder to close it (the D1 guard).

    pre: rank_invariant(s)
    pre: can_open_window(s)
    post: __return__.paused and __return__.phase == "window"
    post: rank_invariant(__return__)
    """
    return s._replace(paused=True, phase="window")


def drain_first(s: RankState) -> RankState:
    """P-DRAIN-FIRST (``DrainFirst``): the group decided to drain and the batch had work (``draining``): no window
    yet; step the batch without admitting new requests, and ask again at the next all-reduce.

    pre: rank_invariant(s)
    pre: can_drain_first(s)
    post: __return__.phase == "body" and __return__.draining
    post: rank_invariant(__return__)
    """
    return s._replace(phase="body")


def skip_window(s: RankState) -> RankState:
    """P-SKIP-WINDOW (``SkipWindow``): no local holder is pending and none is coming: this rank's request was
    withdrawn (fixes D1), or a stop was asked here (no new pause is admitted); no window.

    pre: rank_invariant(s)
    pre: can_skip_window(s)
    post: __return__.phase == "barrier" and not __return__.paused
    post: rank_invariant(__return__)
    """
    return s._replace(phase="barrier")


def park_for_peer(s: RankState) -> RankState:
    """P-PARK-FOR-PEER (``ParkForPeer``): a peer asked; wait, bounded, for the local holder.

    pre: rank_invariant(s)
    pre: can_park_for_peer(s)
    post: __return__.phase == "peer"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="peer")


def join_peer_pause(s: RankState) -> RankState:
    """P-JOIN-PEER-PAUSE (``JoinPeerPause``): the local holder came; open the window.

    pre: rank_invariant(s)
    pre: can_join_peer_pause(s)
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
    pre: can_fail_loop(s)
    post: __return__.fatal and __return__.local_status == STOPPED and __return__.phase == "stopped"
    post: __return__.inside == 0
    post: rank_invariant(__return__)
    """
    return _fail(s)


def peer_park_timeout(s: RankState) -> RankState:
    """P-PEER-PARK-TIMEOUT (``PeerParkTimeout``): no local holder came in time (fixes D3).

    pre: rank_invariant(s)
    pre: can_peer_park_timeout(s)
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return _fail(s)


def collective_timeout(s: RankState) -> RankState:
    """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined the all-reduce, the barrier or the payload
    broadcast (at ``body``, while the group has a payload in hand: :func:`cbpause.core.group.in_hand` is the group's
    guard).

    pre: rank_invariant(s)
    pre: can_collective_timeout(s)
    post: __return__.fatal and __return__.phase == "stopped"
    post: rank_invariant(__return__)
    """
    return _fail(s)


def close_window(s: RankState) -> RankState:
    """P-CLOSE-WINDOW (``CloseWindow``): the last holder left; go to the barrier.

    pre: rank_invariant(s)
    pre: can_close_window(s)
    post: __return__.phase == "barrier"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="barrier")


def barrier(s: RankState) -> RankState:
    """P-BARRIER (``Barrier``), this rank's part: leave the pause window with the group.

    pre: rank_invariant(s)
    pre: can_barrier(s)
    post: __return__.phase == "body"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="body")


def no_pause(s: RankState) -> RankState:
    """P-NO-PAUSE (``NoPause``).

    pre: rank_invariant(s)
    pre: can_no_pause(s)
    post: __return__.phase == "body"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="body")


def start_step(s: RankState) -> RankState:
    """P-START-STEP (``StartStep``): the forward step runs.  Keeps ExclusionInv: no holder inside.

    pre: rank_invariant(s)
    pre: can_start_step(s)
    post: __return__.phase == "step" and __return__.inside == 0
    post: rank_invariant(__return__)
    """
    return s._replace(phase="step")


def end_step(s: RankState) -> RankState:
    """P-END-STEP (``EndStep``).

    pre: rank_invariant(s)
    pre: can_end_step(s)
    post: __return__.phase == "read"
    post: rank_invariant(__return__)
    """
    return s._replace(phase="read")


def idle(s: RankState) -> RankState:
    """P-IDLE (``Idle``): no work and no stop; go round.

    pre: rank_invariant(s)
    pre: can_idle(s)
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
    completing (R-STOP-RETURNS).  (The other guard, ``not s.closing``, is a wait: a holder arriving at a closing
    window waits for it to close before it asks, R-WINDOW-CLOSES.)"""
    return live(s) and s.local_status == DONT_STOP and not s.fatal


def request_pause(s: RankState, mode: int = KEEP) -> RankState:
    """P-REQUEST-PAUSE (``RequestPause``), in ``mode``, on a window that is not closing.  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: can_request_pause(s) and not s.closing and KEEP <= mode <= ABORT
    post: __return__.count == s.count + 1 and __return__.waiting == s.waiting + 1
    post: _count_of(__return__, mode) == _count_of(s, mode) + 1
    post: rank_invariant(__return__)
    """
    return _plus(s, mode, 1, count=s.count + 1, waiting=s.waiting + 1)


def enter_pause(s: RankState) -> RankState:
    """P-ENTER-PAUSE (``EnterPause``): the window is open, and a holder whose mode it covers waits (the caller
    picks which: one whose mode is at most ``tp_pause``).  Keeps SameWindowInv and ModeInv.

    pre: rank_invariant(s)
    pre: s.paused and s.inside < pending(s)
    post: __return__.inside == s.inside + 1 and __return__.count == s.count
    post: rank_invariant(__return__)
    """
    return s._replace(waiting=s.waiting - 1, inside=s.inside + 1)


def can_leave(s: RankState, mode: int) -> bool:
    """A holder of ``mode`` may be inside: the rank has one inside, and the window covers its mode."""
    return KEEP <= mode <= s.tp_pause and s.inside > 0 and _count_of(s, mode) > 0


def leave_pause(s: RankState, mode: int = KEEP) -> RankState:
    """P-LEAVE-PAUSE (``LeavePause``) of a holder of ``mode``: the last one out of those the window is for closes
    it; while others remain it is closing (R-WINDOW-CLOSES).  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: can_leave(s, mode)
    post: __return__.count == s.count - 1
    post: __return__.paused == (s.paused and pending(__return__) > 0)
    post: __return__.closing == __return__.paused
    post: rank_invariant(__return__)
    """
    return _drop(_plus(s, mode, -1, inside=s.inside - 1, count=s.count - 1), s)


def pause_fails(s: RankState, mode: int = KEEP) -> RankState:
    """P-PAUSE-FAILS (``PauseFails``): the loop is gone; the waiting holder (of ``mode``) raises.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode) and can_pause_fails(s)
    post: __return__.count == s.count - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode)


def interrupt(s: RankState, mode: int = KEEP) -> RankState:
    """P-INTERRUPT (``Interrupt``): a waiting holder (of ``mode``) is interrupted and withdraws.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode)
    post: __return__.count == s.count - 1 and __return__.waiting == s.waiting - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode)


def pause_timeout(s: RankState, mode: int = KEEP) -> RankState:
    """P-PAUSE-TIMEOUT (``PauseTimeout``): a waiting holder's (of ``mode``) timeout ran out; it withdraws.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode)
    post: __return__.count == s.count - 1 and __return__.waiting == s.waiting - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode)


def dead_holder_releasable(s: RankState) -> bool:
    """TLA+ ``DeadHolderReleasable``: where the loop (or ``clear()``) looks for holders whose thread died."""
    return s.phase in ("window", "stopped") or s.draining


def release_dead_holder(s: RankState, inside: bool, mode: int = KEEP) -> RankState:
    """P-RELEASE-DEAD-HOLDER (``ReleaseDeadHolder``): the thread of a holder (of ``mode``) that was waiting
    (``inside`` false) or inside died without leaving (P-HOLDER-DIES, which changes nothing here: the rank does not
    know yet); the loop parked in its window or stepping its batch in a drain (no holder is inside then), or
    ``clear()`` on a stopped loop, releases its hold, and the window is closing, as after any holder's drop
    (R-WINDOW-CLOSES).  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: dead_holder_releasable(s)
    pre: can_leave(s, mode) if inside else can_drop_waiting(s, mode)
    post: __return__.count == s.count - 1
    post: __return__.paused == (s.paused and pending(__return__) > 0)
    post: __return__.closing == __return__.paused
    post: rank_invariant(__return__)
    """
    return leave_pause(s, mode) if inside else _drop_waiting(s, mode)


# ------------------------------------------------------------------------------------------ stoppers, faults


def request_stop(s: RankState, status: int) -> RankState:
    """P-REQUEST-STOP (``RequestStop``): the status only grows (R-MONOTONE-STOP).

    pre: rank_invariant(s)
    pre: status in (FLUSH_AND_STOP, HARD_STOP)
    pre: can_request_stop(s, status)
    post: __return__.local_status == max(status, s.tp_status) and __return__.local_status >= s.local_status
    post: rank_invariant(__return__)
    """
    return s._replace(local_status=max(status, s.tp_status))


def record_fatal_error(s: RankState) -> RankState:
    """P-RECORD-FATAL-ERROR (``RecordFatalError``): an exception in the loop's own code between two iterations'
    collectives (the forward step, preparing the batch, starting the loop); hard-stop and join the group's next
    all-reduce with HARD_STOP.

    pre: rank_invariant(s)
    pre: can_record_fatal_error(s)
    post: __return__.fatal and __return__.local_status == HARD_STOP and __return__.phase == "reduce"
    post: rank_invariant(__return__)
    """
    return s._replace(fatal=True, local_status=HARD_STOP, obs_status=HARD_STOP, obs_pause=0, phase="reduce")


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


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "NamedTuple")]
