"""One rank's real loop under cbpause, recorded, and the episodes a trace scenario plays on it.

:class:`RealRank` is transformers' continuous-batching loop on a tiny random Llama, driven by
:mod:`cbpause.integrations.transformers` with a :class:`~cbpause.TraceRecorder`, requests flowing through it
(:class:`~cbpause.testing.Traffic`).  An episode does one thing to it that the spec names -- a pause, a
withdrawn request, a stop, a fatal error -- at a point of the loop's iteration chosen with a
:class:`~cbpause.testing.StepGate`, so that the interleaving is forced, not hoped for.  ``EPISODES`` lists
them with the transitions of one rank (``(phase, action, next phase)``) each is there to take, so that a
campaign can steer toward the ones its traces have not taken yet.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from ...core import transitions as t
from ...testing import (
    HANG_S,
    StepGate,
    Traffic,
    call_interrupted,
    enter_and_leave,
    run_thread,
    wait_for_phase,
    wait_for_queued,
)

__all__ = ["EPISODES", "Killed", "RealRank", "quiet_logs"]

MAX_NEW = 12


class Killed(BaseException):
    """Not an Exception: what ends a loop's thread past transformers' ``except Exception``."""


def quiet_logs() -> None:
    """Expected faults are not news: no transformers error logs, no traceback of a thread ended by ``Killed``."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # injected faults are expected
    logging.getLogger("cbpause").setLevel(logging.CRITICAL)  # and so are the holders an episode lets die
    default_hook = threading.excepthook
    threading.excepthook = lambda a: None if issubclass(a.exc_type, Killed) else default_hook(a)


class RealRank:
    """One rank's real loop under cbpause, recorded (see the module's docstring)."""

    def __init__(self, model: Any, probe: Any, recorder: Any, *, traffic: bool, seed: int, bound: float = HANG_S,
                 peer_park_timeout: float = HANG_S, cpu_group_timeout: float | None = None):  # fmt: skip
        from ...integrations.sampling import SamplingParams
        from ...integrations.transformers import init_continuous_batching
        from ...testing import batching_config, greedy_config, random_sampling

        self.model, self.probe, self.bound = model, probe, bound
        extra = {} if cpu_group_timeout is None else {"cpu_group_timeout": cpu_group_timeout}
        self.manager = init_continuous_batching(
            model, greedy_config(MAX_NEW), batching_config(num_blocks=96, **extra),
            peer_park_timeout=peer_park_timeout, trace=recorder, max_staleness=1,  # R-STALENESS on every window
            per_request_sampling=True,  # R-SAMPLING: the traffic's requests sampled each with its own arguments
        )  # fmt: skip
        self.versions = itertools.count(1)  # the weight versions the updating holders set
        self.status = self.manager.background_thread_status
        def sampling(rng: random.Random) -> SamplingParams:
            return SamplingParams(**random_sampling(rng))

        self.traffic = Traffic(self.manager, model.config.vocab_size, MAX_NEW, seed=seed,
                               sampling=sampling) if traffic else None  # fmt: skip
        self.rng = random.Random(seed)

    def start(self) -> RealRank:
        self.manager.start()
        if self.traffic is not None:
            self.traffic.start()
        return self

    def join(self) -> None:
        """Wait for the loop's thread to end (after a stop or a failure)."""
        thread = self.manager._generation_thread
        if thread is not None:
            thread.join(self.bound)

    def restart(self) -> None:
        """Stop (if it runs), and start the same manager again: P-RESTART."""
        self.manager.stop(block=True, timeout=self.bound, keep_for_next_session=True)
        self.manager.start()

    def finish(self) -> tuple[int, int]:
        """Flush-stop the loop for good; (lost, duplicated) requests.  Raises ``TimeoutError`` if the loop does
        not stop within the bound (a hang: something still holds or awaits a pause)."""
        if self.traffic is not None:
            self.traffic.stop_feeding()
        self.manager.stop(block=True, timeout=self.bound, keep_for_next_session=True)
        if self.manager.is_running():
            raise TimeoutError(f"the loop did not stop within {self.bound} s (phase {self.status.state.phase})")
        lost_dup = self.traffic.finish() if self.traffic is not None else (0, 0)
        self.model.destroy_cached_continuous_batching_manager()
        return lost_dup

    # ------------------------------------------------------------------------------------------ holding

    def hold_at(self, phase: str) -> Callable[[], None]:
        """Hold the loop in ``phase`` (read, reduce, decided, body, step, barrier); the release."""
        if phase == "step":
            reached, release = self.probe.hold_next()
            self._reached(reached, phase)
            return release.set
        method = {"read": "end_step", "reduce": "observe", "decided": "all_reduce", "body": "no_pause"}.get(phase)
        if phase == "barrier":  # after a window: hold the loop past pause_window, before the barrier
            gate = StepGate(self.status, "pause_window", wait=self.bound)
            holder = self.pause_in_thread()
            holder.release()
        else:
            gate = StepGate(self.status, method, wait=self.bound)
        self._reached(gate.reached, phase)
        return gate.release

    def settle(self) -> None:
        """Let a running loop go round to its next Observe, so that what an episode left in flight (a window the
        loop decided to skip, a barrier) is over before the next episode sets its gates."""
        if not t.live(self.status.state):
            return
        gate = StepGate(self.status, "observe", wait=self.bound)
        if not gate.reached.wait(self.bound):
            gate.restore()
            raise TimeoutError(f"the loop did not come round to Observe within {self.bound} s")
        gate.release()

    def _reached(self, event: threading.Event, phase: str) -> None:
        if not event.wait(self.bound):
            raise TimeoutError(f"the loop never reached {phase} within {self.bound} s")

    def pause_in_thread(self) -> Holding:
        """A holder that pauses (drop-in) on a thread of its own and stays inside until released."""
        return Holding(self.manager, self.bound)


