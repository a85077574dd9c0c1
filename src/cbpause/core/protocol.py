"""``RankProtocol``: one rank's side of the protocol, thread-safe, standard library only.

Every state change is a pure function of :mod:`cbpause.core.transitions` (one per TLA+ action of
``tla/PauseProtocol.tla``) applied under ``self._lock``; this module adds what pure functions cannot:
waiting, threads, errors and clocks.  Invariants kept by every method, under the lock (the per-rank parts
of the TLA+ invariants, :func:`cbpause.core.transitions.rank_invariant`):

* ``CountsInv``: ``count == waiting + inside >= 0``; an open window has a holder.
* ``SameWindowInv``: a holder is inside only while ``phase == "window"`` and ``paused``.
* ``MonotoneStopInv``: ``local_status`` and ``tp_status`` only grow, except in ``clear()``.

Two APIs here, one method per TLA+ action each:

* the explicit holder API (``request_pause`` returns a :class:`PauseHold`; ``enter_pause``, ``leave_pause``,
  ``interrupt`` take it), with the stops (``request_stop``) and ``clear()``;
* the explicit loop API (``observe``, ``all_reduce``, ``open_window``, ..., ``barrier``, ``start_step``; the
  mixin :class:`~cbpause.core.loop.LoopSteps`), in which the loop reports each step of its iteration.

:class:`cbpause.PauseProtocol` (:mod:`cbpause.core.dropin`) is this object with the drop-in API of
transformers 5.23's ``BackgroundThreadStatus`` on top, and the state that adapter defers.

Waiting holders are woken by ``notify_all`` on every change that can enable them (``_wakes``), which is the weak
fairness the spec assumes for ``HolderWakes`` (``EnterPause`` or ``PauseFails``; spec section 4.4).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

from . import transitions as t
from .arguments import check_mode, check_timeout
from .condition import SafeCondition, thread_alive
from .group import HOLDER_ACTIONS, python_name
from .loop import HOLDER_CHECK_S, LoopSteps
from .metrics import PauseMetrics
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED, RankState

if TYPE_CHECKING:
    from .recorder import TraceRecorder

__all__ = ["HOLDER_CHECK_S", "PauseHold", "PauseMetrics", "RankProtocol"]

logger = logging.getLogger("cbpause")

# CPython loses a SIGINT that lands after the main thread released the GIL to block on a lock and before
# the block starts: the handler runs only when the thread wakes.  A holder waiting on the main thread
# therefore wakes at least this often, so Ctrl-C reaches it within this bound (P-INTERRUPT).
MAIN_THREAD_WAKE_S = 0.1

# The holder's state after each holder transition (TLA+ hs[h]), by function name: from group.HOLDER_ACTIONS.
_HOLD_AFTER = {python_name(action): after for action, (_, after) in HOLDER_ACTIONS.items()}


class PauseHold:
    """One holder's pause on one rank, from :meth:`RankProtocol.request_pause` to its end.

    ``state`` is the holder's TLA+ state ``hs[h]``: ``"waiting"``, ``"inside"``, then ``"idle"`` once it
    left, failed, timed out, was interrupted, or was released because ``thread`` died (P-RELEASE-DEAD-HOLDER).
    ``mode`` is the pause mode it asked for (TLA+ ``hmode[h]``: ``transitions.KEEP`` ... ``ABORT``).
    A hold belongs to the protocol object that issued it; any thread may end it (:meth:`RankProtocol.leave_pause`),
    but it lives only as long as ``thread``, the thread that asked for it.
    """

    __slots__ = ("_protocol", "holder", "mode", "requested_at", "state", "thread")

    def __init__(self, protocol: RankProtocol, holder: Hashable, requested_at: float, mode: int = t.KEEP):
        self._protocol = protocol
        self.holder = holder  # who holds it, for traces: a thread of the drop-in API, or this hold
        self.mode = mode
        self.requested_at = requested_at
        self.state = "idle"
        self.thread = threading.current_thread()

    def __repr__(self) -> str:
        return f"<PauseHold {self.state} ({t.MODE_NAMES[self.mode]}) of thread {self.thread.name!r}>"


class RankProtocol(LoopSteps):
    """Pause, stop and fatal-error protocol of one rank's continuous-batching loop: the explicit holder and loop
    APIs.  :class:`cbpause.PauseProtocol` adds transformers' drop-in API; use that one unless the loop reports
    every step itself and no caller uses ``acquire_pause``.

    Args:
        peer_park_timeout: how long a rank parked for a peer's pause waits for its local holder before
            failing (spec section 5).  ``None`` waits for ever, as upstream does.
        clock: a monotonic clock, for the metrics and the timeouts (tests may pass a fake).
        trace: a :class:`~cbpause.core.recorder.TraceRecorder` that records every transition (off by default).
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
        self._peer_park_timeout = check_timeout(peer_park_timeout, "peer_park_timeout")
        # Opt-in trace recording (cbpause.core.recorder); None costs one attribute test per transition.
        self._trace = trace
        self.trace_rank = trace.attach() if trace is not None else 0
        self.fatal_error: BaseException | None = None
        self._clock = clock
        # No method re-enters the lock.  Every method takes it with `with self._lock`: the lock's __enter__/__exit__
        # are C, with no point where CPython delivers a signal between acquiring (releasing) the lock and returning.
        # Waits go through SafeCondition, whose lock ownership survives an interrupt anywhere (issue 26, point 1).
        self._condition = SafeCondition()
        self._lock = self._condition.lock
        self._state = RankState()  # TLA+'s Init: a loop about to start
        self._local = threading.local()
        self._serial = itertools.count()
        self._loop_thread: int | None = None
        self._holds: dict[PauseHold, None] = {}  # the holds waiting or inside, in request order
        # Memos of the loop's steps, replayed while the loop cycles through the same states (trace off).
        self._forget_memos()
        # metrics
        self._pauses_taken = 0
        self._windows_opened = 0
        self._window_opened_at: float | None = None
        self._window_entries = 0
        self._total_paused = 0.0
        self._last_paused: float | None = None
        self._last_entry_latency: float | None = None

    # ------------------------------------------------------------------------------------------- inspection

    @property
    def state(self) -> RankState:
        """The current :class:`~cbpause.core.transitions.RankState` (an immutable snapshot)."""
        return self._state

    @property
    def peer_park_timeout_s(self) -> float | None:
        """The ``peer_park_timeout`` this object was built with (seconds, or None for ever)."""
        return self._peer_park_timeout

    def can_accept_new_requests(self) -> str | None:
        """Why the loop cannot accept new requests, or None if it can (upstream's contract)."""
        if self.fatal_error is not None or self._state.fatal:
            return "The background thread died with a fatal error."
        if self._state.local_status != DONT_STOP:
            return "The background thread is stopping."
        return None

    def submit(self, request_id: str) -> str | None:
        """P-SUBMIT's acceptance check (``can_accept_new_requests``) under the lock, so that a recorder sees it in
        order with the stops: why the loop refuses request ``request_id``, or None when it accepts it.  The caller
        owns the request and enqueues an accepted one (transformers' integration does, under a lock its loop's last
        drain takes too)."""
        with self._lock:
            denial = self.can_accept_new_requests()
            self._record_request("Submit", request_id, int(denial is None))
        return denial

    def record_request(self, action: str, request_id: str = "") -> None:
        """Write a step of a request that the loop took into the trace (``Drain``, ``Broadcast``, ``Deliver``: see
        ``tla/TracePauseProtocol.tla``), with this rank's state, in order with its transitions.  Nothing without a
        recorder: the requests are the loop's, and this object does not track them."""
        if self._trace is not None:
            with self._lock:
                self._record_request(action, request_id, 0)

    def _record_request(self, action: str, request_id: str, ok: int) -> None:
        if self._trace is not None:
            s = self._state
            self._trace.record(self.trace_rank, action, (ok,), s, s, request=request_id)

    @property
    def pauses_taken(self) -> int:
        """Holders that entered a pause since construction (as ``metrics().pauses_taken``, without the snapshot: the
        loop reads it at the end of every window)."""
        return self._pauses_taken

    def metrics(self) -> PauseMetrics:
        """A consistent snapshot of the pause metrics."""
        with self._lock:
            s = self._state
            opened = self._window_opened_at
            return PauseMetrics(
                pauses_taken=self._pauses_taken,
                holders_inside=s.inside,
                holders_waiting=s.waiting,
                windows_opened=self._windows_opened,
                total_paused_s=self._total_paused,
                last_paused_s=self._last_paused,
                last_entry_latency_s=self._last_entry_latency,
                open_window_s=None if opened is None else self._clock() - opened,
                open_window_entries=0 if opened is None else self._window_entries,
                window_closing=s.closing,
            )

    # ------------------------------------------------------------------------------------------- internals

    def _apply(self, fn: Callable[..., RankState], *args: object, hold: PauseHold | None = None) -> RankState:
        """Apply one transition under the lock (the caller holds it) and wake the waiters it may enable.

        With ``hold``, the holder's state changes in the same breath as the rank's (no call between the two
        stores), so an exception landing in the caller sees them agree.
        """
        before = self._state
        after = _transition(fn, before, args)
        if hold is None:
            self._state = after
        else:
            # One statement, so that no line event (where settrace, or a test standing in for a signal, could
            # raise) separates the rank's state from the holder's.
            self._state, hold.state = after, _HOLD_AFTER[fn.__name__]
            if hold.state == "idle":
                self._holds.pop(hold, None)
            else:
                self._holds[hold] = None
        if self._trace is not None:
            holder, holder_state = (None, "") if hold is None else (hold.holder, hold.state)
            self._trace.record(self.trace_rank, fn.__name__, args, before, after, holder, holder_state)
        if after.paused != before.paused:  # a window opened or closed: its waiters are woken, then the metrics
            self._condition.notify_all()  # (which the woken wait for: they need this lock, and the CPU)
            self._window_metrics(after.paused)
        elif _wakes(fn, before, after):
            self._condition.notify_all()
        return after

    def _window_metrics(self, opened: bool) -> None:
        now = self._clock()
        if opened:
            self._window_opened_at = now
            self._windows_opened += 1
            self._window_entries = 0
        elif self._window_opened_at is not None:
            self._last_paused = now - self._window_opened_at
            self._total_paused += self._last_paused
            self._window_opened_at = None

    def bind_loop_thread(self) -> None:
        """Declare the calling thread the generation loop's, until the next ``clear()``.

        A loop that calls this first needs no inference from ``is_pause_requested()`` (see there); D4's
        check (``acquire_pause()`` from the loop's own thread raises) then holds from the first iteration.
        """
        with self._lock:
            self._loop_thread = threading.get_ident()

    def _refuse_loop_thread(self) -> None:
        """R-NO-SELF-PAUSE (D4): a pause asked from the loop's own thread would wait for itself."""
        if self._loop_thread is not None and self._loop_thread == threading.get_ident():
            raise RuntimeError(
                "pause() called from the generation loop's own thread (a callback or logits processor): "
                "the loop would wait for itself"
            )

    def _release_dead_holders(self) -> int:
        """P-RELEASE-DEAD-HOLDER for every hold whose thread died without leaving (the caller holds the lock; the
        loop is parked in its window, or stopped); returns how many.  Logs an error that names the thread."""
        dead = [h for h in self._holds if h.state != "idle" and not thread_alive(h.thread)]
        for hold in dead:
            logger.error(
                "a pause held by thread %r (%s) was released: the thread ended while it %s, without leaving",
                hold.thread.name, hold.state, "waited for the pause" if hold.state == "waiting" else "was inside",
            )  # fmt: skip
            if self._trace is not None:  # P-HOLDER-DIES, recorded where the protocol learns it (it changes no state)
                s = self._state
                self._trace.record(self.trace_rank, "holder_dies", (), s, s, hold.holder, "dead")
            self._apply(t.release_dead_holder, hold.state == "inside", hold.mode, hold=hold)
        return len(dead)

    # ------------------------------------------------------------------------------------------- stopping

    def clear(self) -> None:
        """P-RESTART (``Restart``): clear the statuses before (re)starting the loop.

        On an object no loop has run on yet (TLA+'s Init) it changes nothing: pauses and stops asked before the
        loop starts stay asked, for the loop to see.  Raises ``RuntimeError`` and changes nothing while a holder
        waits or is inside a stopped loop, or while the loop runs (spec section 5).
        """
        with self._lock:
            s = self._state
            if self._loop_thread is None and s.phase == "read":
                return
            if s.phase == "stopped":
                self._release_dead_holders()
                s = self._state
            if s.count:
                raise RuntimeError(
                    f"clear() while {s.waiting} holder(s) wait for a pause and {s.inside} are inside: "
                    "let them leave first"
                )
            if s.phase != "stopped":
                raise RuntimeError(f"clear() while the generation loop runs (phase {s.phase!r}): stop it first")
            self.fatal_error = None
            self._forget_loop()
            self._apply(t.restart)

    def request_stop(self, status: int, global_rank: int = 0) -> None:
        """P-REQUEST-STOP (``RequestStop``): ask the loop to stop; effective at the next all-reduce.

        Keeps MonotoneStopInv: asking for a status at or below the current one changes nothing.
        """
        if status not in (FLUSH_AND_STOP, HARD_STOP) or isinstance(status, bool):
            raise ValueError(f"Invalid stop status {status!r} from rank {global_rank}")
        with self._lock:
            s = self._state
            if t.can_request_stop(s, status):
                self._apply(t.request_stop, status)

    # ------------------------------------------------------------------------------------------- holders

    def request_pause(
        self, wake_up_loop: threading.Event | None = None, mode: str | int = "keep", *, timeout: float | None = None
    ) -> PauseHold:
        """P-REQUEST-PAUSE (``RequestPause``): ask for a pause in ``mode``; the hold is ``"waiting"``.

        Follow with :meth:`enter_pause` (which waits), or withdraw with :meth:`interrupt`.  Does not wait, except
        while the rank's window is closing (a holder has left it): a newcomer waits for that window to close, at
        most ``timeout`` seconds (``TimeoutError``, nothing changed), and asks for the next one (R-WINDOW-CLOSES).
        Raises ``RuntimeError`` and changes nothing from the loop's own thread (D4), or when the loop is not
        running, is stopping (a flush or hard stop was asked) or has failed (chaining the fatal error);
        ``ValueError`` for an unknown ``mode``.  The hold enters only a window whose mode is at least its own
        (R-MODES).
        """
        number = check_mode(mode)
        timeout = check_timeout(timeout)
        self._refuse_loop_thread()
        with self._lock:
            self._wait_while_closing(timeout)
            hold = self._new_hold(None, number)
            try:
                self._apply(t.request_pause, number, hold=hold)
                if wake_up_loop is not None:
                    wake_up_loop.set()
            except BaseException:
                if hold.state == "waiting":  # nobody would ever get this hold to withdraw it
                    self._apply(t.interrupt, hold.mode, hold=hold)
                raise
            return hold

    def _wait_while_closing(self, timeout: float | None) -> float | None:
        """R-WINDOW-CLOSES (the caller holds the lock): while the rank's window is closing, a newcomer waits for it
        to close before it asks (RequestPause's guard ``~closing``), so that holders who take turns cannot keep one
        window open for ever.  Returns what is left of ``timeout``; raises ``TimeoutError``, with nothing changed,
        when it runs out first.

        A thread with a hold inside the window is no newcomer: its pause nests in the one it holds and asks at once
        (else it would wait for itself); the spec's holders hold one pause at a time, so that is outside the model.
        """
        if not self._state.closing or not t.can_request_pause(self._state):
            return timeout  # a refused request raises at once (in _new_hold), closing or not
        me = threading.current_thread()
        if any(h.state == "inside" and h.thread is me for h in self._holds):
            return timeout
        deadline = None if timeout is None else self._clock() + timeout
        on_main = me is threading.main_thread()
        while self._state.closing and t.can_request_pause(self._state):
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the generation loop did not pause within {timeout} s (its window was closing)")
            if on_main:
                remaining = MAIN_THREAD_WAKE_S if remaining is None else min(remaining, MAIN_THREAD_WAKE_S)
            self._condition.wait(remaining)
        return None if deadline is None else max(0.0, deadline - self._clock())

    def _new_hold(self, holder: Hashable, mode: int) -> PauseHold:
        """A hold ready to request (the caller holds the lock); RuntimeError if RequestPause is disabled."""
        s = self._state
        if not t.can_request_pause(s):
            raise RuntimeError(_refusal(s)) from self.fatal_error
        # An asynchronous exception between a hold's last store and its removal from the registry (_apply) leaves an
        # idle hold there: forget those here, so the registry stays the holds waiting or inside.  The registry holds
        # exactly `count` holds otherwise, so the scan (O(holders)) runs only when one was left.
        if len(self._holds) > s.count:
            for idle in [h for h in self._holds if h.state == "idle"]:
                del self._holds[idle]
        hold = PauseHold(self, holder, self._clock(), mode)
        if holder is None:
            hold.holder = ("hold", next(self._serial))
        return hold

    def _own(self, hold: PauseHold, state: str, action: str) -> None:
        if not isinstance(hold, PauseHold) or hold._protocol is not self:
            raise ValueError(f"{action}() takes a PauseHold of this protocol, not {hold!r}")
        if hold.state != state:
            raise RuntimeError(f"{action}() needs a hold that is {state}; this one is {hold.state}: nothing changed")

    def enter_pause(self, hold: PauseHold, timeout: float | None = None) -> None:
        """Wait for P-ENTER-PAUSE (``EnterPause``): return once ``hold`` is inside the pause.

        Raises ``RuntimeError`` (P-PAUSE-FAILS, the fatal error as ``__cause__``) if the loop stops first,
        ``TimeoutError`` (P-PAUSE-TIMEOUT) after ``timeout`` seconds (``0`` enters only an open window).  On
        these, and on any exception while waiting (P-INTERRUPT), the request is withdrawn before the exception
        propagates (CountsInv); an asynchronous exception (``KeyboardInterrupt``) that lands just after the entry
        leaves the pause again before it propagates.
        """
        timeout = check_timeout(timeout)
        with self._lock:
            self._own(hold, "waiting", "enter_pause")
            try:
                self._wait_for_window(hold, timeout)
            except BaseException:
                self._withdraw(hold)
                raise

    def _withdraw(self, hold: PauseHold) -> None:
        """An exception is leaving :meth:`enter_pause` or :meth:`acquire_pause` (the caller holds the lock): the
        caller of those will not leave a pause it does not know it entered, so withdraw the request (P-INTERRUPT)
        or, if an asynchronous exception landed just after the entry, leave (P-LEAVE-PAUSE)."""
        if hold.state == "waiting":
            self._apply(t.interrupt, hold.mode, hold=hold)
        elif hold.state == "inside":
            self._apply(t.leave_pause, hold.mode, hold=hold)

    def _wait_for_window(self, hold: PauseHold, timeout: float | None) -> None:
        """The wait of a waiting ``hold`` (the caller holds the lock): EnterPause, PauseFails or PauseTimeout.

        On the main thread the wait wakes every ``MAIN_THREAD_WAKE_S`` seconds, so that a SIGINT CPython left
        pending still interrupts it.
        """
        deadline = on_main = None  # computed before the first wait: a hold that enters at once needs neither
        while True:
            if hold.state != "waiting":  # released meanwhile: its requesting thread ended (P-RELEASE-DEAD-HOLDER)
                raise RuntimeError(f"this pause was released while waiting: {hold.thread.name!r}, the thread that "
                                   "requested it, ended (a hold lives as long as the thread that requested it)")
            s = self._state
            if t.can_enter_window(s, hold.mode):  # a window in a mode that covers the hold's (R-MODES)
                self._enter(hold)
                return
            if t.can_pause_fails(s):
                self._apply(t.pause_fails, hold.mode, hold=hold)
                raise RuntimeError("The generation loop stopped before it could pause.") from self.fatal_error
            if on_main is None:
                deadline = None if timeout is None else self._clock() + timeout
                on_main = threading.current_thread() is threading.main_thread()
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                self._apply(t.pause_timeout, hold.mode, hold=hold)
                raise TimeoutError(f"the generation loop did not pause within {timeout} s")
            if on_main:
                remaining = MAIN_THREAD_WAKE_S if remaining is None else min(remaining, MAIN_THREAD_WAKE_S)
            self._condition.wait(remaining)

    def _enter(self, hold: PauseHold) -> None:
        """P-ENTER-PAUSE for a waiting ``hold`` whose mode the open window covers (the caller holds the lock)."""
        self._apply(t.enter_pause, hold=hold)
        self._pauses_taken += 1
        self._window_entries += 1
        self._last_entry_latency = self._clock() - hold.requested_at

    def interrupt(self, hold: PauseHold) -> None:
        """P-INTERRUPT (``Interrupt``): withdraw a waiting request (as a SIGINT during the wait does).

        Raises ``RuntimeError`` and changes nothing unless ``hold`` is waiting.
        """
        with self._lock:
            self._own(hold, "waiting", "interrupt")
            self._apply(t.interrupt, hold.mode, hold=hold)

    def leave_pause(self, hold: PauseHold) -> None:
        """P-LEAVE-PAUSE (``LeavePause``): ``hold`` leaves; the last holder out lets the loop resume.

        Raises ``RuntimeError`` and changes nothing unless ``hold`` is inside (D2, CountsInv).
        """
        with self._lock:
            self._own(hold, "inside", "leave_pause")
            self._apply(t.leave_pause, hold.mode, hold=hold)



