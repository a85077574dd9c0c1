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
* ``update_with_tp_status(tp)`` = [the same, up to Observe], then the agreed status is held, pending: its
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
functions below plan those compositions; :class:`DropInLoop` applies them.  The class is mixed into
:class:`~cbpause.PauseProtocol` and holds no state of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import transitions as t
from .condition import SafeCondition
from .loop import dropin_decision, not_enabled
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED, RankState

__all__ = ["DropInLoop", "Plan", "plan_exit", "plan_fatal", "plan_to_read"]

Step = tuple[Callable[..., RankState], tuple]
Plan = tuple[Step, ...]


def _walk(s: RankState, steps: list[Step], fn: Callable[..., RankState], *args: object) -> RankState:
    steps.append((fn, args))
    return fn(s, *args)


def _unreported(s: RankState, pending: int | None) -> int | None:
    """The agreed status of the AllReduce the loop took since its last call: ``pending`` if the loop reported it
    (``update_with_tp_status``); if it reported none since its Observe, the all-reduce of this rank alone (a
    loop at TP=1 that calls only ``is_pause_requested``, as transformers' unit tests write one)."""
    if pending is None and t.can_all_reduce(s):
        return max(s.obs_status, s.tp_status)
    return pending


def _settle(s: RankState, pending: int | None, pause: bool, steps: list[Step]) -> RankState:
    """The AllReduce a drop-in loop took since its last call, with the pause decision ``pause``.

    transformers' loop reports whether the group pauses, not in which mode: a pause is taken in this rank's own
    mode, at least KEEP (the loop applies no mode's effect on the requests: every mode acts as KEEP there).
    """
    if pending is not None:
        return _walk(s, steps, t.all_reduce, pending, dropin_decision(s, pause))
    return s


def _to_body(s: RankState, steps: list[Step]) -> RankState:
    """NoPause or Barrier: the loop went on to the body of its iteration."""
    if t.can_no_pause(s):
        return _walk(s, steps, t.no_pause)
    if t.can_barrier(s):
        return _walk(s, steps, t.barrier)
    return s


def plan_to_read(s: RankState, pending: int | None) -> tuple[Plan, RankState]:
    """The steps from where the loop's last call left it to the start of its next iteration (``read``).

    A loop that saw a pause requested (``obs_pause``) and asks again without reporting its all-reduce or its
    window has not gone round: nothing is planned (it has to open the window first)."""
    steps: list[Step] = []
    if not s.obs_pause:
        pending = _unreported(s, pending)
    s = _to_body(_settle(s, pending, False, steps), steps)
    if t.can_idle(s):
        s = _walk(s, steps, t.idle)
    elif t.can_start_step(s):
        s = _walk(s, steps, t.start_step)
    if t.can_end_step(s):
        s = _walk(s, steps, t.end_step)
    return tuple(steps), s


def plan_fatal(s: RankState, pending: int | None) -> tuple[Plan, RankState]:
    """The steps of a fatal error reported by a drop-in loop: RecordFatalError between two iterations'
    collectives, FailLoop elsewhere (nothing where the error is already recorded or a holder is inside)."""
    steps: list[Step] = []
    if s.fatal:
        return (), s
    s = _to_body(_settle(s, _unreported(s, pending), s.obs_pause, steps), steps)
    if t.can_record_fatal_error(s):
        s = _walk(s, steps, t.record_fatal_error)
    elif t.can_fail_loop(s):
        s = _walk(s, steps, t.fail_loop)
    return tuple(steps), s


def plan_exit(s: RankState, pending: int | None) -> tuple[Plan, RankState]:
    """The steps of a drop-in loop's exit: ExitLoop after a stop, FailLoop after anything else (nothing where
    the loop has already stopped or a holder is inside)."""
    steps: list[Step] = []
    # An all-reduce not reported: the last one of the exit path (transformers' fatal-error path makes one), or
    # that of a loop that reports none.  At TP=1 its result is this rank's own contribution.
    s = _to_body(_settle(s, _unreported(s, pending), s.obs_pause, steps), steps)
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