class Holding:
    """A drop-in holder inside a pause on its own thread, until :meth:`release`."""

    def __init__(self, manager: Any, bound: float):
        self.inside, self._leave = threading.Event(), threading.Event()
        self._settled = threading.Event()  # inside, or the pause failed

        def hold() -> None:
            try:
                with manager.pause(timeout=bound):
                    self.inside.set()
                    self._settled.set()
                    self._leave.wait(bound)
            finally:
                self._settled.set()

        self.thread, self.box = run_thread(hold, name="episode-holder")
        self.bound = bound

    def wait_inside(self) -> None:
        if not self._settled.wait(self.bound) or not self.inside.is_set():
            raise TimeoutError(f"the holder was not inside within {self.bound} s: {self.box}")

    def release(self) -> None:
        """Let the holder leave (it must have entered) and join its thread."""
        self.wait_inside()
        self.finish()

    def finish(self) -> None:
        """Let the holder leave if it entered, and join its thread; a pause that failed is fine."""
        self._settled.wait(self.bound)
        self._leave.set()
        self.thread.join(self.bound)


# ---------------------------------------------------------------------------------------------- episodes
# Each takes the rank and a phase (or None) and leaves the loop running, restarted if it stopped.


def holders(rank: RealRank, phase: str | None) -> None:
    """1 to 4 drop-in holders pause at once, some writing every weight inside and setting a new version (a request two
    versions behind restarts: the manager's ``max_staleness`` is 1)."""
    count = rank.rng.randint(1, 4)
    threads = []
    for _ in range(count):
        update = rank.rng.random() < 0.5

        def pause(update=update) -> None:
            with rank.manager.pause(timeout=rank.bound):
                if update:
                    import torch

                    with torch.no_grad():
                        for p in rank.model.parameters():
                            p.mul_(1.0)
                    rank.manager.set_weight_version(next(rank.versions))

        threads.append(run_thread(pause, name="episode-pause"))
    for thread, box in threads:
        thread.join(rank.bound)
        if "error" in box:
            raise box["error"]


def chain(rank: RealRank, phase: str | None) -> None:
    """Holders that take turns (R-WINDOW-CLOSES): A is inside, B enters the open window directly, A leaves (the
    window is now closing), C asks and is queued (QueuePause), D asks with no time to wait and leaves the queue
    (LeaveQueue, its TimeoutError); B leaves, which closes the window and makes C waiting: C enters the next one."""
    first = rank.pause_in_thread()
    first.wait_inside()
    second = rank.pause_in_thread()
    second.wait_inside()
    first.release()
    third = rank.pause_in_thread()
    if not wait_for_queued(rank.status, rank.bound):
        raise TimeoutError(f"the third holder was not queued at the closing window within {rank.bound} s")
    try:
        rank.status.request_and_enter_pause(mode="keep", timeout=0)
        raise AssertionError("a pause with no time to wait entered a closing window")
    except TimeoutError:
        pass  # queued, and out of the queue at once: nothing held
    second.release()
    third.release()


def request_at(rank: RealRank, phase: str) -> None:
    """A pause asked while the loop is held in ``phase`` (RequestPause there), entered once it opens."""
    release = rank.hold_at(phase)
    hold = rank.status.request_pause(rank.manager._wake_up_loop)
    release()
    rank.status.enter_pause(hold, timeout=rank.bound)
    rank.status.leave_pause(hold)


def interrupt_at(rank: RealRank, phase: str) -> None:
    """A pause asked and withdrawn while the loop is held in ``phase`` (Interrupt there)."""
    if phase == "window":
        other = rank.pause_in_thread()
        other.wait_inside()
        rank.status.interrupt(rank.status.request_pause())
        other.release()
        return
    release = rank.hold_at(phase)
    rank.status.interrupt(rank.status.request_pause())
    release()


