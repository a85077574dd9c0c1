"""``PauseProtocol``: one rank's side of the protocol, thread-safe, standard library only.

Every state change is a pure function of :mod:`cbpause.transitions` (one per
TLA+ action of ``tla/PauseProtocol.tla``) applied under ``self._condition``;
this module adds what pure functions cannot: waiting, threads, errors and
clocks.  Invariants kept by every method, under the lock (the per-rank parts
of the TLA+ invariants, :func:`cbpause.transitions.rank_invariant`):

* ``CountsInv``: ``count == waiting + inside >= 0``; an open window has a holder.
* ``SameWindowInv``: a holder is inside only while ``phase == "window"`` and
  ``paused``.
* ``MonotoneStopInv``: ``stop`` and ``tp_stop`` only grow, except in ``clear()``.

Two APIs drive the loop side:

* the drop-in API of transformers 5.23's ``BackgroundThreadStatus``
  (``is_pause_requested``, ``update_with_tp_status``, ``pause_and_wait``,
  ``mark_as_stopped``, ...), with which transformers' own
  ``ContinuousBatchingManager`` works unchanged;
* the explicit API (``observe``, ``all_reduce``, ``pause_window``,
  ``barrier``, ``start_step``, ...), in which the loop reports each step of
  its iteration, as the TLA+ loop does.

Waiting holders are woken by ``notify_all`` on every change that can enable
them, which is the strong fairness the spec assumes for ``EnterPause``.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import transitions as t
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED, RankState

if TYPE_CHECKING:
    from .traces import TraceRecorder

__all__ = ["PauseMetrics", "PauseProtocol", "PeerPauseTimeout"]

# CPython loses a SIGINT that lands after the main thread released the GIL to block on a lock and before
# the block starts: the handler runs only when the thread wakes.  A holder waiting on the main thread
# therefore wakes at least this often, so Ctrl-C reaches it within this bound (P-INTERRUPT).
MAIN_THREAD_WAKE_S = 0.1


class PeerPauseTimeout(RuntimeError):
    """A rank was parked for a peer's pause and no local holder came in time (P-PEER-PARK-TIMEOUT)."""


@dataclass(frozen=True)
class PauseMetrics:
    """A read-only snapshot of :meth:`PauseProtocol.metrics`."""

    pauses_taken: int
    """Holders that entered a pause since construction."""
    holders_inside: int
    requests_waiting: int
    windows_opened: int
    total_paused_s: float
    """Time the window was open, summed over closed windows."""
    last_paused_s: float | None
    """How long the last closed window was open."""
    last_entry_latency_s: float | None
    """From the request to the entry of the last holder that entered."""


