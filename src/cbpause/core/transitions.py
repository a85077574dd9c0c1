"""One rank's state changes, as pure functions over a frozen value.

This module is the Python transcription of the per-rank part of ``tla/PauseProtocol.tla``.  Each function
is one TLA+ action, same name in snake case (``OpenWindow`` -> :func:`open_window`), and each ``pre:`` line
is the action's enabling condition (its named guard, of :mod:`cbpause.core.state`).  :func:`rank_invariant`, the
per-rank parts of ``TypeOK``, ``CountsInv`` and ``SameWindowInv``, is every function's ``pre:`` and ``post:``.  The
contracts are PEP 316 docstrings, which CrossHair checks (``nox -s crosshair``).

:mod:`cbpause.core.state` holds what this module acts on: :class:`RankState`, what one rank's
:class:`cbpause.PauseProtocol` holds and changes under its lock, the invariant, and one guard per action; this
module re-exports them, so that ``transitions.can_open_window`` is the guard of :func:`open_window`.  The conditions
that span ranks, holders and requests (the collectives' "every rank", who a holder is, the requests) are in
:mod:`cbpause.core.group`, which builds the whole TLA+ ``Next`` from these functions.
"""

from __future__ import annotations

# Absolute, so that a copy of this module outside the package (a planted bug, tests/test_crosshair.py) still imports.
from cbpause.core.state import (  # noqa: F401 - re-exported: the guards, the state and its constants
    ABORT,
    DONT_STOP,
    DRAIN,
    FLUSH_AND_STOP,
    HARD_STOP,
    KEEP,
    LIVE_PHASES,
    MODE_NAMES,
    MODES,
    PARKED_PHASES,
    PHASES,
    RETRACT,
    STOP_STATUSES,
    STOPPED,
    RankState,
    _count_of,
    asked,
    can_all_reduce,
    can_barrier,
    can_close_window,
    can_collective_timeout,
    can_drain_first,
    can_drop_waiting,
    can_end_step,
    can_enter_window,
    can_fail_loop,
    can_idle,
    can_join_peer_pause,
    can_leave,
    can_no_pause,
    can_observe,
    can_open_window,
    can_park_for_peer,
    can_pause_fails,
    can_peer_park_timeout,
    can_record_fatal_error,
    can_request_pause,
    can_request_stop,
    can_skip_window,
    can_start_step,
    can_submit,
    dead_holder_releasable,
    live,
    may_exit,
    pause_decided,
    pending,
    rank_invariant,
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


def _drop(after: RankState, s: RankState, queued: tuple[int, ...]) -> RankState:
    """TLA+ ``Drop(h)``: ``after`` (``s`` less one holder) with the window still open while a holder it is for
    remains, and then closing: it admits no newcomer (R-WINDOW-CLOSES).  A closed window is not closing, and the
    holders queued at it (``queued``: their modes, P-QUEUE-PAUSE) wait from then on, counted, before any holder
    that asks later."""
    still_open = s.paused and pending(after) > 0
    after = after._replace(paused=still_open, closing=still_open)
    if not still_open:
        for mode in queued:
            after = _plus(after, mode, 1, count=after.count + 1, waiting=after.waiting + 1)
    return after


def _drop_waiting(s: RankState, mode: int, queued: tuple[int, ...]) -> RankState:
    return _drop(_plus(s, mode, -1, waiting=s.waiting - 1, count=s.count - 1), s, queued)


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


def exit_loop(s: RankState) -> RankState:
    """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or flush with nothing left.

    pre: rank_invariant(s)
    pre: may_exit(s)
    post: __return__.phase == "stopped" and __return__.local_status == STOPPED
    post: rank_invariant(__return__)
    """
    return s._replace(phase="stopped", local_status=STOPPED)


# --------------------------------------------------------------------------------------------------- holders


def request_pause(s: RankState, mode: int = KEEP) -> RankState:
    """P-REQUEST-PAUSE (``RequestPause``), in ``mode``, on a window that is not closing.  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: can_request_pause(s) and not s.closing and KEEP <= mode <= ABORT
    post: __return__.count == s.count + 1 and __return__.waiting == s.waiting + 1
    post: _count_of(__return__, mode) == _count_of(s, mode) + 1
    post: rank_invariant(__return__)
    """
    return _plus(s, mode, 1, count=s.count + 1, waiting=s.waiting + 1)


def queue_pause(s: RankState, mode: int = KEEP) -> RankState:
    """P-QUEUE-PAUSE (``QueuePause``), in ``mode``, on a window that is closing: the holder is queued, not counted
    (it cannot keep the window open); the drop that closes the window makes it waiting (``queued`` of
    :func:`leave_pause` and the other drops), before any holder that asks later (R-WINDOW-CLOSES, first come).  The
    rank's state does not change.

    pre: rank_invariant(s)
    pre: can_request_pause(s) and s.closing and KEEP <= mode <= ABORT
    post: __return__ == s
    """
    return s


def leave_queue(s: RankState) -> RankState:
    """P-LEAVE-QUEUE (``LeaveQueue``): a queued holder is interrupted, its timeout runs out, or a stop or a failure
    refuses it before the close; it was never counted, and the rank's state does not change.

    pre: rank_invariant(s)
    pre: s.closing
    post: __return__ == s
    """
    return s


def enter_pause(s: RankState) -> RankState:
    """P-ENTER-PAUSE (``EnterPause``): the window is open, and a holder whose mode it covers waits (the caller
    picks which: one whose mode is at most ``tp_pause``).  Keeps SameWindowInv and ModeInv.

    pre: rank_invariant(s)
    pre: s.paused and s.inside < pending(s)
    post: __return__.inside == s.inside + 1 and __return__.count == s.count
    post: rank_invariant(__return__)
    """
    return s._replace(waiting=s.waiting - 1, inside=s.inside + 1)


def leave_pause(s: RankState, mode: int = KEEP, queued: tuple[int, ...] = ()) -> RankState:
    """P-LEAVE-PAUSE (``LeavePause``) of a holder of ``mode``: the last one out of those the window is for closes
    it, and the holders queued at it (their modes ``queued``) wait from then on; while others remain it is closing
    (R-WINDOW-CLOSES).  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: can_leave(s, mode)
    pre: _queueable(s, queued)
    post: __return__.count == s.count - 1 + _admitted(__return__, queued)
    post: __return__.paused == (s.paused and pending(_drop_only(s, mode)) > 0)
    post: __return__.closing == __return__.paused
    post: rank_invariant(__return__)
    """
    return _drop(_plus(s, mode, -1, inside=s.inside - 1, count=s.count - 1), s, queued)


def _drop_only(s: RankState, mode: int) -> RankState:
    """What :func:`leave_pause` leaves before the window's fate (for its contract)."""
    return _plus(s, mode, -1, inside=s.inside - 1, count=s.count - 1)


def _queueable(s: RankState, queued: tuple[int, ...]) -> bool:
    """Holders are queued only at a closing window, each in a mode (for the drops' contracts)."""
    return (not queued or s.closing) and all(KEEP <= m <= ABORT for m in queued)


def _admitted(after: RankState, queued: tuple[int, ...]) -> int:
    """How many queued holders a drop made waiting: all of them once the window closed (for the contracts)."""
    return 0 if after.paused else len(queued)


def pause_fails(s: RankState, mode: int = KEEP, queued: tuple[int, ...] = ()) -> RankState:
    """P-PAUSE-FAILS (``PauseFails``): the loop is gone; the waiting holder (of ``mode``) raises.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode) and can_pause_fails(s)
    pre: _queueable(s, queued)
    post: __return__.count == s.count - 1
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode, queued)


def interrupt(s: RankState, mode: int = KEEP, queued: tuple[int, ...] = ()) -> RankState:
    """P-INTERRUPT (``Interrupt``): a waiting holder (of ``mode``) is interrupted and withdraws.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode)
    pre: _queueable(s, queued)
    post: __return__.count == s.count - 1 + _admitted(__return__, queued)
    post: __return__.waiting == s.waiting - 1 + _admitted(__return__, queued)
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode, queued)