def timeout_at(rank: RealRank, phase: str) -> None:
    """A pause that times out while the loop is held in ``phase`` (PauseTimeout there)."""
    release = rank.hold_at(phase)
    hold = rank.status.request_pause()
    try:
        rank.status.enter_pause(hold, timeout=0)
    except TimeoutError:
        pass
    finally:
        release()


def stop_at(rank: RealRank, phase: str) -> None:
    """A flush or hard stop asked while the loop is held in ``phase`` (RequestStop there), then a restart."""
    hard = rank.rng.random() < 0.5
    if phase == "window":
        other = rank.pause_in_thread()
        other.wait_inside()
        rank.status.request_stop(rank.status.HARD_STOP if hard else rank.status.FLUSH_AND_STOP)
        other.release()
    else:
        release = rank.hold_at(phase)
        rank.status.request_stop(rank.status.HARD_STOP if hard else rank.status.FLUSH_AND_STOP)
        release()
    rank.restart()


def skip_window(rank: RealRank, phase: str | None) -> None:
    """D1: the loop observed a pause asked, then the holder withdrew: it skips the window (SkipWindow)."""
    gate = StepGate(rank.status, "observe", wait=rank.bound)
    hold = rank.status.request_pause(rank.manager._wake_up_loop)
    rank._reached(gate.reached, "reduce")
    rank.status.interrupt(hold)
    gate.release()


def sigint(rank: RealRank, phase: str | None) -> None:
    """A real SIGINT to the main thread waiting for a pause on a loop held in a forward step."""
    reached, release = rank.probe.hold_next()
    rank._reached(reached, "step")
    rank.manager._wake_up_loop.clear()
    try:
        call_interrupted(lambda: enter_and_leave(rank.manager.pause(timeout=rank.bound)), rank.manager._wake_up_loop,
                         rank.bound)
    finally:
        release.set()


def fatal_at(rank: RealRank, phase: str) -> None:
    """A fatal error in the loop's own code in ``phase`` (read, body, step: RecordFatalError), with a pause
    pending that fails (PauseFails) at the reduce, the decided or the stopped phase; then a restart."""
    where = rank.rng.choice(["reduce", "decided", "stopped"])
    gates: list[StepGate] = []
    reached, go, armed = threading.Event(), threading.Event(), threading.Event()

    def fault() -> None:
        reached.set()
        go.wait(rank.bound)  # the pause is asked while the loop is here: it opens no window first
        if where != "stopped":  # the fatal-error path's all-reduce comes next: hold it there
            gates.append(StepGate(rank.status, "all_reduce", before=where == "reduce", wait=rank.bound))
        armed.set()
        raise RuntimeError(f"fault injected at {phase}")

    _fail_at(rank, phase, fault)
    rank._reached(reached, phase)
    hold = rank.status.request_pause()
    go.set()
    rank._reached(armed, phase)
    if where == "stopped":
        rank.join()
    else:
        rank._reached(gates[0].reached, where)
    try:
        rank.status.enter_pause(hold, timeout=0)
    except RuntimeError:
        pass  # P-PAUSE-FAILS
    for gate in gates:
        gate.release()
    rank.join()
    rank.restart()


def fail_at(rank: RealRank, phase: str) -> None:
    """The loop fails outside a forward step and a collective in ``phase`` (FailLoop), then a restart.  At read,
    body and step the failure is one that ends the thread (not an Exception)."""
    error = Killed(f"killed at {phase}") if phase in ("read", "body", "step") else RuntimeError(f"fault at {phase}")

    def fault() -> None:
        raise error

    if phase == "barrier":
        # The gate fails the next Barrier: this holder's window's, or that of a window still closing from the
        # last episode, in which case the loop may stop before this holder's pause (which then fails).
        StepGate(rank.status, "barrier", before=True, then=fault)
        rank.pause_in_thread().finish()
    else:
        _fail_at(rank, phase, fault)
    rank.join()
    rank.restart()


def _fail_at(rank: RealRank, phase: str, fault: Callable[[], None]) -> None:
    """Make the loop's own code call ``fault`` (which raises) in ``phase``."""
    if phase == "step":
        rank.probe.call_next = fault
        return
    method = {"read": "observe", "body": "start_step", "decided": "no_pause", "reduce": "all_reduce"}[phase]
    StepGate(rank.status, method, before=True, then=fault)


def stopped_holder(rank: RealRank, phase: str | None) -> None:
    """A pause asked on a loop that then stops: withdrawn (Interrupt) or failed (PauseFails) once stopped."""
    release = rank.hold_at("step")
    hold = rank.status.request_pause()
    rank.status.request_stop(rank.status.HARD_STOP)
    release()
    rank.join()
    wait_for_phase(rank.status, "stopped", rank.bound)
    if rank.rng.random() < 0.5:
        rank.status.interrupt(hold)
    else:
        try:
            rank.status.enter_pause(hold, timeout=0)
        except RuntimeError:
            pass
    rank.restart()


