"""The loop side of the drop-in API: transformers' own loop, which reports only some steps of its iteration.

transformers 5.23's loop calls, every iteration, ``is_pause_requested()`` (its Observe),
``update_with_tp_status(tp)`` (its share of the AllReduce, without the pause decision),
``pause_and_wait()`` if the group decided to pause, and on the way out ``record_fatal_error(error)`` and
``mark_as_stopped()``.  It never reports NoPause, StartStep, EndStep, Idle, Barrier or ExitLoop.  Each
drop-in call is therefore the composition of the named actions the loop took since its last call, then the
action it reports, applied in order under one acquisition of the lock (and recorded as those actions, as
microsoft/CCF's ``Traceccfraft.tla`` composes ``UpdateTerm \\cdot HandleAppendEntriesRequest``):

* ``is_pause_requested()`` = [AllReduce(agreed, FALSE)] . [NoPause | Barrier] . [Idle | StartStep . EndStep]
  . Observe -- the pause decision of the last all-reduce is known to be FALSE, since the loop did not pause;
* ``update_with_tp_status(tp)`` = [the same, up to Observe], then the agreed status is held, deferred: its
  AllReduce is applied by the next call, which knows the pause decision (``local_status`` and ``tp_status``
  read it at once, as upstream's do);
* ``pause_and_wait()`` = [Observe] . AllReduce(agreed, TRUE) . the window (``pause_window``);
* ``record_fatal_error(error)`` = [AllReduce] . [NoPause | Barrier] . RecordFatalError, or FailLoop where the
  loop is not between two iterations' collectives;
* ``mark_as_stopped()`` = [AllReduce] . [NoPause | Barrier] . ExitLoop, or FailLoop for an exit without a stop.

A loop that reports no all-reduce (transformers' unit tests drive the status with a plain thread that calls
only ``is_pause_requested``, ``pause_and_wait``, ``request_stop``, ``record_fatal_error`` and
``mark_as_stopped``) is taken to run at TP=1: the AllReduce it did not report agreed on its own observed
status (``_unreported``).

Between the loop's Idle and a forward step nothing tells them apart: a loop asked to flush is taken to have
stepped (StartStep . EndStep), one that was not to have idled; the state after is the same.  The pure
functions below plan those compositions; :class:`PauseProtocol` applies them.  It is
:class:`~cbpause.core.protocol.RankProtocol` (the explicit holder and loop APIs) with the drop-in API on top,
and it owns the state the drop-in loop leaves deferred: the agreed stop status of an AllReduce it reported and
this object has not applied yet (``_deferred``), and the status it shows after a fatal error.  The explicit
APIs know nothing of either: the methods here that override theirs first apply what was deferred.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import transitions as t
from .arguments import check_mode, check_timeout
from .loop import not_enabled
from .protocol import PauseHold, RankProtocol
from .rank import PEER_PARK_TIMEOUT_S
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED, RankState

if TYPE_CHECKING:
    from .recorder import TraceRecorder

__all__ = ["PauseProtocol", "Plan", "plan_exit", "plan_fatal", "plan_to_read"]

# The steps that follow an all-reduce that decided to pause (the others follow one that did not).
_DECIDE_A_PAUSE = frozenset({t.open_window, t.skip_window, t.park_for_peer})


def dropin_decision(s: RankState, pause: bool) -> int:
    """The all-reduced pause request of a drop-in loop, which reports only whether the group pauses."""
    return max(s.obs_pause, t.KEEP) if pause else 0


Step = tuple[Callable[..., RankState], tuple]
Plan = tuple[Step, ...]


def _walk(s: RankState, steps: list[Step], fn: Callable[..., RankState], *args: object) -> RankState:
    steps.append((fn, args))
    return fn(s, *args)


def _unreported(s: RankState, deferred: int | None) -> int | None:
    """The agreed status of the AllReduce the loop took since its last call: ``deferred`` if the loop reported it
    (``update_with_tp_status``); if it reported none since its Observe, the all-reduce of this rank alone (a
    loop at TP=1 that calls only ``is_pause_requested``, as transformers' unit tests write one)."""
    if deferred is None and t.can_all_reduce(s):
        return max(s.obs_status, s.tp_status)
    return deferred


def _settle(s: RankState, deferred: int | None, pause: bool, steps: list[Step]) -> RankState:
    """The AllReduce a drop-in loop took since its last call, with the pause decision ``pause``.

    transformers' loop reports whether the group pauses, not in which mode: a pause is taken in this rank's own
    mode, at least KEEP (the loop applies no mode's effect on the requests: every mode acts as KEEP there).
    """
    if deferred is not None:
        return _walk(s, steps, t.all_reduce, deferred, dropin_decision(s, pause))
    return s


def _to_body(s: RankState, steps: list[Step]) -> RankState:
    """NoPause or Barrier: the loop went on to the body of its iteration."""
    if t.can_no_pause(s):
        return _walk(s, steps, t.no_pause)
    if t.can_barrier(s):
        return _walk(s, steps, t.barrier)
    return s


def plan_to_read(s: RankState, deferred: int | None) -> tuple[Plan, RankState]:
    """The steps from where the loop's last call left it to the start of its next iteration (``read``).

    A loop that saw a pause requested (``obs_pause``) and asks again without reporting its all-reduce or its
    window has not gone round: nothing is planned (it has to open the window first)."""
    steps: list[Step] = []
    if not s.obs_pause:
        deferred = _unreported(s, deferred)
    s = _to_body(_settle(s, deferred, False, steps), steps)
    if t.can_idle(s):
        s = _walk(s, steps, t.idle)
    elif t.can_start_step(s):
        s = _walk(s, steps, t.start_step)
    if t.can_end_step(s):
        s = _walk(s, steps, t.end_step)
    return tuple(steps), s


def plan_fatal(s: RankState, deferred: int | None) -> tuple[Plan, RankState]:
    """The steps of a fatal error reported by a drop-in loop: RecordFatalError between two iterations'
    collectives, FailLoop elsewhere (nothing where the error is already recorded or a holder is inside)."""
    steps: list[Step] = []
    if s.fatal:
        return (), s
    s = _to_body(_settle(s, _unreported(s, deferred), s.obs_pause, steps), steps)
    if t.can_record_fatal_error(s):
        s = _walk(s, steps, t.record_fatal_error)
    elif t.can_fail_loop(s):
        s = _walk(s, steps, t.fail_loop)
    return tuple(steps), s


def plan_exit(s: RankState, deferred: int | None) -> tuple[Plan, RankState]:
    """The steps of a drop-in loop's exit: ExitLoop after a stop, FailLoop after anything else (nothing where
    the loop has already stopped or a holder is inside)."""
    steps: list[Step] = []
    # An all-reduce not reported: the last one of the exit path (transformers' fatal-error path makes one), or
    # that of a loop that reports none.  At TP=1 its result is this rank's own contribution.
    s = _to_body(_settle(s, _unreported(s, deferred), s.obs_pause, steps), steps)
    if not t.may_exit(s) and s.local_status in (FLUSH_AND_STOP, HARD_STOP) and s.phase in ("read", "body", "step"):
        # A stop asked since the last all-reduce: the loop went round once more, to the all-reduce that agreed
        # on it (at TP=1, its own status).
        plan, s = plan_to_read(s, None)
        steps.extend(plan)
        s = _walk(s, steps, t.observe)
        s = _to_body(_settle(s, max(s.obs_status, s.tp_status), s.obs_pause > 0, steps), steps)
    if t.may_exit(s):
        s = _walk(s, steps, t.exit_loop)
    elif t.can_fail_loop(s):
        s = _walk(s, steps, t.fail_loop)
    return tuple(steps), s


class PauseProtocol(RankProtocol):
    """Pause, stop and fatal-error protocol of one rank's continuous-batching loop, with transformers' drop-in API.

    A drop-in for transformers 5.23's ``BackgroundThreadStatus`` (same constants, methods and
    ``fatal_error`` attribute), which fixes its defects: a withdrawn request never parks the loop (D1),
    a stray ``release_pause()`` raises and changes nothing (D2), a rank parked for a peer's pause leaves
    after ``peer_park_timeout`` seconds with :class:`~cbpause.PeerParkTimeout` (D3), and ``acquire_pause()``
    from the loop's own thread raises (D4).  The explicit holder and loop APIs are those of
    :class:`~cbpause.core.protocol.RankProtocol`; a loop may mix the two (see the module's docstring).  Its keyword
    arguments (``peer_park_timeout``, ``clock``, ``trace``) are :class:`~cbpause.core.rank.RankCore`'s.
    """

    def __init__(
        self,
        *,
        peer_park_timeout: float | None = PEER_PARK_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        trace: TraceRecorder | None = None,
    ):
        self._deferred: int | None = None  # the agreed status of an AllReduce the loop reported, not applied yet
        self._shown_status: int | None = None  # the loop's local_status after a fatal error, until it stops
        super().__init__(peer_park_timeout=peer_park_timeout, clock=clock, trace=trace)

    # ------------------------------------------------------------------------------ what the explicit APIs defer

    def _forget_loop(self) -> None:
        super()._forget_loop()
        self._shown_status = None

    def _apply_deferred(self, pause: bool) -> None:
        """Apply the AllReduce a drop-in ``update_with_tp_status()`` deferred, with the pause decision ``pause`` (the
        caller holds the lock): a loop that mixes the two APIs is recorded as it went (a pause in this rank's own
        mode, at least KEEP: the drop-in reports no mode)."""
        deferred = self._deferred
        if deferred is not None:
            self._deferred = None
            self._apply(t.all_reduce, deferred, dropin_decision(self._state, pause))

    def _step(self, fn: Callable[..., RankState], guard: Callable[[RankState], bool]) -> RankState:
        """The explicit loop step ``fn`` after the AllReduce it shows the decision of, if one was deferred: the
        step's guard is checked on the state that AllReduce leads to, and nothing changes when it fails."""
        if self._deferred is not None:
            with self._lock:
                s = self._state
                if self._deferred is not None and t.can_all_reduce(s):
                    pause = fn in _DECIDE_A_PAUSE or (fn is t.exit_loop and s.obs_pause > 0)
                    if not guard(t.all_reduce(s, self._deferred, dropin_decision(s, pause))):
                        raise RuntimeError(not_enabled(fn.__name__, s))
                    self._apply_deferred(pause)
        return super()._step(fn, guard)

    def pause_window(self, barrier: bool = False) -> None:
        """:meth:`RankProtocol.pause_window <cbpause.core.loop.LoopSteps.pause_window>`, after the AllReduce a
        drop-in ``update_with_tp_status()`` deferred (its decision: pause).  Only the loop's thread sets or applies
        ``_deferred``, so the loop (the caller) reads it without the lock: none taken on the resume's path when none
        is deferred (issue 38)."""
        if self._deferred is not None:
            with self._lock:
                self._apply_deferred(True)
        super().pause_window(barrier)

    def fail_loop(self, error: BaseException) -> None:
        """:meth:`RankProtocol.fail_loop <cbpause.core.loop.LoopSteps.fail_loop>`, after the AllReduce a drop-in
        ``update_with_tp_status()`` deferred (its decision: this rank's own request)."""
        with self._lock:
            self._apply_deferred(self._state.obs_pause > 0)
        super().fail_loop(error)

    def request_stop(self, status: int, global_rank: int = 0) -> None:
        """:meth:`RankProtocol.request_stop`; a failed loop not yet marked stopped shows the stop asked, as
        upstream's object does."""
        super().request_stop(status, global_rank)
        with self._lock:
            if self._shown_status is not None and self._shown_status < status:
                self._shown_status = status  # a failed loop not yet marked stopped shows the stop, as upstream's

    def _run(self, plan: Plan) -> RankState:
        """Apply the steps of ``plan`` in order (the caller holds the lock)."""
        for fn, args in plan:
            self._apply(fn, *args)
        return self._state

    # ------------------------------------------------------------------------------------------- the loop

    @property
    def local_status(self) -> int:
        """The locally requested stop status, possibly ahead of the value agreed by the TP group; ``STOPPED`` only
        once the loop said so (``mark_as_stopped``), as transformers' object, even after a fatal error."""
        if self._shown_status is not None:
            return self._shown_status
        deferred = self._deferred
        s = self._state
        return s.local_status if deferred is None or deferred <= s.local_status else deferred

    @property
    def tp_status(self) -> int:
        """The stop status last agreed by the TP group through its MAX all-reduce."""
        deferred = self._deferred
        return self._state.tp_status if deferred is None else deferred

    def is_pause_requested(self, local: bool = False) -> bool:
        """Whether a pause is requested and not released yet.

        With ``local=True``: by the calling thread (it waits for or holds a pause).  Otherwise, called by the
        loop before its all-reduce, it is P-OBSERVE (``Observe``), after the steps the loop took since its last
        call; the answer is recorded, so that the protocol knows later whether a pause window was asked for
        locally (D1).  The first thread to call it (or ``update_with_tp_status()``) after ``clear()`` is taken
        to be the loop's thread.
        """
        if local:
            return any(h.state != "idle" for h in self._thread_holds())
        return self.observe_dropin()  # type: ignore[return-value]  # a mode (0 for none), read as a bool upstream

    def _observe_dropin_slow(self, me: int) -> int:
        with self._lock:
            loop = self._loop_thread
            if loop is None:
                self._loop_thread = loop = me
            start, deferred = self._state, self._deferred
            if loop != me:
                return int(start.count > 0)
            s, observed = self._to_reduce()
            if not observed:  # (e.g. it asked again after seeing a pause, before its window)
                return int(s.count > 0)
            self._remember("observe_dropin", start, s, deferred, me)
            return s.obs_pause

    def _to_reduce(self) -> tuple[RankState, bool]:
        """Observe, after the steps the drop-in loop took since its last call (the caller holds the lock); the
        state, and whether the Observe was taken."""
        plan, end = plan_to_read(self._state, self._deferred)
        self._deferred = None
        self._run(plan)
        observed = t.can_observe(end)
        if observed:
            self._apply(t.observe)
        return self._state, observed

    def update_with_tp_status(self, tp_status: int) -> None:
        """Drop-in part of P-ALL-REDUCE: take the stop status the TP group agreed on.

        The AllReduce is applied by the loop's next call, which knows the group's pause decision; until then
        ``tp_status`` and ``local_status`` read the agreed status.  Raises ``ValueError`` if the status is
        unknown, goes down (MonotoneStopInv) or is below what this rank sent (the result of a MAX).
        """
        if tp_status.__class__ is not int:  # the hot path takes plain ints; accept any integer type
            if isinstance(tp_status, bool) or not hasattr(tp_status, "__index__"):
                raise ValueError(f"Unknown TP stop status {tp_status!r}")
            tp_status = tp_status.__index__()
        if not DONT_STOP <= tp_status <= STOPPED:
            raise ValueError(f"Unknown TP stop status {tp_status!r}")
        # The group never agrees on STOPPED (a stopped loop no longer all-reduces); take it as HARD_STOP.
        if tp_status > HARD_STOP:
            tp_status = HARD_STOP
        me = threading.get_ident()
        with self._lock:
            s, deferred = self._state, self._deferred
            if deferred is not None or self._loop_thread != me or not t.can_all_reduce(s):
                # Only the loop calls this: it settles which thread is the loop's, should another thread's
                # is_pause_requested() have come first; and a loop that did not report its Observe goes round first.
                self._loop_thread = me
                if deferred is not None and tp_status < deferred:
                    raise ValueError(f"TP communicated a lower stop status: {tp_status = }, tp_status = {deferred}")
                if deferred is not None or not t.can_all_reduce(s):
                    s, _ = self._to_reduce()
                if not t.can_all_reduce(s):
                    raise RuntimeError(not_enabled("update_with_tp_status", s))
            if tp_status < s.tp_status:
                raise ValueError(f"TP communicated a lower stop status: {tp_status = }, tp_status = {s.tp_status}")
            if tp_status < s.obs_status:
                raise ValueError(f"TP stop status {tp_status} is not a MAX including this rank's {s.obs_status}")
            self._deferred = tp_status

    def pause_and_wait(self) -> None:
        """Drop-in pause window: the group decided to pause; park as the spec says, then return.

        [Observe] . AllReduce(agreed, this rank's mode), then the window: P-OPEN-WINDOW if a local holder is
        pending, and return when the last one leaves (P-CLOSE-WINDOW); P-SKIP-WINDOW if this rank's own request
        was withdrawn (D1: return at once); otherwise P-PARK-FOR-PEER: wait for the local holder for at most
        ``peer_park_timeout`` seconds, then raise :class:`~cbpause.PeerParkTimeout` (P-PEER-PARK-TIMEOUT, D3).
        """
        with self._lock:
            if self._loop_thread is None:
                self._loop_thread = threading.get_ident()
            deferred, s = self._deferred, self._state
            if deferred is None and not t.pause_decided(s):  # (an explicit all_reduce() decided it already)
                s, _ = self._to_reduce()
                if not t.can_all_reduce(s):
                    raise RuntimeError(not_enabled("pause_and_wait", s))
                deferred = max(s.obs_status, s.tp_status)  # TP=1: the all-reduce of this rank alone
            if deferred is not None:
                self._deferred = None
                s = self._apply(t.all_reduce, deferred, dropin_decision(s, True))
            if not t.pause_decided(s):
                return  # the group is hard-stopping: no window; the loop exits
        self.pause_window()

    def record_fatal_error(self, error: BaseException) -> None:
        """Record the loop's fatal error (the first one wins); waiting holders raise with it as ``__cause__``.

        P-RECORD-FATAL-ERROR (``RecordFatalError``) between two iterations' collectives (read, body, step),
        after the steps the loop took since its last call; P-FAIL-LOOP (``FailLoop``) elsewhere.
        """
        with self._lock:
            if self.fatal_error is None:
                self.fatal_error = error
            plan, after = plan_fatal(self._state, self._deferred)
            if after.local_status == STOPPED and self._shown_status is None:
                # FailLoop stops the rank at once in the spec; transformers' object keeps the status the loop
                # asked until the loop says it stopped (issue 26, point 14): show that until mark_as_stopped().
                self._shown_status = self.local_status
            self._deferred = None
            self._run(plan)
            self._condition.notify_all()

    def mark_as_stopped(self) -> None:
        """The loop has exited; called on every exit path.  P-EXIT-LOOP after a stop, after the steps the loop
        took since its last call; P-FAIL-LOOP for an exit without a stop (the loop's thread ended)."""
        with self._lock:
            self._shown_status = None
            plan, end = plan_exit(self._state, self._deferred)
            if plan and plan[-1][0] is t.fail_loop and self.fatal_error is None:
                self.fatal_error = RuntimeError("the generation loop exited without a stop agreed by its group")
            self._deferred = None
            self._run(plan)
            self._condition.notify_all()

    # ---- generated by scripts/gen_hot_steps.py: do not edit (tests/test_generated.py checks it) ----
    # The hot steps, and the width of one memo of each: (before, *keys, after).
    _MEMO_WIDTHS = {**RankProtocol._MEMO_WIDTHS, "observe_dropin": 4}

    def observe_dropin(self) -> int:
        """P-OBSERVE as the drop-in loop reports it (``is_pause_requested()``): the steps the
        loop took since its last call, then Observe; returns this rank's pause request (0 for none)."""
        me = threading.get_ident()
        memo, lock = self._memo_observe_dropin, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state and memo[1] == self._deferred and memo[2] == me:
                self._state = s = memo[3]
                self._deferred = None
                return s.obs_pause
            if memo[4] is self._state and memo[5] == self._deferred and memo[6] == me:  # the other of the last two
                self._state = s = memo[7]
                self._deferred = None
                self._memo_observe_dropin = (*memo[4:], *memo[:4])
                return s.obs_pause
        finally:
            lock.release()
        return self._observe_dropin_slow(me)

    # ---- end of the generated hot steps ----

    # ------------------------------------------------------------------------------------------- the holders

    def _thread_holds(self) -> list[PauseHold]:
        """The drop-in holds of the calling thread (``acquire_pause`` ... ``release_pause``)."""
        local = self._local
        try:
            return local.holds
        except AttributeError:
            local.holds = []
            return local.holds

    def acquire_pause(
        self,
        wake_up_loop: threading.Event | None = None,
        timeout: float | None = None,
        *,
        into: list[PauseHold] | None = None,
        mode: str | int = "keep",
    ) -> PauseHold:
        """Drop-in: P-REQUEST-PAUSE, then wait for P-ENTER-PAUSE, P-PAUSE-FAILS, P-INTERRUPT or P-PAUSE-TIMEOUT.

        Returns the hold once this thread is inside the pause: :meth:`release_pause` on the same thread leaves
        it, and so does :meth:`leave_pause` with the hold, from any thread (once: a second leave raises).  The
        hold counts as this thread's for ``is_pause_requested(local=True)`` until it leaves.  Raises as
        :meth:`request_pause` and :meth:`enter_pause` do.  The request and the wait happen under one
        acquisition of the lock, so an interrupt anywhere in between withdraws exactly the request that went
        in, and an exception that lands just after the entry leaves again: an exception from this call means no
        pause is held.

        A window already open in a mode that covers ``mode`` is entered at once, under the same acquisition,
        without setting ``wake_up_loop`` (the loop is parked in its window), unless a holder has left it already:
        that window is closing, and this call waits for it to close and asks for the next (R-WINDOW-CLOSES; the
        wait counts against ``timeout``).  A thread already inside pauses again at once (its pauses nest).
        ``into``, a list, gets the hold appended the moment it is requested, for a caller that must find it even
        when an asynchronous exception lands after this returns and before the caller stored the result.  ``mode``
        is the pause mode (R-MODES; as :meth:`request_pause`).
        """
        timeout = check_timeout(timeout)
        number = check_mode(mode)
        self._refuse_loop_thread()
        holds = self._thread_holds()
        if holds:
            holds[:] = [h for h in holds if h.state != "idle"]  # left from another thread (leave_pause)
        with self._lock:
            sinks = (holds,) if into is None else (holds, into)
            try:
                return self._request_and_enter(number, timeout, wake_up_loop, sinks, threading.get_ident())
            except BaseException:
                holds[:] = [h for h in holds if h.state != "idle"]  # the request withdrawn is no hold of this thread
                raise

    def release_pause(self) -> None:
        """Drop-in P-LEAVE-PAUSE (``LeavePause``): this thread's last pause ends; the last holder out lets the
        loop resume.

        Raises ``RuntimeError`` and changes nothing if this thread holds no pause (D2, CountsInv).
        """
        holds = self._thread_holds()
        holds[:] = [h for h in holds if h.state != "idle"]  # left from another thread (leave_pause)
        with self._lock:
            inside = [h for h in holds if h.state == "inside"]
            if not inside:
                raise RuntimeError(
                    "release_pause() without a matching acquire_pause() on this thread: nothing was changed"
                )
            hold = inside[-1]
            self._apply(t.leave_pause, hold.mode, hold=hold)
            holds.remove(hold)
