"""``RankProtocol``: one rank's side of the protocol, thread-safe, standard library only.

The rank (:class:`~cbpause.core.rank.RankCore`: its state, its lock, and ``_apply``, where every state change
happens, each a pure function of :mod:`cbpause.core.transitions`, one per TLA+ action of ``tla/PauseProtocol.tla``)
with its two explicit APIs, one method per TLA+ action each:

* the loop's (``observe``, ``all_reduce``, ``open_window``, ..., ``barrier``, ``start_step``,
  ``record_fatal_error``; :class:`~cbpause.core.loop.LoopSteps`), in which the loop reports each step of its
  iteration;
* the holders' (``request_pause`` returns a :class:`PauseHold`; ``enter_pause``, ``leave_pause``, ``interrupt``
  take it; ``request_and_enter_pause`` is the first two under one acquisition of the lock) and the stoppers'
  (``request_stop``), with ``clear()``: this module.

This module adds what pure functions cannot: waiting, threads, errors and clocks.  Its methods keep the invariants
:mod:`cbpause.core.rank` lists.  :class:`cbpause.PauseProtocol` (:mod:`cbpause.core.dropin`) is this object with the
drop-in API of transformers 5.23's ``BackgroundThreadStatus`` on top, and the state that adapter defers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

from . import transitions as t
from .arguments import check_mode, check_timeout
from .loop import HOLDER_CHECK_S, LoopSteps
from .metrics import PauseMetrics
from .rank import PauseHold
from .transitions import DONT_STOP, FLUSH_AND_STOP, HARD_STOP, STOPPED, RankState

T = TypeVar("T")

__all__ = ["HOLDER_CHECK_S", "PauseHold", "PauseMetrics", "RankProtocol"]

# CPython loses a SIGINT that lands after the main thread released the GIL to block on a lock and before
# the block starts: the handler runs only when the thread wakes.  A holder waiting on the main thread
# therefore wakes at least this often, so Ctrl-C reaches it within this bound (P-INTERRUPT).
MAIN_THREAD_WAKE_S = 0.1


class RankProtocol(LoopSteps):
    """Pause, stop and fatal-error protocol of one rank's continuous-batching loop: the explicit holder and loop
    APIs.  :class:`cbpause.PauseProtocol` adds transformers' drop-in API; use that one where transformers' own loop
    (which reports only some of its steps) drives it, or a caller uses ``acquire_pause``/``release_pause``.
    Its keyword arguments (``peer_park_timeout``, ``clock``, ``trace``) are :class:`~cbpause.core.rank.RankCore`'s.
    """

    DONT_STOP = DONT_STOP
    FLUSH_AND_STOP = FLUSH_AND_STOP
    HARD_STOP = HARD_STOP
    STOPPED = STOPPED

    # ------------------------------------------------------------------------------------------- inspection

    def can_accept_new_requests(self) -> str | None:
        """Why the loop cannot accept new requests, or None if it can (upstream's contract): P-SUBMIT's acceptance
        (``transitions.can_submit``, TLA+ ``CanSubmit``), and no fatal error recorded."""
        s = self._state
        if t.can_submit(s) and self.fatal_error is None:
            return None
        if self.fatal_error is not None or s.fatal:
            return "The background thread died with a fatal error."
        return "The background thread is stopping."

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
        """Write a step of a request that the loop took into the trace (``Drain``, ``Broadcast``, ``Deliver``,
        ``FirstStep``, ``StaleRestart``, ``PeerDrop``: see
        ``tla/TracePauseProtocol.tla``), with this rank's state, in order with its transitions.  Nothing without a
        recorder: the requests are the loop's, and this object does not track them."""
        if self._trace is not None:
            with self._lock:
                self._record_request(action, request_id, 0)

    def record_labels(self, action: str, **fields: object) -> None:
        """Write one of RequestVersions' steps that the loop took (``Launch``, ``Land``, ``OpenWindow``, ...:
        ``cbpause.core.recorder.LABEL_RECORDS``) into the trace, in order with this rank's transitions.  Nothing
        without a recorder."""
        if self._trace is not None:
            with self._lock:
                self._trace.record_labels(self.trace_rank, action, fields)

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
                holders_queued=self._queued_now(),
            )

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
        while the rank's window is closing (a holder has left it): a newcomer is queued (P-QUEUE-PAUSE) until that
        window closes, at most ``timeout`` seconds (``TimeoutError``, nothing changed), and the close makes it
        waiting for the next one, before anyone who asks later (R-WINDOW-CLOSES, first come).
        Raises ``RuntimeError`` and changes nothing from the loop's own thread (D4), or when the loop is not
        running, is stopping (a flush or hard stop was asked) or has failed (chaining the fatal error);
        ``ValueError`` for an unknown ``mode``.  The hold enters only a window whose mode is at least its own
        (R-MODES).
        """
        number = check_mode(mode)
        timeout = check_timeout(timeout)
        self._refuse_loop_thread()
        with self._lock:
            hold = self._new_hold(None, number)
            try:
                self._ask(hold, timeout)
                if wake_up_loop is not None:
                    wake_up_loop.set()
            except BaseException:
                self._withdraw(hold)  # nobody would ever get this hold to withdraw it
                raise
            return hold

    def request_and_enter_pause(
        self,
        wake_up_loop: threading.Event | None = None,
        mode: str | int = "keep",
        *,
        timeout: float | None = None,
        into: list[PauseHold] | None = None,
    ) -> PauseHold:
        """P-REQUEST-PAUSE, then wait for P-ENTER-PAUSE, P-PAUSE-FAILS, P-INTERRUPT or P-PAUSE-TIMEOUT, under one
        acquisition of the lock: :meth:`request_pause` and :meth:`enter_pause` in one call.

        Returns the hold once it is inside (leave with :meth:`leave_pause`, from any thread).  Raises as those two
        do; an exception from this call means no pause is held: an interrupt anywhere in between withdraws exactly
        the request that went in, and one that lands just after the entry leaves again.  A window already open in a
        mode that covers ``mode`` is entered at once, without setting ``wake_up_loop`` (the loop is parked in it),
        unless a holder has left it already (R-WINDOW-CLOSES: the call is queued for the next window, P-QUEUE-PAUSE,
        the wait counting against ``timeout``).  ``into``, a list, gets the hold appended the moment it is requested
        (waiting), for a caller that must find it even when an asynchronous exception lands after this returns and
        before the caller stored the result."""
        number = check_mode(mode)
        timeout = check_timeout(timeout)
        self._refuse_loop_thread()
        with self._lock:
            return self._request_and_enter(number, timeout, wake_up_loop, () if into is None else (into,), None)

    def _request_and_enter(self, mode: int, timeout: float | None, wake_up_loop: threading.Event | None,
                           into: tuple[list, ...], holder: Hashable) -> PauseHold:  # fmt: skip
        """:meth:`request_and_enter_pause` (the caller holds the lock); each list of ``into`` gets the hold."""
        self._refuse_self_wait(mode)
        hold = self._new_hold(holder, mode)
        hold.one_call = True
        asked = timeout
        for sink in into:  # before the ask: a hold queued at a closing window can be withdrawn by another thread
            sink.append(hold)
        try:
            timeout = self._ask(hold, timeout)
            if hold.state == "inside":  # queued, then entered by another thread (enter_pause) before this one woke
                return hold
            if t.can_enter_window(self._state, mode):
                # The fast path: a window that covers the hold is open, so it enters now, with no wait and no wake-up
                # (the loop is parked in the window, not in its idle wait).
                self._enter(hold)
                return hold
            if wake_up_loop is not None:
                wake_up_loop.set()
            self._wait_for_window(hold, timeout, asked)
        except BaseException:
            self._withdraw(hold)  # P-INTERRUPT (D1), or P-LEAVE-PAUSE just after the entry
            raise
        return hold

    def _refuse_self_wait(self, mode: int) -> None:
        """R-NO-SELF-WAIT (the caller holds the lock): a thread inside the open window through the one-call entry
        (its hold's ``one_call``) that asks again, in one call, for a stronger mode than the window's would wait for
        the next window, which its own pause keeps from opening: ``RuntimeError`` at once, nothing changed.  (A hold
        of the two-call API may be ended by any thread, so its holder's thread waits within its timeout.)"""
        s = self._state
        if s.paused and not t.can_enter_window(s, mode):
            me = threading.current_thread()
            if any(h.thread is me and h.state == "inside" and h.one_call for h in self._holds):
                raise RuntimeError(
                    f"pause(mode={t.MODE_NAMES[mode]!r}) from a thread inside a {t.MODE_NAMES[s.tp_pause]!r} pause: "
                    "it would wait for the next window, which this thread's own pause keeps closed; nothing was changed"
                )

    def held_by(self, thread: threading.Thread | None = None) -> list[PauseHold]:
        """The holds that ``thread`` (default: the calling one) requested and entered in one call (``one_call``: the
        holds only that thread ends) and that wait or are inside, in request order.  A thread with one cannot wait
        for the loop (to stop, to produce an output): the loop stays paused until that thread leaves."""
        thread = threading.current_thread() if thread is None else thread
        with self._lock:
            return [h for h in self._holds if h.thread is thread and h.one_call and h.state != "idle"]

    def while_held(self, fn: Callable[[], T]) -> T:
        """``fn()`` under this rank's lock, if a holder is inside its window: the window cannot close (its last holder
        cannot leave) until ``fn`` returns.  ``RuntimeError``, ``fn`` not called, otherwise.  ``fn`` must be short and
        must not call this object (the integration sets the weight version this way: a check of the window and then
        the set, apart, let a version land after the window closed)."""
        with self._lock:
            s = self._state
            if not (s.paused and s.inside):
                raise RuntimeError("no holder is inside this rank's pause window")
            return fn()

    def _ask(self, hold: PauseHold, timeout: float | None) -> float | None:
        """P-REQUEST-PAUSE for a new ``hold`` (the caller holds the lock), or, while the rank's window is closing,
        P-QUEUE-PAUSE and the wait for the close, whose Drop makes the hold waiting (R-WINDOW-CLOSES): holders who
        take turns cannot keep one window open for ever, and a newcomer gets the next window before anyone who asks
        after the close (first come: no fairness of the condition's wake-ups needed).  Returns what is left of
        ``timeout``; when it runs out first, raises ``TimeoutError``, and so does any exception during the wait,
        which propagates; a stop asked meanwhile, or the loop failing, raises ``RuntimeError`` (as a request refused
        at once), unless the close came first.  The caller withdraws the hold then (``_withdraw``: P-LEAVE-QUEUE), so
        that nothing has changed.
        ``RuntimeError`` also when another thread withdrew the hold between the close and this thread's wake-up
        (``held_by``, then ``interrupt``); a hold another thread entered meanwhile is returned inside.

        A thread with a hold inside the window is no newcomer: its pause nests in the one it holds and asks at once
        (else it would wait for itself); the spec's holders hold one pause at a time, so that is outside the model.
        A thread whose own hold waits (requested, not entered: the two-call API) keeps the closing window open until
        that hold enters and leaves, or is withdrawn: queued behind it, this thread would wait for itself, so
        ``RuntimeError`` at once, nothing changed (a hostile review of issue 40).
        """
        me = threading.current_thread()
        mine = [h.state for h in self._holds if h.thread is me]
        if not self._state.closing or "inside" in mine:
            self._apply(t.request_pause, hold.mode, hold=hold)
            return timeout
        if "waiting" in mine:
            raise RuntimeError(
                "this thread requested a pause it has not entered, and that request keeps the closing window open: "
                "a second pause from this thread would wait for itself; enter it (enter_pause) or withdraw it "
                "(interrupt) first"
            )
        self._apply(t.queue_pause, hold.mode, hold=hold)
        # Every way out of the wait but the close raises, and the callers' _withdraw takes the hold out of the queue.
        deadline = None if timeout is None else self._clock() + timeout
        on_main = me is threading.main_thread()
        while True:
            if self._unsettled:
                self._settle()
            if hold.state != "queued":
                break
            if not t.can_request_pause(self._state):  # a stop asked, or the loop failed, before the close
                raise RuntimeError(_refusal(self._state)) from self.fatal_error
            remaining = None if deadline is None else deadline - self._clock()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the generation loop did not pause within {timeout} s (its window was closing)")
            if on_main:
                remaining = MAIN_THREAD_WAKE_S if remaining is None else min(remaining, MAIN_THREAD_WAKE_S)
            self._condition.wait(remaining)
        if hold.state == "idle":
            raise RuntimeError("this pause was withdrawn by another thread (interrupt) before it could enter: "
                               "nothing is held")  # fmt: skip
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
        or, if an asynchronous exception landed just after the entry, leave (P-LEAVE-PAUSE); a queued hold leaves the
        queue (P-LEAVE-QUEUE)."""
        if self._unsettled:
            self._settle()
        if hold.state == "waiting":
            self._apply(t.interrupt, hold.mode, hold=hold)
        elif hold.state == "inside":
            self._apply(t.leave_pause, hold.mode, hold=hold)
        elif hold.state == "queued":
            self._apply(t.leave_queue, hold=hold)

    def _wait_for_window(self, hold: PauseHold, timeout: float | None, asked: float | None = None) -> None:
        """The wait of a waiting ``hold`` (the caller holds the lock): EnterPause, PauseFails or PauseTimeout.
        ``asked``: the caller's whole timeout, for the message, when part of it went on a queue (``_ask``).

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
                whole = timeout if asked is None else asked
                raise TimeoutError(f"the generation loop did not pause within {whole} s")
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
        """P-INTERRUPT (``Interrupt``): withdraw a waiting request (as a SIGINT during the wait does); or
        P-LEAVE-QUEUE (``LeaveQueue``) for a hold queued at a closing window.  The thread that waits for it raises
        ``RuntimeError`` (nothing held).

        Raises ``RuntimeError`` and changes nothing unless ``hold`` is waiting or queued.
        """
        with self._lock:
            if isinstance(hold, PauseHold) and hold._protocol is self and hold.state == "queued":
                self._apply(t.leave_queue, hold=hold)
                self._condition.notify_all()  # its thread waits for the close: it finds itself withdrawn
                return
            self._own(hold, "waiting", "interrupt")
            self._apply(t.interrupt, hold.mode, hold=hold)

    def leave_pause(self, hold: PauseHold) -> None:
        """P-LEAVE-PAUSE (``LeavePause``): ``hold`` leaves; the last holder out lets the loop resume.

        Raises ``RuntimeError`` and changes nothing unless ``hold`` is inside (D2, CountsInv).
        """
        with self._lock:
            self._own(hold, "inside", "leave_pause")
            self._apply(t.leave_pause, hold.mode, hold=hold)



def _refusal(s: RankState) -> str:
    if s.fatal:
        return "Cannot pause: the generation loop died with a fatal error."
    if s.phase in ("stopped", "dead"):
        return "Cannot pause: the generation loop has stopped."
    return ("Cannot pause: the generation loop is stopping (a stop was asked; no new pause is admitted, so that "
            "the stop completes)")