# Phases a waiter may wait for (besides an open window, a stop, and a failure): a park for a peer, the barrier after
# a window (tests wait for these with testing.wait_for_phase).
_WAKING_PHASES = frozenset({"peer", "barrier", "stopped", "dead"})


# The steps taken in a live holder's thread (the others are the loop's, or a stop's): from group.HOLDER_ACTIONS.
_HOLDER_STEPS = frozenset(
    getattr(t, python_name(action))
    for action, (by, after) in HOLDER_ACTIONS.items()
    if by != "loop" and after != "dead"
)


def _wakes(fn: Callable[..., RankState], before: RankState, after: RankState) -> bool:
    """Whether ``_apply`` wakes the waiters after a step.

    Those a step can enable (holders wait for an open window that covers their mode, or a stopped or failed loop;
    the loop waits for its last holder to leave, or, parked for a peer, for a request) are woken by a step that
    opens or closes the window, moves the stop status, fails, enters a phase a waiter waits for (``peer``,
    ``barrier``, ``stopped``, ``dead``), releases a dead holder, or asks for a pause of a loop parked for a peer.
    A holder's own RequestPause and EnterPause, and a LeavePause that leaves the window open (the loop waits for
    it to close; a holder deferred to a stronger mode, for the next window), wake nobody: waking every waiting
    holder on each of them made a pause O(holders) wake-ups.

    While holders wait, every step of the loop wakes them too, although it enables none of them: they look and
    wait again.  Measured on the benchmark's machine (``docs/benchmarks.md``, "Where the time goes"), a holder
    woken that recently gets into the window 20-40 µs sooner than one that has slept since its request, whose
    CPU has gone idle: the window opens microseconds after the loop's decision.  The loop's memos
    (``LoopSteps._remember``) replay only steps without holders, so that every step with them comes here.
    """
    return (
        after.paused != before.paused
        or after.local_status != before.local_status
        or after.fatal != before.fatal
        or fn is t.release_dead_holder
        or (after.phase != before.phase and after.phase in _WAKING_PHASES)
        or (fn is t.request_pause and before.phase == "peer")
        or (before.waiting > 0 and fn not in _HOLDER_STEPS)
    )


@functools.lru_cache(maxsize=8192)
def _transition(fn: Callable[..., RankState], s: RankState, args: tuple) -> RankState:
    """``fn(s, *args)``, the same object for the same arguments: transitions are pure functions of small hashable
    values, and a steady loop cycling through the same state objects lets the memos of its steps hit."""
    return fn(s, *args)


def _refusal(s: RankState) -> str:
    if s.fatal:
        return "Cannot pause: the generation loop died with a fatal error."
    if s.phase in ("stopped", "dead"):
        return "Cannot pause: the generation loop has stopped."
    return ("Cannot pause: the generation loop is stopping (a stop was asked; no new pause is admitted, so that "
            "the stop completes)")