def mode_pause(rank: RealRank, mode: str) -> None:
    """A pause in ``mode`` asked while the loop is held in a forward step, so that requests are in flight at its
    decision: a drain steps them first (DrainFirst), an abort ends them, a retract frees their KV (R-MODES)."""
    reached, release = rank.probe.hold_next()
    rank._reached(reached, "step")
    rank.manager._wake_up_loop.clear()
    pause = rank.manager.pause(timeout=rank.bound, mode=mode)
    thread, box = run_thread(lambda: enter_and_leave(pause), name=f"episode-{mode}")
    asked = rank.manager._wake_up_loop.wait(rank.bound)
    release.set()
    thread.join(rank.bound)
    if not asked:
        raise TimeoutError(f"the {mode} pause did not ask within {rank.bound} s")
    if "error" in box:
        raise box["error"]


def holder_dies(rank: RealRank, where: str) -> None:
    """A holder's thread ends without leaving (P-HOLDER-DIES): ``inside`` its pause, or ``waiting`` for it (the loop
    releases it from its window, P-RELEASE-DEAD-HOLDER), or waiting for a drain asked while requests are in flight
    (``draining``: released at a drain step, the loop never parking), or waiting on a loop that then stops
    (``stopped``: the restart's clear() releases it).  Both records come where the protocol learns of the death."""
    status, wake = rank.status, rank.manager._wake_up_loop
    release = rank.hold_at("step") if where in ("stopped", "draining") else None

    def die() -> None:
        hold = status.request_pause(wake, mode="drain" if where == "draining" else "keep")
        if where == "inside":
            status.enter_pause(hold, timeout=rank.bound)
        # the thread returns holding: its pause is never left

    thread, box = run_thread(die, name=f"episode-dies-{where}")
    thread.join(rank.bound)
    if "error" in box:
        raise box["error"]
    if where == "draining":
        release()
    if where == "stopped":
        status.request_stop(status.HARD_STOP)
        release()
        rank.join()
        rank.restart()


HELD_PHASES = ("read", "reduce", "decided", "body", "step", "barrier")

# name -> (episode, phases it is played at (None: none), the transitions of one rank it is there to take)
EPISODES: dict[str, tuple[Callable[[RealRank, Any], None], tuple, Callable[[Any], set]]] = {
    "holders": (holders, (None,), lambda p: {("decided", "OpenWindow", "window"), ("window", "EnterPause", "window"),
                                             ("window", "LeavePause", "window"), ("window", "CloseWindow", "barrier")}),
    "chain": (chain, (None,), lambda p: {("window", "EnterPause", "window"), ("window", "LeavePause", "window"),
                                         ("window", "QueuePause", "window"), ("window", "LeaveQueue", "window")}),
    "request_at": (request_at, HELD_PHASES, lambda p: {(p, "RequestPause", p)}),
    "interrupt_at": (interrupt_at, (*HELD_PHASES, "window"), lambda p: {(p, "Interrupt", p)}),
    "timeout_at": (timeout_at, HELD_PHASES, lambda p: {(p, "PauseTimeout", p)}),
    "stop_at": (stop_at, (*HELD_PHASES, "window"), lambda p: {(p, "RequestStop", p), ("stopped", "Restart", "read")}),
    "skip_window": (skip_window, (None,), lambda p: {("decided", "SkipWindow", "barrier")}),
    "sigint": (sigint, (None,), lambda p: {("step", "Interrupt", "step")}),
    "fatal_at": (fatal_at, ("read", "body", "step"), lambda p: {(p, "RecordFatalError", "reduce"),
                                                                ("reduce", "PauseFails", "reduce"),
                                                                ("decided", "PauseFails", "decided"),
                                                                ("stopped", "PauseFails", "stopped")}),
    "fail_at": (fail_at, HELD_PHASES, lambda p: {(p, "FailLoop", "stopped")}),
    "stopped_holder": (stopped_holder, (None,), lambda p: {("stopped", "Interrupt", "stopped"),
                                                           ("stopped", "PauseFails", "stopped")}),
    "mode_pause": (mode_pause, ("retract", "drain", "abort"), lambda p: {("decided", "DrainFirst", "body")}
                   if p == "drain" else {("decided", "OpenWindow", "window")}),
    "holder_dies": (holder_dies, ("inside", "waiting", "draining", "stopped"), lambda p: {
        ("stopped" if p == "stopped" else "body" if p == "draining" else "window", a,
         "stopped" if p == "stopped" else "body" if p == "draining" else "window")
        for a in ("HolderDies", "ReleaseDeadHolder")}),
}  # fmt: skip
