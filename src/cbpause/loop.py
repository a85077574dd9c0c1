"""The explicit loop API of :class:`~cbpause.PauseProtocol`: one method per TLA+ action of the loop.

A loop that reports each step of its iteration calls these, in the order of ``tla/PauseProtocol.tla``
(``observe``, ``all_reduce``, then ``open_window``/``skip_window``/``park_for_peer`` or ``no_pause``, ...,
``barrier``, ``start_step``, ``end_step``).  Each method applies its transition of
:mod:`cbpause.transitions` under the protocol's lock if the action's guard holds there, and otherwise raises
``RuntimeError`` and changes nothing.  None of them waits, except :meth:`LoopSteps.pause_window`, which is
the whole window (open, or park and join, then close) as a loop that does not step through it calls it.

The class is mixed into :class:`~cbpause.PauseProtocol`; it holds no state of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import transitions as t
from .errors import PeerParkTimeout
from .transitions import DONT_STOP, HARD_STOP, STOPPED, RankState

__all__ = ["LoopSteps", "not_enabled", "quiet"]


def not_enabled(action: str, s: RankState) -> str:
    """The message of the ``RuntimeError`` a step raises when its guard does not hold."""
    return f"{action}() is not enabled in loop phase {s.phase!r} ({s})"


def quiet(before: RankState, after: RankState) -> bool:
    """Whether going from ``before`` to ``after`` can enable no waiter, so that it may be replayed from a memo
    without waking anybody: the window, the holders and the loop's end are as they were."""
    return (
        before.paused == after.paused
        and before.count == after.count
        and before.waiting == after.waiting
        and before.fatal == after.fatal
        and (before.local_status == STOPPED) == (after.local_status == STOPPED)
    )


# The steps that follow an all-reduce that decided to pause (the others follow one that did not).
_DECIDE_A_PAUSE = frozenset({t.open_window, t.skip_window, t.park_for_peer})


