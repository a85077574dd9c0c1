"""The explicit loop API of :class:`~cbpause.RankProtocol`: one method per TLA+ action of the loop.

A loop that reports each step of its iteration calls these, in the order of ``tla/PauseProtocol.tla``
(``observe``, ``all_reduce``, then ``open_window``/``skip_window``/``park_for_peer`` or ``no_pause``, ...,
``barrier``, ``start_step``, ``end_step``).  Each method applies its transition of
:mod:`cbpause.core.transitions` under the protocol's lock if the action's guard holds there (the guard's one home
is the ``can_<action>`` of :mod:`~cbpause.core.transitions`), and otherwise raises ``RuntimeError`` and changes
nothing.  None of them waits, except :meth:`LoopSteps.pause_window`, which is the whole window (open, or park and
join, then close) as a loop that does not step through it calls it.

:class:`LoopSteps` is the rank (:class:`~cbpause.core.rank.RankCore`: the state, its lock, ``_apply``) with the
loop's API and the memos of its hot steps; :class:`~cbpause.core.protocol.RankProtocol` adds the holders' and the
stoppers' API on top.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import transitions as t
from .errors import PeerParkTimeout
from .rank import RankCore
from .transitions import STOPPED, RankState

__all__ = ["HOLDER_CHECK_S", "LoopSteps", "not_enabled", "quiet"]

# A loop parked in its pause window wakes at least this often to look for holders whose thread died without
# leaving (P-RELEASE-DEAD-HOLDER), so that it resumes within this bound of the death (spec section 4.4).
HOLDER_CHECK_S = 0.25


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


class LoopSteps(RankCore):
    """The explicit loop API (see the module's docstring)."""

    def __init__(self, **kwargs: object):
        """Takes :class:`~cbpause.core.rank.RankCore`'s keyword arguments."""
        super().__init__(**kwargs)  # type: ignore[arg-type]
        # Memos of the loop's steps, replayed while the loop cycles through the same states (trace off).
        self._forget_memos()

    def _step(self, fn: Callable[..., RankState], guard: Callable[[RankState], bool]) -> RankState:
        """One loop step, the slow path: ``fn`` if ``guard`` holds (checked under the lock), else ``RuntimeError``
        and no change; remembers the step for the hot path (see :meth:`_remember`)."""
        with self._lock:
            s = self._state
            if not guard(s):
                raise RuntimeError(not_enabled(fn.__name__, s))
            after = self._apply(fn)
            if fn.__name__ in self._MEMO_WIDTHS:
                self._remember(fn.__name__, s, after)
            return after

    def _remember(self, action: str, before: RankState, after: RankState, *args: object) -> None:
        """The memo of the hot path: ``self._memo_<action> = (before, *args, after, *previous)``, the last two steps
        taken, in one tuple (an attribute more per step would cost every attribute read of the object: CPython 3.11
        shares the keys of an instance's dict only up to 30 of them).

        A steady loop takes the same step from the same state object every iteration (transitions are interned, see
        ``protocol._transition``), so each hot method first replays its memo, guard included, with one identity test:
        the state object fixes every field a guard reads. Two memos per step, the last two taken, the one replayed
        first: the iteration after a window takes its steps from other states than a steady one, and with one memo
        each window cost the slow path twice per step, after it and in the next iteration. A step with holders is not
        remembered: it must wake them (``protocol._wakes``). The replay takes the lock with
        ``acquire()`` and ``try``/``finally`` rather than ``with``, which costs twice as much on CPython 3.11, and
        several steps run every iteration; for the same reason the replay is generated into each hot method
        (``scripts/gen_hot_steps.py``, the one place it is written) rather than shared (a helper would add a call to
        every step).  One copy is written by hand: ``pause_window``'s tail replays ``close_window``'s first slot under
        the lock it holds already (the resume's path; ``tests/test_protocol_threads.py`` checks that it replays).
        Between ``acquire()`` and ``try`` a signal handler could raise and leave the lock held; signal
        handlers run only on the main thread, so a loop there gets no memos, and neither does a step that can wake a
        waiter (:func:`quiet`: the replay notifies nobody) or a protocol that records a trace (the replay records
        nothing). ``clear()`` forgets every memo.
        """
        if before.count:
            return  # a step with holders wakes them (protocol._wakes): the memos replay the steady loop's only
        if self._may_remember(before, after):
            last = getattr(self, "_memo_" + action)
            width = len(last) // 2
            setattr(self, "_memo_" + action, (before, *args, after, *last[width * (last[0] is before) :][:width]))

    def _may_remember(self, before: RankState, after: RankState) -> bool:
        """Whether a step from ``before`` to ``after`` may be replayed from a memo (see :meth:`_remember`)."""
        return self._trace is None and quiet(before, after) and threading.get_ident() != threading.main_thread().ident

    def _forget_memos(self) -> None:
        for action, width in self._MEMO_WIDTHS.items():
            setattr(self, "_memo_" + action, (None,) * (2 * width))

    def _forget_loop(self) -> None:
        """Forget the loop's thread and its memos (the caller holds the lock; ``clear()``, before Restart)."""
        self._loop_thread = None
        self._forget_memos()

    def _observe_slow(self) -> tuple[int, int]:
        if self._loop_thread != threading.get_ident():
            with self._lock:
                self._loop_thread = threading.get_ident()  # the thread of the first observe() after clear()
        s = self._step(t.observe, t.can_observe)
        return s.obs_status, s.obs_pause

    def _all_reduce_slow(self, tp_status: int, tp_pause: int, busy: bool) -> None:
        with self._lock:
            s = self._state
            if not t.can_all_reduce(s):
                raise RuntimeError(not_enabled("all_reduce", s))
            if tp_status not in t.STOP_STATUSES or not s.obs_status <= tp_status < STOPPED:
                raise ValueError(f"all-reduced stop status {tp_status!r} is not a MAX including {s.obs_status}")
            if tp_status < s.tp_status:
                raise ValueError(f"all-reduced stop status {tp_status!r} is below the agreed {s.tp_status}")
            if not 0 <= tp_pause <= t.ABORT:
                raise ValueError(f"all-reduced pause request {tp_pause!r} is not a mode (0 to {t.ABORT})")
            if tp_pause < s.obs_pause:
                raise ValueError(f"all-reduced pause request {tp_pause} is below this rank's {s.obs_pause}")
            after = self._apply(t.all_reduce, tp_status, tp_pause, busy)
            self._remember("all_reduce", s, after, tp_status, tp_pause, busy)

    def _start_step_slow(self) -> None:
        with self._lock:
            if self._state.inside:
                error = RuntimeError("a forward step was about to start while a holder is inside a pause (R-EXCLUSION)")
                if self.fatal_error is None:
                    self.fatal_error = error
                raise error
        self._step(t.start_step, t.can_start_step)

    def open_window(self) -> None:
        """P-OPEN-WINDOW (``OpenWindow``): a local holder is pending; open the window (does not wait)."""
        self._step(t.open_window, t.can_open_window)

    def drain_first(self) -> None:
        """P-DRAIN-FIRST (``DrainFirst``): the group decided to drain and the batch had work (``all_reduce(...,
        busy=True)``): no window this iteration; the loop steps the batch, admitting no new request
        (``state.draining``), and asks again.  A drain never parks, so this is where the loop releases the holds of
        holders whose thread died waiting for it (P-RELEASE-DEAD-HOLDER; issue 26, point 4): once per drain step,
        a scan of the holds (none inside, the window being closed)."""
        self._step(t.drain_first, t.can_drain_first)
        if self._holds:
            with self._lock:
                self._release_dead_holders()

    def skip_window(self) -> None:
        """P-SKIP-WINDOW (``SkipWindow``): this rank asked, every local request was withdrawn (D1)."""
        self._step(t.skip_window, t.can_skip_window)

    def park_for_peer(self) -> None:
        """P-PARK-FOR-PEER (``ParkForPeer``): a peer asked, no local holder is pending (does not wait)."""
        self._step(t.park_for_peer, t.can_park_for_peer)

    def join_peer_pause(self) -> None:
        """P-JOIN-PEER-PAUSE (``JoinPeerPause``): the local holder came; open the window."""
        self._step(t.join_peer_pause, t.can_join_peer_pause)

    def peer_park_timeout(self) -> PeerParkTimeout:
        """P-PEER-PARK-TIMEOUT (``PeerParkTimeout``): no local holder came; record the error and stop
        (P-FAIL-LOOP).  Returns the :class:`~cbpause.PeerParkTimeout` it recorded, for the loop to raise."""
        with self._lock:
            s = self._state
            if not t.can_peer_park_timeout(s):
                raise RuntimeError(not_enabled("peer_park_timeout", s))
            return self._peer_park_expired()

    def _peer_park_expired(self) -> PeerParkTimeout:
        """P-PEER-PARK-TIMEOUT (the caller holds the lock and checked the guard)."""
        s = self._state
        why = "no local holder came"
        if s.count:  # holders came, each asking for a stronger mode than the group's window (R-MODES)
            why = (f"the local holder asked for mode {t.MODE_NAMES[t.asked(s)]!r}, stronger than the group's "
                   f"{t.MODE_NAMES[s.tp_pause]!r} window (under tensor parallelism every rank must ask the same mode)")
        error = PeerParkTimeout(
            f"parked for a peer's pause, and {why} within {self._peer_park_timeout} s:"
            " under tensor parallelism every rank must pause (spec P-PEER-PARK-TIMEOUT)"
        )
        if self.fatal_error is None:
            self.fatal_error = error
        self._apply(t.peer_park_timeout)
        return error

    def _close_window_slow(self, barrier: bool) -> None:
        with self._lock:
            s = self._state
            if not t.can_close_window(s):
                raise RuntimeError(not_enabled("close_window", s))
            after = self._apply(t.close_window)
            if barrier:  # the pair only: a memo of CloseWindow alone would not wake the waiters of its phase, barrier
                after = self._apply(t.barrier)
                self._remember("close_window", s, after, barrier)

    def pause_window(self, barrier: bool = False) -> None:
        """The pause window after a pause decision: P-OPEN-WINDOW, P-SKIP-WINDOW or P-PARK-FOR-PEER, then
        P-JOIN-PEER-PAUSE or P-PEER-PARK-TIMEOUT, and P-CLOSE-WINDOW.  Returns at the barrier; with ``barrier``,
        past it: P-BARRIER too, under the same lock, for a loop that has no peers to meet there (nothing it does
        between the two steps can fail, and no other thread sees the phase between them).

        Blocks while a holder is inside; releases the holds of holders whose thread died (P-RELEASE-DEAD-HOLDER),
        within ``HOLDER_CHECK_S`` seconds of the death.  Raises :class:`~cbpause.PeerParkTimeout` (the fatal error is
        recorded and the loop is stopped, P-FAIL-LOOP) when parked for a peer's pause with no local holder
        within ``peer_park_timeout`` seconds.  Raises ``RuntimeError`` and changes nothing where none of the three
        is enabled: no pause decided, or a drain decided (the loop steps its batch first: :meth:`drain_first`).
        """
        with self._lock:
            s = self._state
            # The common case first (every line here costs a microsecond or more, the loop's caches being cold after
            # the forward step): a decided pause with a pending holder opens.  Each branch is its action's guard.
            if t.can_open_window(s):
                self._apply(t.open_window)
            elif t.can_skip_window(s):
                self._apply(t.skip_window)
                if barrier:
                    self._apply(t.barrier)
                return
            elif t.can_park_for_peer(s):
                self._apply(t.park_for_peer)
                timeout = self._peer_park_timeout
                deadline = None if timeout is None else self._clock() + timeout
                while not t.can_join_peer_pause(self._state):
                    remaining = None if deadline is None else deadline - self._clock()
                    if remaining is not None and remaining <= 0:
                        raise self._peer_park_expired()
                    self._condition.wait(remaining)
                self._apply(t.join_peer_pause)
            else:
                raise RuntimeError(not_enabled("pause_window", s))
            # Parked: wake at least every HOLDER_CHECK_S to release the holds of holders whose thread died
            # (P-RELEASE-DEAD-HOLDER; the fairness of ReleaseDeadHolder in the spec rests on this loop).  The first
            # look comes before the first wait, so that no hold of a thread that died is entered from another thread.
            # (No hold, nothing to look at: the wake-up at the last holder's exit, the resume's path, skips the call.)
            while True:
                if self._holds:
                    self._release_dead_holders()
                if not self._state.paused:
                    break
                if self._state.waiting:  # a notification an interrupt cut short (SafeCondition.notify_all) is renewed
                    self._condition.notify_all()
                self._condition.wait(HOLDER_CHECK_S)
            if not barrier:
                self._apply(t.close_window)
                return
            # The resume's path (issue 38): a steady window's close and barrier replay close_window's memo (the
            # generated hot step's, its first slot) under this acquisition of the lock; anything else takes that step.
            memo = self._memo_close_window
            if memo[0] is self._state and memo[1]:
                self._state = memo[2]
                return
        self.close_window(barrier=True)

    def release_dead_holders(self) -> int:
        """P-RELEASE-DEAD-HOLDER (``ReleaseDeadHolder``): release the hold of every holder whose thread ended while
        it waited or was inside, without leaving (P-HOLDER-DIES), logging an error that names the thread; returns
        how many.  Enabled while the loop is parked in its window (``pause_window`` does it there at least every
        ``HOLDER_CHECK_S`` seconds: a loop that steps through its window itself must do the same), while it drains
        (``drain_first`` does it at each drain step) and on a stopped loop (``clear()`` does it first)."""
        with self._lock:
            s = self._state
            if not t.dead_holder_releasable(s):
                raise RuntimeError(not_enabled("release_dead_holders", s))
            return self._release_dead_holders()

    def exit_loop(self) -> None:
        """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or a flush with nothing left."""
        self._step(t.exit_loop, t.may_exit)

    def fail_loop(self, error: BaseException) -> None:
        """P-FAIL-LOOP (``FailLoop``): the loop's thread fails outside a forward step and outside a collective
        (around the pause window, or in a way that ends the thread); record ``error`` (the first fatal error
        wins) and stop.  No further collective: the peers find out by their own collective timeout."""
        with self._lock:
            s = self._state
            if not t.can_fail_loop(s):
                raise RuntimeError(not_enabled("fail_loop", s))
            if self.fatal_error is None:
                self.fatal_error = error
            self._apply(t.fail_loop)

    def record_fatal_error(self, error: BaseException) -> None:
        """P-RECORD-FATAL-ERROR (``RecordFatalError``): an exception in the loop's own code between two iterations'
        collectives (``read``, ``body``, ``step``: the forward step, preparing the batch); record ``error`` (the first
        fatal error wins), hard-stop, and go to the group's next all-reduce, which tells the peers (``observe()`` is
        not called again: the rank sends HARD_STOP).  Waiting holders raise with the error as ``__cause__``.

        Where the rank has failed or stopped already, or is parked in its window, no step is enabled: ``error`` is
        kept if none was (the first wins) and nothing else changes (the loop's exit path then takes the step the
        spec has there: ``fail_loop``, ``exit_loop``).  Raises ``RuntimeError`` and changes nothing in the other
        phases (``reduce``, ``decided``, ``peer``, ``barrier``: a failure there is a collective's, or the window's:
        :meth:`collective_timeout`, :meth:`fail_loop`)."""
        with self._lock:
            s = self._state
            if t.can_record_fatal_error(s):
                if self.fatal_error is None:
                    self.fatal_error = error
                self._apply(t.record_fatal_error)
            elif s.fatal or s.phase in ("stopped", "dead", "window"):
                if self.fatal_error is None:
                    self.fatal_error = error
                self._condition.notify_all()
            else:
                raise RuntimeError(not_enabled("record_fatal_error", s))

    def collective_timeout(self, error: BaseException) -> None:
        """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined the all-reduce, the barrier or (at
        ``body``, which the caller knows has a payload in hand) the payload broadcast; record ``error`` and stop."""
        with self._lock:
            s = self._state
            if not t.can_collective_timeout(s):
                raise RuntimeError(not_enabled("collective_timeout", s))
            if self.fatal_error is None:
                self.fatal_error = error
            self._apply(t.collective_timeout)

    # ---- generated by scripts/gen_hot_steps.py: do not edit (tests/test_generated.py checks it) ----
    # The hot steps, and the width of one memo of each: (before, *keys, after).
    _MEMO_WIDTHS = {
        "observe": 2,
        "all_reduce": 5,
        "no_pause": 2,
        "close_window": 3,
        "barrier": 2,
        "start_step": 2,
        "end_step": 2,
        "idle": 2,
    }

    def observe(self) -> tuple[int, int]:
        """P-OBSERVE (``Observe``): what this rank sends to the all-reduce: (stop status, pause request), the request
        being the strongest mode this rank's holders asked for (``transitions.KEEP`` ... ``ABORT``), 0 for none."""
        memo, lock = self._memo_observe, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = s = memo[1]
                return s.obs_status, s.obs_pause
            if memo[2] is self._state:  # the other of the last two
                self._state = s = memo[3]
                self._memo_observe = (*memo[2:], *memo[:2])
                return s.obs_status, s.obs_pause
        finally:
            lock.release()
        return self._observe_slow()

    def all_reduce(self, tp_status: int, tp_pause: int, busy: bool = False) -> None:
        """P-ALL-REDUCE (``AllReduce``): the group's MAX of stop statuses and pause requests (modes; a ``bool`` is
        read as 0 or KEEP).  ``busy``: this rank's batch has requests in flight, so that a DRAIN decision drains
        first (``state.draining``; :meth:`drain_first`).

        Raises ``ValueError`` if the result cannot be a MAX that includes this rank's contribution."""
        tp_pause = int(tp_pause)
        busy = bool(busy) and tp_pause == t.DRAIN
        memo, lock = self._memo_all_reduce, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state and memo[1] == tp_status and memo[2] == tp_pause and memo[3] == busy:
                self._state = memo[4]
                return
            if (
                memo[5] is self._state and memo[6] == tp_status and memo[7] == tp_pause and memo[8] == busy
            ):  # the other of the last two
                self._state = memo[9]
                self._memo_all_reduce = (*memo[5:], *memo[:5])
                return
        finally:
            lock.release()
        self._all_reduce_slow(tp_status, tp_pause, busy)

    def no_pause(self) -> None:
        """P-NO-PAUSE (``NoPause``)."""
        memo, lock = self._memo_no_pause, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = memo[1]
                return
            if memo[2] is self._state:  # the other of the last two
                self._state = memo[3]
                self._memo_no_pause = (*memo[2:], *memo[:2])
                return
        finally:
            lock.release()
        self._step(t.no_pause, t.can_no_pause)

    def close_window(self, barrier: bool = False) -> None:
        """P-CLOSE-WINDOW (``CloseWindow``): the last holder left; go to the barrier.  With
        ``barrier``, P-BARRIER too, under the same lock, for a loop that has no peers to meet there (no other thread
        sees the phase between the two: only the pair is remembered, ``_close_window_slow``)."""
        barrier = bool(barrier)
        memo, lock = self._memo_close_window, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state and memo[1] == barrier:
                self._state = memo[2]
                return
            if memo[3] is self._state and memo[4] == barrier:  # the other of the last two
                self._state = memo[5]
                self._memo_close_window = (*memo[3:], *memo[:3])
                return
        finally:
            lock.release()
        self._close_window_slow(barrier)

    def barrier(self) -> None:
        """P-BARRIER (``Barrier``), this rank's part: the group left the pause window together."""
        memo, lock = self._memo_barrier, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = memo[1]
                return
            if memo[2] is self._state:  # the other of the last two
                self._state = memo[3]
                self._memo_barrier = (*memo[2:], *memo[:2])
                return
        finally:
            lock.release()
        self._step(t.barrier, t.can_barrier)

    def start_step(self) -> None:
        """P-START-STEP (``StartStep``): a forward step is about to run.

        Enforces ExclusionInv where the step runs: with a holder inside (which the invariants rule out) it
        records a fatal error and raises instead.  (A memo starts from a state the step was taken from, so one
        with no holder inside.)"""
        memo, lock = self._memo_start_step, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = memo[1]
                return
            if memo[2] is self._state:  # the other of the last two
                self._state = memo[3]
                self._memo_start_step = (*memo[2:], *memo[:2])
                return
        finally:
            lock.release()
        self._start_step_slow()

    def end_step(self) -> None:
        """P-END-STEP (``EndStep``)."""
        memo, lock = self._memo_end_step, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = memo[1]
                return
            if memo[2] is self._state:  # the other of the last two
                self._state = memo[3]
                self._memo_end_step = (*memo[2:], *memo[:2])
                return
        finally:
            lock.release()
        self._step(t.end_step, t.can_end_step)

    def idle(self) -> None:
        """P-IDLE (``Idle``): no work and no stop; go round."""
        memo, lock = self._memo_idle, self._lock
        lock.acquire()
        try:
            if memo[0] is self._state:
                self._state = memo[1]
                return
            if memo[2] is self._state:  # the other of the last two
                self._state = memo[3]
                self._memo_idle = (*memo[2:], *memo[:2])
                return
        finally:
            lock.release()
        self._step(t.idle, t.can_idle)

    # ---- end of the generated hot steps ----
