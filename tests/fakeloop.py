"""transformers' generation loop at TP=1, reduced to its calls into the status object.

It calls exactly what ``ContinuousBatchProcessor._update_tp_group_state`` and
``ContinuousBatchingManager._run_generation_loop`` call (the drop-in API), so the same scenarios run
against ``PauseProtocol`` and against upstream's ``BackgroundThreadStatus``.  Hooks let a test stop the
loop at a chosen point of its iteration, so that interleavings are forced with events, not sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

JOIN_TIMEOUT = 10.0


class FakeLoop:
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

    def stop(self, hard: bool = False, timeout: float = JOIN_TIMEOUT) -> bool:
        """Request a stop and join; True if the loop thread ended within ``timeout``.

        The requests in flight finish in a few more steps, as they would under a flush.
        """
        self.work = min(self.work, 3)
        self.status.request_stop(self.status.HARD_STOP if hard else self.status.FLUSH_AND_STOP, 0)
        self.wake.set()
        self.thread.join(timeout)
        return not self.thread.is_alive()


def run_thread(target: Callable[[], object], name: str = "holder") -> tuple[threading.Thread, dict]:
    """Start ``target`` in a daemon thread; the dict gets ``result`` or ``error``."""
    box: dict = {}

    def wrapper():
        try:
            box["result"] = target()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc

    thread = threading.Thread(target=wrapper, name=name, daemon=True)
    thread.start()
    return thread, box