def _check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{name} must be a number of seconds or None, not {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{name} must be >= 0 seconds or None, not {timeout!r}")
    return float(timeout)


class PauseProtocol:
    """Pause, stop and fatal-error protocol of one rank's continuous-batching loop.

    A drop-in for transformers 5.23's ``BackgroundThreadStatus`` (same constants, methods and
    ``fatal_error`` attribute), which fixes its defects: a withdrawn request never parks the loop (D1),
    a stray ``release_pause()`` raises and changes nothing (D2), a rank parked for a peer's pause leaves
    after ``peer_park_timeout`` seconds with :class:`PeerPauseTimeout` (D3), and ``acquire_pause()`` from
    the loop's own thread raises (D4).

    Args:
        peer_park_timeout: how long a rank parked for a peer's pause waits for its local holder before
            failing (spec section 5).  ``None`` waits for ever, as upstream does.
        clock: a monotonic clock, for the metrics and the timeouts (tests may pass a fake).
    """

    DONT_STOP = DONT_STOP
    FLUSH_AND_STOP = FLUSH_AND_STOP
    HARD_STOP = HARD_STOP
    STOPPED = STOPPED

    def __init__(
        self,
        *,
        peer_park_timeout: float | None = 300.0,
        clock: Callable[[], float] = time.monotonic,
        trace: TraceRecorder | None = None,
    ):
        self.peer_park_timeout = _check_timeout(peer_park_timeout, "peer_park_timeout")
        # Opt-in trace recording (cbpause.traces); None costs one attribute test per transition.
        self._trace = trace
        self.trace_rank = trace.attach(self) if trace is not None else 0
        self.fatal_error: BaseException | None = None
        self._clock = clock
        # A plain (non-reentrant) lock: no method re-enters it, and `with self._lock` is cheaper than going
        # through the Condition on the loop's hot path.
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)
        self._state = RankState()
        self._local = threading.local()
        self._loop_thread: int | None = None
        self._observe_memo: tuple[RankState | None, RankState | None] = (None, None)
        self._reduce_memo: tuple[RankState | None, int, RankState | None] = (None, -1, None)
        # metrics
        self._pauses_taken = 0
        self._windows_opened = 0
        self._window_opened_at: float | None = None
        self._total_paused = 0.0
        self._last_paused: float | None = None
        self._last_entry_latency: float | None = None

    # ------------------------------------------------------------------------------------------- inspection

    @property
    def state(self) -> RankState:
        """The current :class:`~cbpause.transitions.RankState` (an immutable snapshot)."""
        return self._state

    @property
    def local_status(self) -> int:
        """The locally requested stop status, possibly ahead of the value agreed by the TP group."""
        return self._state.stop

    @property
    def tp_status(self) -> int:
        """The stop status last agreed by the TP group through its MAX all-reduce."""
        return self._state.tp_stop

    def can_accept_new_requests(self) -> str | None:
        """Why the loop cannot accept new requests, or None if it can (upstream's contract)."""
        if self.fatal_error is not None or self._state.fatal:
            return "The background thread died with a fatal error."
        if self._state.stop != DONT_STOP:
            return "The background thread is stopping."
        return None

    def metrics(self) -> PauseMetrics:
        """A consistent snapshot of the pause metrics."""
        with self._condition:
            s = self._state
            return PauseMetrics(
                pauses_taken=self._pauses_taken,
                holders_inside=s.inside,
                requests_waiting=s.waiting,
                windows_opened=self._windows_opened,
                total_paused_s=self._total_paused,
                last_paused_s=self._last_paused,
                last_entry_latency_s=self._last_entry_latency,
            )

    # ------------------------------------------------------------------------------------------- internals

    def _apply(self, fn: Callable[..., RankState], *args: object) -> RankState:
        """Apply one transition under the lock (the caller holds it) and wake the waiters it may enable."""
        before = self._state
        after = fn(before, *args)
        self._state = after
        if self._trace is not None:
            self._trace.record(self.trace_rank, fn.__name__, args, before, after)
        now = None
        if after.paused and not before.paused:
            now = self._clock()
            self._window_opened_at = now
            self._windows_opened += 1
        elif before.paused and not after.paused and self._window_opened_at is not None:
            now = self._clock()
            self._last_paused = now - self._window_opened_at
            self._total_paused += self._last_paused
            self._window_opened_at = None
        # Wake the waiters only when this step can enable one of them (holders wait for an open window or a
        # stopped loop; the loop waits for its last holder to leave, or, parked for a peer, for a request).
        # EnterPause enables nobody, nor does RequestPause unless the loop is parked for a peer: with many
        # holders, waking them all on each of these made every pause O(holders) wake-ups.
        if fn is t.enter_pause or (fn is t.request_pause and before.phase != "peer"):
            return after
        self._condition.notify_all()
        return after

    def _holds(self) -> threading.local:
        local = self._local
        if not hasattr(local, "requested"):
            local.requested = 0
            local.inside = 0
        return local

    def _require(self, ok: bool, action: str) -> None:
        if not ok:
            raise RuntimeError(f"{action} is not enabled in loop phase {self._state.phase!r} ({self._state})")

    def _bind_loop(self) -> None:
        me = threading.get_ident()
        if self._loop_thread is None:
            self._loop_thread = me

    def bind_loop_thread(self) -> None:
        """Declare the calling thread the generation loop's, until the next ``clear()``.

        A loop that calls this first needs no inference from ``is_pause_requested()`` (see there); D4's
        check (``acquire_pause()`` from the loop's own thread raises) then holds from the first iteration.
        """
        with self._lock:
            self._loop_thread = threading.get_ident()

    def _is_loop_thread(self) -> bool:
        return self._loop_thread is not None and self._loop_thread == threading.get_ident()

    # ------------------------------------------------------------------------------------------- stopping

    def clear(self) -> None:
        """P-RESTART (``Restart``): clear the statuses before (re)starting the loop.

        Raises ``RuntimeError`` and changes nothing while a holder waits or is inside, or while the loop
        runs (spec section 5).
        """
        with self._condition:
            s = self._state
            if s.count:
                raise RuntimeError(
                    f"clear() while {s.waiting} holder(s) wait for a pause and {s.inside} are inside: "
                    "let them leave first"
                )
            if s.phase not in ("new", "stopped"):
                raise RuntimeError(f"clear() while the generation loop runs (phase {s.phase!r}): stop it first")
            self.fatal_error = None
            self._loop_thread = None
            self._apply(t.restart)

    def request_stop(self, status: int, global_rank: int = 0) -> None:
        """P-REQUEST-STOP (``RequestStop``): ask the loop to stop; effective at the next all-reduce.

        Keeps MonotoneStopInv: asking for a status at or below the current one changes nothing.
        """
        if status not in (FLUSH_AND_STOP, HARD_STOP) or isinstance(status, bool):
            raise ValueError(f"Invalid stop status {status!r} from rank {global_rank}")
        with self._condition:
            s = self._state
            if t.is_live(s) and s.stop < status:
                self._apply(t.request_stop, status)
            elif s.phase == "new" and s.stop < status:
                # Upstream records a stop asked before the loop started; so do we.
                self._state = RankState(phase="new", stop=status)

    def record_fatal_error(self, error: BaseException) -> None:
        """Record the loop's fatal error (the first one wins); waiting holders raise with it as ``__cause__``.

        Part of P-FATAL-ERROR (``FatalError``) when the loop reports it from a forward step.
        """
        with self._condition:
            if self.fatal_error is None:
                self.fatal_error = error
            s = self._state
            if s.phase == "step":
                self._apply(t.fatal_error)
            elif not s.fatal:
                self._state = _with_fatal(s)
                self._condition.notify_all()
            else:
                self._condition.notify_all()

    def mark_as_stopped(self) -> None:
        """The loop has exited (P-EXIT-LOOP's end, or after P-FAIL-LOOP); called on every exit path."""
        with self._condition:
            s = self._state
            if s.phase != "stopped" and s.inside == 0:
                self._state = _stopped(s)
            self._condition.notify_all()

    def update_with_tp_status(self, tp_status: int) -> None:
        """Drop-in part of P-ALL-REDUCE: take the stop status the TP group agreed on.

        Raises ``ValueError`` if the group status goes down (MonotoneStopInv) or is unknown.
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
        with self._lock:
            # Only the loop calls this: it settles which thread is the loop's, should another thread's
            # is_pause_requested() have come first.
            self._loop_thread = threading.get_ident()
            s = self._state
            if tp_status < s.tp_stop:
                raise ValueError(f"TP communicated a lower stop status: tp_status = {tp_status}, {s.tp_stop = }")
            if s.phase == "reduce" and s.obs_stop <= tp_status:
                # AllReduce enables no waiter: stop grows at most to HARD_STOP and no window opens.
                memo = self._reduce_memo
                if s is memo[0] and tp_status == memo[1]:
                    self._state = memo[2]
                else:
                    out = self._state = _all_reduce(s, tp_status, False)
                    self._reduce_memo = (s, tp_status, out)
            elif tp_status > s.tp_stop:
                self._state = _take_tp_status(s, tp_status)

    # ------------------------------------------------------------------------------------------- holders

    def acquire_pause(self, wake_up_loop: threading.Event | None = None, timeout: float | None = None) -> None:
        """P-REQUEST-PAUSE, then wait for P-ENTER-PAUSE, P-PAUSE-FAILS, P-INTERRUPT or P-PAUSE-TIMEOUT.

        Returns once this thread is inside the pause.  Raises ``RuntimeError`` at once from the loop's own
        thread (D4) or when the loop is not running, is hard-stopping or has failed (chaining the fatal
        error); ``RuntimeError`` if the loop stops before the window opens; ``TimeoutError`` after
        ``timeout`` seconds.  On any of these, and on an interrupt while waiting, the request is withdrawn
        before the exception propagates (CountsInv).  On the main thread the wait wakes every
        ``MAIN_THREAD_WAKE_S`` seconds, so that a SIGINT CPython left pending still interrupts it.
        """
        timeout = _check_timeout(timeout)
        if self._is_loop_thread():
            raise RuntimeError(
                "pause() called from the generation loop's own thread (a callback or logits processor): "
                "the loop would wait for itself"
            )
        local = self._holds()
        with self._condition:
            before = self._state
            if not t.can_request_pause(before):
                raise RuntimeError(_refusal(before)) from self.fatal_error
            requested_at = self._clock()
            deadline = None if timeout is None else requested_at + timeout
            on_main = threading.current_thread() is threading.main_thread()
            settled = False
            try:
                # Until the first wait() nobody else can change the state (we hold the lock), so an interrupt
                # that lands anywhere in here is withdrawn exactly when the request went in.
                self._apply(t.request_pause)
                local.requested += 1
                if wake_up_loop is not None:
                    wake_up_loop.set()
                while True:
                    s = self._state
                    if s.paused:
                        self._apply(t.enter_pause)
                        settled = True
                        local.inside += 1
                        self._pauses_taken += 1
                        self._last_entry_latency = self._clock() - requested_at
                        return
                    if s.stop == STOPPED or s.fatal:
                        self._apply(t.pause_fails)
                        settled = True
                        local.requested -= 1
                        raise RuntimeError("The generation loop stopped before it could pause.") from self.fatal_error
                    remaining = None if deadline is None else deadline - self._clock()
                    if remaining is not None and remaining <= 0:
                        self._apply(t.pause_timeout)
                        settled = True
                        local.requested -= 1
                        raise TimeoutError(f"the generation loop did not pause within {timeout} s")
                    if on_main:
                        remaining = MAIN_THREAD_WAKE_S if remaining is None else min(remaining, MAIN_THREAD_WAKE_S)
                    self._condition.wait(remaining)
            except BaseException:
                if not settled and self._state is not before:
                    # P-INTERRUPT: withdraw before the interrupt propagates (the D1 set-up).
                    self._apply(t.interrupt)
                    local.requested = max(0, local.requested - 1)
                raise

    def release_pause(self) -> None:
        """P-LEAVE-PAUSE (``LeavePause``): leave the pause; the last holder out lets the loop resume.

        Raises ``RuntimeError`` and changes nothing if this thread holds no pause (D2, CountsInv).
        """
        local = self._holds()
        with self._condition:
            if local.inside <= 0:
                raise RuntimeError(
                    "release_pause() without a matching acquire_pause() on this thread: nothing was changed"
                )
            self._apply(t.leave_pause)
            local.inside -= 1
            local.requested -= 1

    def is_pause_requested(self, local: bool = False) -> bool:
        """Whether a pause is requested and not released yet.

        With ``local=True``: by the calling thread (it waits for or holds a pause).  Otherwise, called by
        the loop before its all-reduce, it is P-OBSERVE (``Observe``): the answer is recorded, so that the
        protocol knows later whether a pause window was asked for locally (D1).  The first thread to call
        it after ``clear()`` is taken to be the loop's thread until ``update_with_tp_status()``, which only
        the loop calls, settles it.
        """
        if local:
            return self._holds().requested > 0
        me = threading.get_ident()
        with self._lock:
            loop = self._loop_thread
            if loop is None:
                self._loop_thread = loop = me
            s = self._state
            if loop != me or s.phase not in _OBSERVE_FROM:
                return s.count > 0
            # Observe enables no waiter (it neither opens a window nor stops the loop): no notify.  In a
            # steady loop the states cycle through the same memoised objects: remember the last one.
            if s is self._observe_memo[0]:
                s = self._state = self._observe_memo[1]
            else:
                out = self._state = _observe(s)
                self._observe_memo = (s, out)
                s = out
            return s.obs_pause

    def pause_and_wait(self) -> None:
        """Drop-in pause window: the group decided to pause; park as the spec says, then return.

        P-OPEN-WINDOW if a local holder is pending, and return when the last one leaves (P-CLOSE-WINDOW);
        P-SKIP-WINDOW if this rank's own request was withdrawn (D1: return at once); otherwise
        P-PARK-FOR-PEER: wait for the local holder for at most ``peer_park_timeout`` seconds, then
        raise :class:`PeerPauseTimeout` (P-PEER-PARK-TIMEOUT, D3).
        """
        with self._condition:
            self._bind_loop()
            s = self._state
            if s.phase != "decided":
                s = self._state = _decided(s)
            self._state = _with_tp_pause(s)
        self.pause_window()

    # ------------------------------------------------------------------------------------ explicit loop API

    def observe(self) -> tuple[int, bool]:
        """P-OBSERVE (``Observe``): what this rank sends to the all-reduce: (stop status, pause requested)."""
        with self._condition:
            self._loop_thread = threading.get_ident()
            self._require(self._state.phase == "read", "Observe")
            s = self._apply(t.observe)
            return s.obs_stop, s.obs_pause

    def all_reduce(self, tp_stop: int, tp_pause: bool) -> None:
        """P-ALL-REDUCE (``AllReduce``): the group's MAX of stop statuses and pause requests.

        Raises ``ValueError`` if the result cannot be a MAX that includes this rank's contribution.
        """
        with self._condition:
            s = self._state
            self._require(s.phase == "reduce", "AllReduce")
            if tp_stop not in t.STOP_STATUSES or not (s.obs_stop <= tp_stop < STOPPED) or tp_stop < s.tp_stop:
                raise ValueError(f"all-reduced stop status {tp_stop!r} is not a MAX including {s.obs_stop}")
            if s.obs_pause and not tp_pause:
                raise ValueError("all-reduced pause flag is False although this rank asked for a pause")
            self._apply(t.all_reduce, tp_stop, bool(tp_pause))

    def pause_window(self) -> None:
        """The pause window after a pause decision: P-OPEN-WINDOW, P-SKIP-WINDOW or P-PARK-FOR-PEER, then
        P-JOIN-PEER-PAUSE or P-PEER-PARK-TIMEOUT, and P-CLOSE-WINDOW.  Returns at the barrier.

        Blocks while a holder is inside.  Raises :class:`PeerPauseTimeout` (the fatal error is recorded and
        the loop is stopped, P-FAIL-LOOP) when parked for a peer's pause with no local holder in time.
        """
        with self._condition:
            s = self._state
            self._require(t.pause_decided(s), "the pause window")
            if s.count > 0:
                self._apply(t.open_window)
            elif s.obs_pause:
                self._apply(t.skip_window)
                return
            else:
                self._apply(t.park_for_peer)
                deadline = None if self.peer_park_timeout is None else self._clock() + self.peer_park_timeout
                while self._state.count == 0:
                    remaining = None if deadline is None else deadline - self._clock()
                    if remaining is not None and remaining <= 0:
                        error = PeerPauseTimeout(
                            f"parked for a peer's pause, and no local holder came within {self.peer_park_timeout} s:"
                            " under tensor parallelism every rank must pause (spec P-PEER-PARK-TIMEOUT)"
                        )
                        if self.fatal_error is None:
                            self.fatal_error = error
                        self._apply(t.peer_park_timeout)
                        raise error
                    self._condition.wait(remaining)
                self._apply(t.join_peer_pause)
            while self._state.paused:
                self._condition.wait()
            self._apply(t.close_window)

    def barrier(self) -> None:
        """P-BARRIER (``Barrier``), this rank's part: the group left the pause window together."""
        with self._condition:
            self._require(self._state.phase == "barrier", "Barrier")
            self._apply(t.barrier)

    def no_pause(self) -> None:
        """P-NO-PAUSE (``NoPause``)."""
        with self._condition:
            s = self._state
            self._require(s.phase == "decided" and s.tp_stop < HARD_STOP and not s.tp_pause, "NoPause")
            self._apply(t.no_pause)

    def start_step(self) -> None:
        """P-START-STEP (``StartStep``).  Keeps ExclusionInv (no holder can be inside here)."""
        with self._condition:
            self._require(self._state.phase == "body", "StartStep")
            self._apply(t.start_step)

    def end_step(self) -> None:
        """P-END-STEP (``EndStep``)."""
        with self._condition:
            self._require(self._state.phase == "step", "EndStep")
            self._apply(t.end_step)

    def idle(self) -> None:
        """P-IDLE (``Idle``): no work and no stop; go round."""
        with self._condition:
            s = self._state
            self._require(s.phase == "body" and s.tp_stop == DONT_STOP, "Idle")
            self._apply(t.idle)

    def exit_loop(self) -> None:
        """P-EXIT-LOOP (``ExitLoop``): hard stop before any window, or a flush with nothing left."""
        with self._condition:
            s = self._state
            ok = (s.phase == "decided" and s.tp_stop == HARD_STOP) or (
                s.phase == "body" and s.tp_stop == FLUSH_AND_STOP
            )
            self._require(ok, "ExitLoop")
            self._apply(t.exit_loop)

    def collective_timeout(self, error: BaseException) -> None:
        """P-COLLECTIVE-TIMEOUT (``CollectiveTimeout``): a peer never joined; record ``error`` and stop."""
        with self._condition:
            self._require(self._state.phase in ("reduce", "barrier"), "CollectiveTimeout")
            if self.fatal_error is None:
                self.fatal_error = error
            self._apply(t.collective_timeout)