class DropInLoop:
    """The drop-in loop-side methods (see the module's docstring)."""

    if TYPE_CHECKING:  # provided by PauseProtocol
        fatal_error: BaseException | None
        _lock: threading.RLock  # SafeCondition's lock
        _condition: SafeCondition
        _state: RankState
        _shown_status: int | None
        _pending: int | None
        _loop_thread: int | None
        _observe_memo: tuple

        def _may_remember(self, before: RankState, after: RankState) -> bool: ...

        def _apply(self, fn: Callable[..., RankState], *args: object) -> RankState: ...
        def _run(self, plan: Plan) -> RankState: ...
        def _thread_holds(self) -> list: ...
        def pause_window(self) -> None: ...

    @property
    def local_status(self) -> int:
        """The locally requested stop status, possibly ahead of the value agreed by the TP group; ``STOPPED`` only
        once the loop said so (``mark_as_stopped``), as transformers' object, even after a fatal error."""
        if self._shown_status is not None:
            return self._shown_status
        pending = self._pending
        s = self._state
        return s.local_status if pending is None or pending <= s.local_status else pending

    @property
    def tp_status(self) -> int:
        """The stop status last agreed by the TP group through its MAX all-reduce."""
        pending = self._pending
        return self._state.tp_status if pending is None else pending

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
        me = threading.get_ident()
        memo, lock = self._observe_memo, self._lock
        lock.acquire()  # the hot path, as LoopSteps._remember says
        try:
            if memo[0] is self._state and memo[1] == self._pending and memo[2] == me == self._loop_thread:
                # A steady loop cycles through the same state objects: the steps are the ones taken last time.
                self._state = s = memo[3]
                self._pending = None
                return s.obs_pause
        finally:
            lock.release()
        with self._lock:
            loop = self._loop_thread
            if loop is None:
                self._loop_thread = loop = me
            start = self._state
            if loop != me:
                return start.count > 0
            pending = self._pending
            s, observed = self._to_reduce()
            if not observed:  # (e.g. it asked again after seeing a pause, before its window)
                return s.count > 0
            if self._may_remember(start, s):
                self._observe_memo = (start, pending, me, s)
            return s.obs_pause

    def _to_reduce(self) -> tuple[RankState, bool]:
        """Observe, after the steps the drop-in loop took since its last call (the caller holds the lock); the
        state, and whether the Observe was taken."""
        plan, end = plan_to_read(self._state, self._pending)
        self._pending = None
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
        if me == self._observe_memo[2]:  # the hot path of a loop whose is_pause_requested() replays its memo
            lock = self._lock
            lock.acquire()
            try:
                s = self._state
                if (
                    self._pending is None
                    and t.can_all_reduce(s)
                    and s.obs_status <= tp_status
                    and s.tp_status <= tp_status
                    and self._loop_thread == me
                ):
                    self._pending = tp_status
                    return
            finally:
                lock.release()
        with self._lock:
            # Only the loop calls this: it settles which thread is the loop's, should another thread's
            # is_pause_requested() have come first.
            self._loop_thread = me
            agreed = self._pending if self._pending is not None else self._state.tp_status
            if tp_status < agreed:
                raise ValueError(f"TP communicated a lower stop status: {tp_status = }, tp_status = {agreed}")
            s = self._state
            if not t.can_all_reduce(s) or self._pending is not None:
                s, _ = self._to_reduce()
            if not t.can_all_reduce(s):
                raise RuntimeError(not_enabled("update_with_tp_status", s))
            if tp_status < s.obs_status:
                raise ValueError(f"TP stop status {tp_status} is not a MAX including this rank's {s.obs_status}")
            self._pending = tp_status

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
            pending, s = self._pending, self._state
            if pending is None and not t.pause_decided(s):  # (an explicit all_reduce() decided it already)
                s, _ = self._to_reduce()
                if not t.can_all_reduce(s):
                    raise RuntimeError(not_enabled("pause_and_wait", s))
                pending = max(s.obs_status, s.tp_status)  # TP=1: the all-reduce of this rank alone
            if pending is not None:
                self._pending = None
                s = self._apply(t.all_reduce, pending, dropin_decision(s, True))
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
            plan, after = plan_fatal(self._state, self._pending)
            if after.local_status == STOPPED and self._shown_status is None:
                # FailLoop stops the rank at once in the spec; transformers' object keeps the status the loop
                # asked until the loop says it stopped (issue 26, point 14): show that until mark_as_stopped().
                self._shown_status = self.local_status
            self._pending = None
            self._run(plan)
            self._condition.notify_all()

    def mark_as_stopped(self) -> None:
        """The loop has exited; called on every exit path.  P-EXIT-LOOP after a stop, after the steps the loop
        took since its last call; P-FAIL-LOOP for an exit without a stop (the loop's thread ended)."""
        with self._lock:
            self._shown_status = None
            plan, end = plan_exit(self._state, self._pending)
            if plan and plan[-1][0] is t.fail_loop and self.fatal_error is None:
                self.fatal_error = RuntimeError("the generation loop exited without a stop agreed by its group")
            self._pending = None
            self._run(plan)
            self._condition.notify_all()
