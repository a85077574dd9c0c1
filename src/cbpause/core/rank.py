"""``RankCore``: one rank's state under its lock, and the one place where it changes (``_apply``).

Every state change of the protocol is a pure function of :mod:`cbpause.core.transitions` (one per TLA+ action of
``tla/PauseProtocol.tla``) applied by :meth:`RankCore._apply` under ``self._lock``.  The two APIs stand on this
class: the loop's (:class:`~cbpause.core.loop.LoopSteps`, a subclass) and the holders' and stoppers'
(:class:`~cbpause.core.protocol.RankProtocol`, a subclass of that).  Invariants kept by every method, under the lock
(the per-rank parts of the TLA+ invariants, :func:`cbpause.core.transitions.rank_invariant`):

* ``CountsInv``: ``count == waiting + inside >= 0``; an open window has a holder.
* ``SameWindowInv``: a holder is inside only while ``phase == "window"`` and ``paused``.
* ``MonotoneStopInv``: ``local_status`` and ``tp_status`` only grow, except in ``clear()``.

Waiting threads are woken by ``notify_all`` on every change that can enable them (:func:`_wakes`), which is the weak
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
from .arguments import check_timeout
from .condition import SafeCondition, thread_alive
from .group import HOLDER_ACTIONS, python_name
from .transitions import RankState

if TYPE_CHECKING:
    from .recorder import TraceRecorder

__all__ = ["PauseHold", "RankCore"]

logger = logging.getLogger("cbpause")

# The holder's state after each holder transition (TLA+ hs[h]), by function name: from group.HOLDER_ACTIONS.
_HOLD_AFTER = {python_name(action): after for action, (_, after) in HOLDER_ACTIONS.items()}
# The transitions that are TLA+'s Drop(h): the one that closes the window makes the holders queued at it waiting
# (they take the modes of the queued holds, in queue order, as their last argument; RankCore._settle).
_DROPS = frozenset({"leave_pause", "pause_fails", "interrupt", "pause_timeout", "release_dead_holder"})

# How long a rank parked for a peer's pause waits for a holder of its own before it fails (D3), by default: the one
# value every layer's default reads (the explicit and drop-in protocols, the integration, ``cbpause serve``).
PEER_PARK_TIMEOUT_S = 300.0


class PauseHold:
    """One holder's pause on one rank, from :meth:`RankProtocol.request_pause` to its end.

    ``state`` is the holder's TLA+ state ``hs[h]``: ``"waiting"`` (``"queued"`` first, when it asked at a closing
    window: P-QUEUE-PAUSE), ``"inside"``, then ``"idle"`` once it
    left, failed, timed out, was interrupted, or was released because ``thread`` died (P-RELEASE-DEAD-HOLDER).
    ``mode`` is the pause mode it asked for (TLA+ ``hmode[h]``: ``transitions.KEEP`` ... ``ABORT``).
    A hold belongs to the protocol object that issued it; any thread may end it (:meth:`RankProtocol.leave_pause`),
    but it lives only as long as ``thread``, the thread that asked for it.  ``one_call``: it was requested and entered
    in one call (``request_and_enter_pause``, the drop-in's ``acquire_pause``, the manager's ``pause()``), whose
    caller is the thread that ends it (R-NO-SELF-WAIT).
    """

    __slots__ = ("_protocol", "holder", "mode", "one_call", "queued_at", "requested_at", "state", "thread")

    def __init__(self, protocol: RankCore, holder: Hashable, requested_at: float, mode: int = t.KEEP):
        self._protocol = protocol
        self.holder = holder  # who holds it, for traces: a thread of the drop-in API, or this hold
        self.mode = mode
        self.one_call = False
        self.queued_at = 0  # the rank's count of closes when it was queued (P-QUEUE-PAUSE): see RankCore._settle
        self.requested_at = requested_at
        self.state = "idle"
        self.thread = threading.current_thread()

    def __repr__(self) -> str:
        return f"<PauseHold {self.state} ({t.MODE_NAMES[self.mode]}) of thread {self.thread.name!r}>"


class RankCore:
    """One rank's state, its lock, its holds and the loop's thread; :meth:`_apply`, the one place where the state
    changes.  Not used alone: see :class:`cbpause.RankProtocol` and :class:`cbpause.PauseProtocol`.

    Args:
        peer_park_timeout: how long a rank parked for a peer's pause waits for its local holder before
            failing (spec section 5).  ``None`` waits for ever, as upstream does.
        clock: a monotonic clock, for the metrics and the timeouts (tests may pass a fake).
        trace: a :class:`~cbpause.core.recorder.TraceRecorder` that records every transition (off by default).
    """

    def __init__(
        self,
        *,
        peer_park_timeout: float | None = PEER_PARK_TIMEOUT_S,
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
        # The holds queued at the closing window, in arrival order (it may keep holds no longer queued for a while:
        # readers look at each hold's state), the windows closed with holds queued (a hold queued before the last
        # such close is admitted: waiting), and whether the holds it admitted are still to be caught up (_settle).
        self._queued: dict[PauseHold, None] = {}
        self._closes = 0
        self._unsettled = False
        # metrics
        self._pauses_taken = 0
        self._windows_opened = 0
        self._window_opened_at: float | None = None
        self._window_entries = 0
        self._total_paused = 0.0
        self._last_paused: float | None = None
        self._last_entry_latency: float | None = None

    @property
    def state(self) -> RankState:
        """The current :class:`~cbpause.core.transitions.RankState` (an immutable snapshot)."""
        return self._state

    @property
    def tracing(self) -> bool:
        """Whether a :class:`~cbpause.core.recorder.TraceRecorder` records this object's steps (the loop then also
        records what the trace needs of its requests: ``PauseProtocol.record_request``)."""
        return self._trace is not None

    @property
    def peer_park_timeout_s(self) -> float | None:
        """The ``peer_park_timeout`` this object was built with (seconds, or None for ever)."""
        return self._peer_park_timeout

    def _apply(self, fn: Callable[..., RankState], *args: object, hold: PauseHold | None = None) -> RankState:
        """Apply one transition under the lock (the caller holds it) and wake the waiters it may enable.

        With ``hold``, the holder's state changes in the same breath as the rank's (no call between the two
        stores), so an exception landing in the caller sees them agree.
        """
        if self._unsettled:
            self._settle()
        before = self._state
        queued = self._queued and fn.__name__ in _DROPS and [h for h in self._queued if h.state == "queued"]
        if queued:
            args = (*args, tuple(h.mode for h in queued))
        after = _transition(fn, before, args)
        if hold is None:
            self._state = after
        else:
            state = _HOLD_AFTER[fn.__name__]
            if state == "queued":
                hold.queued_at = self._closes  # (the hold is not queued yet: nothing reads this before the store)
            # One statement, so that no line event (where settrace, or a test standing in for a signal, could
            # raise) separates the rank's state from the holder's, nor a call (where CPython delivers an
            # asynchronous exception) from the epoch that admits the queued holds.
            if queued and not after.paused:  # the drop closed the window: the holds queued at it wait, counted
                self._state, hold.state, self._closes, self._unsettled = after, state, self._closes + 1, True
            else:
                self._state, hold.state = after, state
            if state == "idle":
                self._holds.pop(hold, None)
                self._queued.pop(hold, None)
            elif state == "queued":
                self._queued[hold] = None
            else:
                self._holds[hold] = None
        if self._trace is not None:
            holder, holder_state = (None, "") if hold is None else (hold.holder, hold.state)
            self._trace.record(self.trace_rank, fn.__name__, args, before, after, holder, holder_state)
        if after.paused != before.paused:  # a window opened or closed: its waiters are woken, then the metrics
            self._condition.notify_all()  # (which the woken wait for: they need this lock, and the CPU)
            now = self._clock()  # (here, not in a method: this is the resume's and the entry's path, issue 38)
            if after.paused:
                self._window_opened_at = now
                self._windows_opened += 1
                self._window_entries = 0
            elif self._window_opened_at is not None:
                self._last_paused = now - self._window_opened_at
                self._total_paused += self._last_paused
                self._window_opened_at = None
        elif _wakes(fn, before, after):
            self._condition.notify_all()
        if self._unsettled:
            self._settle()
        return after

    def _settle(self) -> None:
        """The holds a close admitted (queued before it: ``queued_at`` below ``_closes``) become waiting, and the
        queue forgets the holds that are no longer queued (the caller holds the lock).  ``_apply`` counted them in
        the rank's state and advanced ``_closes`` in one statement; this catches the holds and the registries up.
        Every step is idempotent, so that an exception landing in between leaves the next call to finish it:
        ``_apply`` and every reader of a queued hold (``_ask``, ``_withdraw``, the metrics) call it first while
        ``_unsettled``."""
        closes = self._closes
        for hold in list(self._queued):
            if hold.state == "queued" and hold.queued_at < closes:
                self._holds[hold] = None  # registered first: a hold is never waiting outside the registry
                hold.state = "waiting"
            if hold.state != "queued":
                self._queued.pop(hold, None)
        self._unsettled = False

    def _queued_now(self) -> int:
        """How many holds are queued at the closing window (the caller holds the lock)."""
        if self._unsettled:
            self._settle()
        return sum(1 for hold in self._queued if hold.state == "queued")

    def bind_loop_thread(self) -> None:
        """Declare the calling thread the generation loop's, until the next ``clear()``.

        A loop that calls this first needs no inference from its first step (``observe()``, or the drop-in's
        ``is_pause_requested()``); D4's check (a pause asked from the loop's own thread raises) then holds from the
        first iteration.
        """
        with self._lock:
            self._loop_thread = threading.get_ident()

    def _refuse_loop_thread(self) -> None:
        """R-NO-SELF-PAUSE (D4): a pause asked from the loop's own thread would wait for itself."""
        if self._loop_thread is not None and self._loop_thread == threading.get_ident():
            raise RuntimeError(
                "pause() called from the generation loop's own thread (a callback, a logits processor, a signal "
                "handler while the loop runs on the main thread): the loop would wait for itself"
            )

    def _release_dead_holders(self) -> int:
        """P-RELEASE-DEAD-HOLDER for every hold whose thread died without leaving (the caller holds the lock; the
        loop is parked in its window, drains, or has stopped); returns how many.  Logs an error that names the
        thread."""
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
    ``barrier``, ``stopped``, ``dead``), releases a dead holder, queues one (for whoever waits to see it queued:
    :func:`cbpause.testing.wait_for_queued`), or asks for a pause of a loop parked for a peer.
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
        or fn is t.queue_pause
        or (after.phase != before.phase and after.phase in _WAKING_PHASES)
        or (fn is t.request_pause and before.phase == "peer")
        or (before.waiting > 0 and fn not in _HOLDER_STEPS)
    )


@functools.lru_cache(maxsize=8192)
def _transition(fn: Callable[..., RankState], s: RankState, args: tuple) -> RankState:
    """``fn(s, *args)``, the same object for the same arguments: transitions are pure functions of small hashable
    values, and a steady loop cycling through the same state objects lets the memos of its steps hit."""
    return fn(s, *args)