# ------------------------------------------------------------------------------------------------ hot paths
# The loop calls these every iteration.  The transitions are pure functions of a small hashable state, so
# their results are memoised: the per-iteration cost is a lock and a cache hit (see docs/performance.md).

_OBSERVE_FROM = frozenset({"read", "reduce", "decided", "barrier", "body", "step"})


@functools.lru_cache(maxsize=4096)
def _observe(s: RankState) -> RankState:
    # The drop-in loop does not report the end of its iteration: this call starts the next one.
    return t.observe(s if s.phase == "read" else s._replace(phase="read"))


_all_reduce = functools.lru_cache(maxsize=4096)(t.all_reduce)


# ------------------------------------------------------------------------------ lenient drop-in adjustments
# transformers' loop does not report every step of its iteration; these bring the state to where the spec
# says the loop is when the next drop-in call arrives.  They keep every inv: of RankState.


def _with_fatal(s: RankState) -> RankState:
    return s._replace(fatal=True)


def _stopped(s: RankState) -> RankState:
    return s._replace(phase="stopped", stop=STOPPED, paused=False)


def _take_tp_status(s: RankState, tp_status: int) -> RankState:
    phase = "decided" if s.phase in ("read", "barrier", "body", "step") else s.phase
    return s._replace(phase=phase, tp_stop=tp_status, stop=max(s.stop, tp_status))


def _at_read(s: RankState) -> RankState:
    return s._replace(phase="read")


def _decided(s: RankState) -> RankState:
    return s._replace(phase="decided")


def _with_tp_pause(s: RankState) -> RankState:
    return s._replace(tp_pause=True)


def _refusal(s: RankState) -> str:
    if s.phase == "new":
        return "Cannot pause: the generation loop was never started."
    if s.fatal:
        return "Cannot pause: the generation loop died with a fatal error."
    if s.phase in ("stopped", "dead"):
        return "Cannot pause: the generation loop has stopped."
    return "Cannot pause: the generation loop is hard-stopping."