def pause_timeout(s: RankState, mode: int = KEEP, queued: tuple[int, ...] = ()) -> RankState:
    """P-PAUSE-TIMEOUT (``PauseTimeout``): a waiting holder's (of ``mode``) timeout ran out; it withdraws.

    pre: rank_invariant(s)
    pre: can_drop_waiting(s, mode)
    pre: _queueable(s, queued)
    post: __return__.count == s.count - 1 + _admitted(__return__, queued)
    post: __return__.waiting == s.waiting - 1 + _admitted(__return__, queued)
    post: rank_invariant(__return__)
    """
    return _drop_waiting(s, mode, queued)


def release_dead_holder(s: RankState, inside: bool, mode: int = KEEP, queued: tuple[int, ...] = ()) -> RankState:
    """P-RELEASE-DEAD-HOLDER (``ReleaseDeadHolder``): the thread of a holder (of ``mode``) that was waiting
    (``inside`` false) or inside died without leaving (P-HOLDER-DIES, which changes nothing here: the rank does not
    know yet); the loop parked in its window or stepping its batch in a drain (no holder is inside then), or
    ``clear()`` on a stopped loop, releases its hold, and the window is closing, as after any holder's drop
    (R-WINDOW-CLOSES).  Keeps CountsInv.

    pre: rank_invariant(s)
    pre: dead_holder_releasable(s)
    pre: can_leave(s, mode) if inside else can_drop_waiting(s, mode)
    pre: _queueable(s, queued)
    post: __return__.count == s.count - 1 + _admitted(__return__, queued)
    post: __return__.paused <= s.paused
    post: __return__.closing == __return__.paused
    post: rank_invariant(__return__)
    """
    return leave_pause(s, mode, queued) if inside else _drop_waiting(s, mode, queued)


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
