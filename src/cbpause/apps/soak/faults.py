"""The soak's episodes of faults: fatal errors in the forward pass, failed payload broadcasts, holder threads that
die or whose pause the garbage collector closes, and misuse that must raise."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ...testing import enter_and_leave

if TYPE_CHECKING:
    from .run import Soak


def fatal(soak: Soak) -> None:
    """A fatal error injected into a forward step, sometimes while a pause is pending; then a restart."""
    pending, outcome = None, []
    release = soak.hold_step() if soak.rng.random() < 0.5 else None
    if release is not None:
        requested = soak.requested()
        pending = threading.Thread(target=lambda: outcome.append(soak.pause_once()))
        pending.start()
        requested.wait(soak.args.bound)
    soak.probe.fail_with = RuntimeError("injected fault in the forward pass (soak)")
    if release is not None:
        release.set()
    thread = soak.manager._generation_thread
    if thread is not None:
        thread.join(min(soak.args.bound, 5.0))  # an idle loop runs no forward step: then nothing happens
    if soak.probe.fail_with is not None:  # no forward step ran (idle loop): nothing was injected
        soak.probe.fail_with = None
    else:
        soak.tally.add("errors_injected")
    if pending is not None:
        pending.join(soak.args.bound)
        if outcome != ["RuntimeError"]:
            soak.tally.wrong(f"a pause pending at a fatal error gave {outcome}")
    soak.restart()


def collective(soak: Soak) -> None:
    """The payload broadcast fails (as when a peer died) with requests in hand: each still gets its output; then a
    restart.  Not the all-reduce: on one rank that is a timeout with no peer to wait for, in no spec behaviour."""
    helper, fired = soak.manager.distributed_helper, threading.Event()
    original = helper.tp_broadcast_object_from_rank_0

    def failing(payload):
        if fired.is_set():
            return original(payload)
        fired.set()
        raise RuntimeError("injected fault in the payload broadcast (soak)")

    helper.tp_broadcast_object_from_rank_0 = failing
    try:  # an iteration that drained no request fires nothing: the wait for one is bounded
        if (thread := soak.manager._generation_thread) is not None:
            thread.join(min(soak.args.bound, 5.0))
            thread.join(soak.args.bound if fired.is_set() else 0)  # it fired: the loop must end
    finally:
        helper.tp_broadcast_object_from_rank_0 = original
    if fired.is_set():
        soak.tally.add("collective_faults")
        if soak.manager.is_running():
            soak.wd.hang("the loop still runs after its payload broadcast failed")
    soak.restart()


def death(soak: Soak) -> None:
    """A holder thread ends inside a pause (its context manager kept) or while waiting (an explicit request, or
    a drop-in acquire_pause() never released): the loop must release it, log it, and resume."""
    kind = soak.rng.choice(["inside", "waiting", "drop-in"])
    kept: list = []

    def dies() -> None:
        if kind == "inside":
            cm = soak.manager.pause(timeout=soak.args.bound)
            cm.__enter__()
            kept.append(cm)  # referenced: neither __exit__ nor the collector will release it
        elif kind == "waiting":
            kept.append(soak.status.request_pause(soak.manager._wake_up_loop))
        else:
            kept.append(soak.status.acquire_pause(soak.manager._wake_up_loop, timeout=soak.args.bound))

    try:
        thread = threading.Thread(target=dies, name=f"soak-holder-dies-{kind}")
        thread.start()
        thread.join(soak.args.bound)
    except RuntimeError:  # the loop is stopping or failed: pause() refuses, nothing to release
        return
    died = time.monotonic()
    with soak.wd.op(f"release of a holder that died {kind}"):
        while soak.status.state.count and not soak.wd.failed.is_set():
            time.sleep(0.01)  # polling a figure, not synchronising: the release is the loop's, on its clock
    soak.resume_after_death = max(soak.resume_after_death, time.monotonic() - died)
    if kept and getattr(kept[0], "state", "idle") != "idle":
        soak.tally.wrong(f"the hold of a holder that died {kind} was not released")
    soak.tally.add("deaths")


def collected(soak: Soak) -> None:
    """A pause's context manager in a reference cycle, entered by a thread that stays alive; the collector
    runs on this thread and must release the hold."""
    import gc

    entered, done = threading.Event(), threading.Event()
    outcome: list[str] = []

    def holder() -> None:
        try:
            cycle: dict = {"cm": soak.manager.pause(timeout=soak.args.bound)}
            cycle["self"] = cycle
            cycle["cm"].__enter__()
            del cycle  # only the collector can reach it now
            outcome.append("entered")
        except (RuntimeError, TimeoutError) as error:
            outcome.append(type(error).__name__)
        finally:
            entered.set()
        done.wait(soak.args.bound)

    gc.disable()
    thread = threading.Thread(target=holder, name="soak-holder-of-a-cycle")
    try:
        thread.start()
        entered.wait(soak.args.bound)
        gc.collect()
    finally:
        gc.enable()
        done.set()
        thread.join(soak.args.bound)
    if outcome == ["entered"]:
        if soak.status.state.inside:
            soak.tally.wrong("a collected pause kept its hold")
        soak.tally.add("collected")


def misuse(soak: Soak) -> None:
    """One misuse of the API, drawn at random: it must raise its documented error (and change nothing)."""
    kinds = {
        "stray release": (RuntimeError, soak.status.release_pause),
        "double release": (RuntimeError, lambda: _double_release(soak)),
        "stop inside": (RuntimeError, lambda: _stop_inside(soak)),
        "bad timeout": (ValueError, lambda: _bad_timeout(soak)),
        "self pause": (RuntimeError, lambda: _self_pause(soak)),
        "bad stop status": (ValueError, lambda: soak.status.request_stop(7, 0)),
        "clear while running": (RuntimeError, soak.status.clear),
    }
    kind = soak.rng.choice(list(kinds))
    expected, act = kinds[kind]
    try:
        if act() is not False:
            soak.tally.wrong(f"misuse '{kind}' did not raise")
    except expected:
        soak.tally.add("misuse")
    except BaseException as error:  # noqa: BLE001 - recorded as a wrong outcome
        soak.tally.wrong(f"misuse '{kind}' raised {type(error).__name__}: {error}")


def _double_release(soak: Soak) -> None:
    with soak.manager.pause(timeout=soak.args.bound):
        soak.status.release_pause()  # the context's own release is then the second one


def _stop_inside(soak: Soak) -> None:
    with soak.manager.pause(timeout=soak.args.bound):
        soak.manager.stop(block=True)


def _bad_timeout(soak: Soak) -> None:
    enter_and_leave(soak.manager.pause(timeout=soak.rng.choice([-1.0, float("nan")])))


def _self_pause(soak: Soak) -> bool | None:
    """pause() from the loop's own thread; False when the loop was idle and nothing was tried."""
    raised: list[BaseException] = []
    got = threading.Event()

    def from_loop() -> None:
        try:
            enter_and_leave(soak.manager.pause(timeout=soak.args.bound))
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the soak's thread
            raised.append(error)
        got.set()

    soak.probe.call_next = from_loop
    if not got.wait(1.0):
        soak.probe.call_next = None
        return False
    if raised:
        raise raised[0]
    soak.tally.wrong("pause() from the loop thread entered")
    return False


# The episodes of this kind, by the name Soak.ACTIONS weighs them with.
EPISODES = {"fatal": fatal, "collective": collective, "death": death, "collected": collected, "misuse": misuse}
