"""One rank's protocol state, what always holds of it, and when each action is enabled.

:class:`RankState` is the TLA+ variables of ``tla/PauseProtocol.tla`` indexed by one rank; :func:`rank_invariant` the
per-rank parts of ``TypeOK``, ``CountsInv`` and ``SameWindowInv``.  Then one named guard per action, its enabling
condition on what this rank sees (``can_<action>``, as TLA+'s ``PauseDecided``, ``CanRequestPause``, ``CanSubmit``):
the action's ``pre:`` in :mod:`cbpause.core.transitions` (beside ``rank_invariant``), the explicit loop API
(:mod:`cbpause.core.loop`), the holders' API (:mod:`cbpause.core.protocol`), the group's ``Next``
(:mod:`cbpause.core.group`, which adds what one rank cannot see: the batch, a payload in hand) and the drop-in
planner (:mod:`cbpause.core.dropin`) call it; none restates it.  :mod:`cbpause.core.transitions` re-exports all of
it.
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


def _count_of(s: RankState, mode: int) -> int:
    """How many of the rank's holders asked for ``mode``."""
    if mode == KEEP:
        return s.n_keep
    if mode == RETRACT:
        return s.n_retract
    return s.n_drain if mode == DRAIN else s.n_abort


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


# ----------------------------------------------------------------------------------------------- the guards
# One named guard per action (its enabling condition on what this rank sees); the loop's first.


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


def can_submit(s: RankState) -> bool:  # TLA+ CanSubmit: the driver takes a new request (P-SUBMIT)
    return live(s) and s.local_status == DONT_STOP and not s.fatal


def can_enter_window(s: RankState, mode: int) -> bool:  # EnterPause: the open window covers the mode (R-MODES)
    return s.paused and mode <= s.tp_pause


def can_pause_fails(s: RankState) -> bool:  # PauseFails: no window, and the loop has stopped or failed
    return not s.paused and (s.local_status == STOPPED or s.fatal)


def can_request_stop(s: RankState, status: int) -> bool:  # RequestStop: a stop above the one asked, on a live loop
    return live(s) and s.local_status < status


def pause_decided(s: RankState) -> bool:
    """TLA+ ``PauseDecided(r)``."""
    return s.phase == "decided" and s.tp_status < HARD_STOP and s.tp_pause > 0


def may_exit(s: RankState) -> bool:
    """The guard of P-EXIT-LOOP that this rank can see: a hard stop before any window, or a flush in the body
    (the group adds "and nothing is left to generate")."""
    return (s.phase == "decided" and s.tp_status == HARD_STOP) or (
        s.phase == "body" and s.tp_status == FLUSH_AND_STOP
    )


def can_request_pause(s: RankState) -> bool:
    """The guard of P-REQUEST-PAUSE; ``pause()`` raises at once when it is false.  No new pause once a stop is
    asked on this rank or agreed by the group: holders that keep pausing could keep a flush stop from ever
    completing (R-STOP-RETURNS).  (The other guard, ``not s.closing``, is a wait: a holder arriving at a closing
    window waits for it to close before it asks, R-WINDOW-CLOSES.)"""
    return live(s) and s.local_status == DONT_STOP and not s.fatal


def can_leave(s: RankState, mode: int) -> bool:
    """A holder of ``mode`` may be inside: the rank has one inside, and the window covers its mode."""
    return KEEP <= mode <= s.tp_pause and s.inside > 0 and _count_of(s, mode) > 0


def dead_holder_releasable(s: RankState) -> bool:
    """TLA+ ``DeadHolderReleasable``: where the loop (or ``clear()``) looks for holders whose thread died."""
    return s.phase in ("window", "stopped") or s.draining


__all__ = [name for name in dir() if not name.startswith("_") and name not in ("annotations", "NamedTuple")]