class LoopSteps:
    """The explicit loop API (see the module's docstring)."""

    if TYPE_CHECKING:  # provided by PauseProtocol
        fatal_error: BaseException | None
        _lock: threading.Lock
        _condition: threading.Condition
        _state: RankState
        _loop_thread: int | None
        _peer_park_timeout: float | None
        _clock: Callable[[], float]
        _trace: object
        _step_memo: dict
        _pending: int | None

        def _apply(self, fn: Callable[..., RankState], *args: object) -> RankState: ...

    def _settle_pending(self, pause: bool) -> None:
        """The AllReduce of a drop-in ``update_with_tp_status()`` that this step shows the decision of (the caller
        holds the lock): a loop that mixes the two APIs is recorded as it went."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self._apply(t.all_reduce, pending, pause)

    def _step(self, fn: Callable[..., RankState], guard: Callable[[RankState], bool], *args: object) -> RankState:
        """One loop step: ``fn`` if ``guard`` holds (checked under the lock), else ``RuntimeError`` and no
        change.

        A steady loop takes the same step from the same state object every iteration: with trace recording off,
        a step that can enable no waiter (:func:`quiet`) is replayed from its memo, guard included.
        """
        with self._lock:
            s = self._state
            memo = self._step_memo.get(fn)
            if memo is not None and memo[0] is s and memo[1] == args and self._trace is None and self._pending is None:
                self._state = memo[2]
                return memo[2]
            pending = self._pending
            if pending is not None and s.phase == "reduce":
                pause = fn in _DECIDE_A_PAUSE or (fn is t.exit_loop and s.obs_pause)
                if not guard(t.all_reduce(s, pending, pause)):
                    raise RuntimeError(not_enabled(fn.__name__, s))
                self._settle_pending(pause)
                s = self._state
            if not guard(s):
                raise RuntimeError(not_enabled(fn.__name__, s))
            after = self._apply(fn, *args)
            if quiet(s, after):
                self._step_memo[fn] = (s, args, after)
            return after

    def observe(self) -> tuple[int, bool]:
        """P-OBSERVE (``Observe``): what this rank sends to the all-reduce: (stop status, pause requested)."""
        with self._condition:
            self._loop_thread = threading.get_ident()
        s = self._step(t.observe, lambda s: s.phase == "read")
        return s.obs_status, s.obs_pause

    def all_reduce(self, tp_status: int, tp_pause: bool) -> None:
        """P-ALL-REDUCE (``AllReduce``): the group's MAX of stop statuses and pause requests.

        Raises ``ValueError`` if the result cannot be a MAX that includes this rank's contribution.
        """
        with self._condition:
            s = self._state
            if s.phase != "reduce":
                raise RuntimeError(not_enabled("all_reduce", s))
            if tp_status not in t.STOP_STATUSES or not s.obs_status <= tp_status < STOPPED:
                raise ValueError(f"all-reduced stop status {tp_status!r} is not a MAX including {s.obs_status}")
            if tp_status < s.tp_status:
                raise ValueError(f"all-reduced stop status {tp_status!r} is below the agreed {s.tp_status}")
            if s.obs_pause and not tp_pause:
                raise ValueError("all-reduced pause flag is False although this rank asked for a pause")
            self._apply(t.all_reduce, tp_status, bool(tp_pause))

    def open_window(self) -> None:
        """P-OPEN-WINDOW (``OpenWindow``): a local holder is pending; open the window (does not wait)."""
        self._step(t.open_window, lambda s: t.pause_decided(s) and s.count > 0)

    def skip_window(self) -> None:
        """P-SKIP-WINDOW (``SkipWindow``): this rank asked, every local request was withdrawn (D1)."""
        self._step(t.skip_window, lambda s: t.pause_decided(s) and s.count == 0 and s.obs_pause)

    def park_for_peer(self) -> None:
        """P-PARK-FOR-PEER (``ParkForPeer``): a peer asked, no local holder is pending (does not wait)."""
        self._step(t.park_for_peer, lambda s: t.pause_decided(s) and s.count == 0 and not s.obs_pause)

    def join_peer_pause(self) -> None:
        """P-JOIN-PEER-PAUSE (``JoinPeerPause``): the local holder came; open the window."""
        self._step(t.join_peer_pause, lambda s: s.phase == "peer" and s.count > 0)

    def peer_park_timeout(self) -> PeerParkTimeout:
        """P-PEER-PARK-TIMEOUT (``PeerParkTimeout``): no local holder came; record the error and stop
        (P-FAIL-LOOP).  Returns the :class:`~cbpause.PeerParkTimeout` it recorded, for the loop to raise."""
        with self._condition:
            s = self._state
            if not (s.phase == "peer" and s.count == 0):
                raise RuntimeError(not_enabled("peer_park_timeout", s))
            return self._peer_park_expired()

    def _peer_park_expired(self) -> PeerParkTimeout:
        """P-PEER-PARK-TIMEOUT (the caller holds the lock and checked the guard)."""
        error = PeerParkTimeout(
            f"parked for a peer's pause, and no local holder came within {self._peer_park_timeout} s:"
            " under tensor parallelism every rank must pause (spec P-PEER-PARK-TIMEOUT)"
        )
        if self.fatal_error is None:
            self.fatal_error = error
        self._apply(t.peer_park_timeout)
        return error

    def close_window(self) -> None:
        """P-CLOSE-WINDOW (``CloseWindow``): the last holder left; go to the barrier."""
        self._step(t.close_window, lambda s: s.phase == "window" and not s.paused)

    def pause_window(self) -> None:
        """The pause window after a pause decision: P-OPEN-WINDOW, P-SKIP-WINDOW or P-PARK-FOR-PEER, then
        P-JOIN-PEER-PAUSE or P-PEER-PARK-TIMEOUT, and P-CLOSE-WINDOW.  Returns at the barrier.

        Blocks while a holder is inside.  Raises :class:`~cbpause.PeerParkTimeout` (the fatal error is
        recorded and the loop is stopped, P-FAIL-LOOP) when parked for a peer's pause with no local holder
        within ``peer_park_timeout`` seconds.
        """
        with self._condition:
            self._settle_pending(True)
            s = self._state
            if not t.pause_decided(s):
                raise RuntimeError(not_enabled("pause_window", s))
            if s.count == 0 and s.obs_pause:
                self._apply(t.skip_window)
                return
            if s.count > 0:
                self._apply(t.open_window)
            else:
                self._apply(t.park_for_peer)
                timeout = self._peer_park_timeout
                deadline = None if timeout is None else self._clock() + timeout
                while self._state.count == 0:
                    remaining = None if deadline is None else deadline - self._clock()
                    if remaining is not None and remaining <= 0:
                        raise self._peer_park_expired()
                    self._condition.wait(remaining)
                self._apply(t.join_peer_pause)
            while self._state.paused:
                self._condition.wait()
            self._apply(t.close_window)

    def barrier(self) -> None:
        """P-BARRIER (``Barrier``), this rank's part: the group left the pause window together."""
        self._step(t.barrier, lambda s: s.phase == "barrier")

    def no_pause(self) -> None:
        """P-NO-PAUSE (``NoPause``)."""
        self._step(t.no_pause, lambda s: s.phase == "decided" and s.tp_status < HARD_STOP and not s.tp_pause)

    def start_step(self) -> None:
        """P-START-STEP (``StartStep``): a forward step is about to run.

        Enforces ExclusionInv where the step runs: with a holder inside (which the invariants rule out) it
        records a fatal error and raises instead.
        """
        with self._lock:
            if self._state.inside:
                error = RuntimeError("a forward step was about to start while a holder is inside a pause (R-EXCLUSION)")
                if self.fatal_error is None:
                    self.fatal_error = error
                raise error
        self._step(t.start_step, lambda s: s.phase == "body")

    def end_step(self) -> None:
        """P-END-STEP (``EndStep``)."""
        self._step(t.end_step, lambda s: s.phase == "step")

    def idle(self) -> None:
        """P-IDLE (``Idle``): no work and no stop; go round."""
        self._step(t.idle, lambda s: s.phase == "body" and s.tp_status == DONT_STOP)

    def exit_loop(self) -> None:
        """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or a flush with nothing left."""
        self._step(t.exit_loop, t.may_exit)

    def fail_loop(self, error: BaseException) -> None:
        """P-FAIL-LOOP (``FailLoop``): the loop's thread fails outside a forward step and outside a collective
        (around the pause window, or in a way that ends the thread); record ``error`` (the first fatal error
        wins) and stop.  No further collective: the peers find out by their own collective timeout."""
        with self._lock:
            self._settle_pending(self._state.obs_pause)
            s = self._state
            if not (t.live(s) and s.phase != "window"):
                raise RuntimeError(not_enabled("fail_loop", s))
            if self.fatal_error is None:
                self.fatal_error = error
            self._apply(t.fail_loop)

    def collective_timeout(self, error: BaseException) -> None:
        """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined; record ``error`` and stop."""
        with self._condition:
            s = self._state
            if s.phase not in ("reduce", "barrier"):
                raise RuntimeError(not_enabled("collective_timeout", s))
            if self.fatal_error is None:
                self.fatal_error = error
            self._apply(t.collective_timeout)
