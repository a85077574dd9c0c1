"""Loops that drive a :class:`~cbpause.PauseProtocol` without a model: one rank, or a TP group in one process.

:class:`FakeLoop` is transformers' generation loop at TP=1 reduced to its calls into the status object (the
drop-in API: exactly what ``ContinuousBatchProcessor._update_tp_group_state`` and
``ContinuousBatchingManager._run_generation_loop`` call), so the same scenarios run against ``PauseProtocol``
and against upstream's ``BackgroundThreadStatus``.  Hooks let a test stop the loop at a chosen point of its
iteration, so that interleavings are forced with events, not sleeps.

:class:`Group` is a TP group of ranks in one process, each rank's loop driving the explicit loop API, the
collectives played by barriers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..core.dropin import PauseProtocol
from .threads import JOIN_TIMEOUT

__all__ = ["FakeLoop", "Group", "end_leftover_loops"]


class FakeLoop:
    """transformers' loop at TP=1, reduced to its calls into the status object (see the module)."""

    # Every loop started and not yet ended, so that the test fixture can end what a failing (or
    # xfailing) test left running: upstream's D2 leaves a loop stepping for ever, which starves
    # every later test of CPU and turns their bounded waits into failures.
    live: set[FakeLoop] = set()

    def __init__(self, status, *, work: int = 10**9, hooks: dict[str, Callable[[FakeLoop], None]] | None = None):
        self.status = status
        self.work = work  # forward steps left to do; the loop idles when it reaches 0
        self.hooks = dict(hooks or {})
        self.wake = threading.Event()
        self.stepped = threading.Event()
        self.steps = 0
        self.violations: list[str] = []
        self.error: BaseException | None = None
        self.last_observed = False
        # Tests count their holders in and out here; a step while it is positive breaks ExclusionInv.
        self.holders_inside = 0
        self.thread = threading.Thread(target=self.run, name="fake-generation-loop", daemon=True)

    def hook(self, name: str) -> None:
        fn = self.hooks.get(name)
        if fn is not None:
            fn(self)

    def start(self) -> FakeLoop:
        self.status.clear()
        FakeLoop.live.add(self)
        self.thread.start()
        return self

    def step(self) -> None:
        self.hook("step")
        if self.holders_inside > 0:
            self.violations.append(f"forward step {self.steps} while a holder is inside")
        self.steps += 1
        self.work -= 1
        self.stepped.set()

    def run(self) -> None:
        status = self.status
        try:
            while True:
                pause_requested = status.is_pause_requested()
                self.last_observed = pause_requested
                self.hook("observed")
                # TP=1: the MAX all-reduce returns this rank's own values.
                status.update_with_tp_status(status.local_status)
                if status.tp_status == status.HARD_STOP:
                    break
                if pause_requested:
                    self.hook("before_window")
                    status.pause_and_wait()
                    self.hook("after_window")
                if self.work > 0:
                    self.step()
                elif status.tp_status == status.FLUSH_AND_STOP:
                    break
                else:
                    # The loop's own idle wait (upstream waits 0.1 s for new work); not a synchronisation.
                    self.wake.wait(timeout=0.01)
                    self.wake.clear()
        except Exception as exc:  # noqa: BLE001 - the loop records whatever killed it, as upstream does
            self.error = exc
            status.request_stop(status.HARD_STOP, 0)
            status.record_fatal_error(exc)
        finally:
            status.mark_as_stopped()
            FakeLoop.live.discard(self)

    def stop(self, hard: bool = False, timeout: float = JOIN_TIMEOUT) -> bool:
        """Request a stop and join; True if the loop thread ended within ``timeout``.

        The requests in flight finish in a few more steps, as they would under a flush.
        """
        self.work = min(self.work, 3)
        self.status.request_stop(self.status.HARD_STOP if hard else self.status.FLUSH_AND_STOP, 0)
        self.wake.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()


def end_leftover_loops(timeout: float = 2.0) -> None:
    """Hard-stop every loop a test left running.

    A loop blocked for ever in upstream's untimed wait (D1, D4) cannot be ended from outside; it is a
    daemon thread that waits without using the CPU, so it is left.
    """
    for loop in list(FakeLoop.live):
        loop.work = 0
        try:
            loop.status.request_stop(loop.status.HARD_STOP, 0)
        except Exception:  # noqa: BLE001 - a status left broken by the test must not hide the rest
            pass
        loop.wake.set()
        loop.thread.join(timeout)
        FakeLoop.live.discard(loop)


class Group:
    """A TP group in one process: each rank's loop drives the explicit API; collectives are barriers.

    ``max_iterations``: after that many iterations a rank asks for a flush stop, so every run ends.
    ``fatal_at``: ``(rank, iteration)`` whose forward step raises.
    """

    def __init__(self, n: int, peer_park_timeout: float, *, trace=None, max_iterations: int | None = None,
                 fatal_at: tuple[int, int] | None = None, wait: float = JOIN_TIMEOUT):
        self.ranks = [PauseProtocol(peer_park_timeout=peer_park_timeout, trace=trace) for _ in range(n)]
        self.sent = [None] * n
        self.wait = wait
        self.reduce_barrier = threading.Barrier(n)
        self.window_barrier = threading.Barrier(n)
        self.steps = [0] * n
        self.errors: list[BaseException | None] = [None] * n
        self.windows = [0] * n
        self.max_iterations = max_iterations
        self.fatal_at = fatal_at
        self.threads = [threading.Thread(target=self.loop, args=(r,), daemon=True) for r in range(n)]

    def start(self):
        for p in self.ranks:
            p.clear()
        for th in self.threads:
            th.start()
        return self

    def collective(self, barrier: threading.Barrier) -> None:
        barrier.wait(self.wait)

    def loop(self, r: int) -> None:
        p = self.ranks[r]
        iteration = 0
        try:
            while True:
                iteration += 1
                if self.max_iterations is not None and iteration > self.max_iterations:
                    p.request_stop(p.FLUSH_AND_STOP, r)
                if p.state.phase == "read":
                    self.sent[r] = p.observe()
                else:  # a fatal error left us at the all-reduce with HARD_STOP to send
                    self.sent[r] = (p.state.obs_status, p.state.obs_pause)
                self.collective(self.reduce_barrier)
                tp_status = max(s for s, _ in self.sent)
                tp_pause = max(q for _, q in self.sent)  # the strongest mode asked, 0 for none
                self.collective(self.reduce_barrier)
                p.all_reduce(tp_status, tp_pause)
                if tp_status == p.HARD_STOP:
                    p.exit_loop()
                    return
                if tp_pause:
                    p.pause_window()
                    self.windows[r] += 1
                    self.collective(self.window_barrier)
                    p.barrier()
                else:
                    p.no_pause()
                if tp_status == p.FLUSH_AND_STOP:
                    p.exit_loop()
                    return
                p.start_step()
                if self.fatal_at == (r, iteration):
                    p.record_fatal_error(RuntimeError(f"fatal error in rank {r}'s forward step {iteration}"))
                    continue
                self.steps[r] += 1
                p.end_step()
        except threading.BrokenBarrierError as exc:
            self.errors[r] = exc
            if p.state.phase in ("reduce", "barrier"):
                p.collective_timeout(exc)
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            self.errors[r] = exc
        finally:
            for b in (self.reduce_barrier, self.window_barrier):
                if self.errors[r] is not None:
                    b.abort()
            p.mark_as_stopped()

    def join(self) -> bool:
        for th in self.threads:
            th.join(JOIN_TIMEOUT)
        return not any(th.is_alive() for th in self.threads)
