"""The soak's episodes of holders and stops: many holders at once, chains of keep pauses (R-WINDOW-CLOSES), real
SIGINTs, pause timeouts, flush and hard stops, pauses entered on one thread and left on another, stops that do not
wait."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ...testing import call_interrupted, enter_and_leave, run_thread, wait_for_queued

if TYPE_CHECKING:
    from .run import Soak


def holders(soak: Soak) -> None:
    """1 to 8 threads pause at once, each in a mode, half updating the weights inside: every one must enter."""
    plans = [(soak.rng.random() < 0.5, soak.rng.choice(soak.MODE_CHOICES)) for _ in range(soak.rng.randint(1, 8))]
    results: list[str] = []
    soak._run_all([lambda p=p: results.append(soak.pause_once(update=p[0], mode=p[1])) for p in plans],
                  soak.args.bound, "a holder thread did not end")  # fmt: skip
    for r in results:
        if r != "entered":
            soak.tally.wrong(f"a holder on a running loop raised {r}")


def chain(soak: Soak) -> None:
    """2 or 3 threads pause in keep, each asking again the moment it leaves, so that their pauses overlap
    (R-WINDOW-CLOSES): every pause enters, and one thread's pauses take as many windows as it has pauses (a
    window admits no newcomer once a holder has left it; the chain never holds one window open)."""
    per_thread, results = 4, []
    before = soak.manager.background_thread_status.metrics().windows_opened

    def run() -> None:
        results.extend(soak.pause_once(mode="keep") for _ in range(per_thread))

    soak._run_all([run] * soak.rng.randint(2, 3), soak.args.bound * per_thread, "a chaining holder did not end")
    if any(r != "entered" for r in results):
        soak.tally.wrong(f"a chaining holder on a running loop raised {sorted(set(results) - {'entered'})}")
    elif soak.manager.background_thread_status.metrics().windows_opened - before < per_thread:
        soak.tally.wrong("a chain of pauses held one window open (R-WINDOW-CLOSES)")
    soak.tally.add("chains")
    _queued_at_a_closing_window(soak)


def _queued_at_a_closing_window(soak: Soak) -> None:
    """A is inside, B enters the open window, A leaves (closing), C asks and is queued (P-QUEUE-PAUSE), B leaves:
    the close makes C waiting, and C enters the next window (issue 40, point 3)."""
    status, bound = soak.manager.background_thread_status, soak.args.bound
    events = [threading.Event() for _ in range(4)]  # A inside, A may leave, B inside, B may leave

    def hold(inside: threading.Event, leave: threading.Event) -> str:
        with soak.manager.pause(timeout=bound):
            inside.set()
            leave.wait(bound)
        return "entered"

    a = run_thread(lambda: hold(events[0], events[1]), "soak-queue-a")
    b = c = None
    try:
        if not events[0].wait(bound):
            return
        b = run_thread(lambda: hold(events[2], events[3]), "soak-queue-b")
        if not events[2].wait(bound):
            return
        events[1].set()
        a[0].join(bound)
        c = run_thread(lambda: soak.pause_once(mode="keep"), "soak-queue-c")
        if not wait_for_queued(status, bound):
            soak.tally.wrong("a pause at a closing window was not queued")
            return
        soak.tally.add("queued")
    finally:
        for event in events[1::2]:
            event.set()
        for started in (a, b, c):
            if started is not None:
                started[0].join(bound)
                if started[0].is_alive():
                    soak.tally.wrong("a holder at a closing window did not end")
                elif started[1].get("result") != "entered":
                    soak.tally.wrong(f"a holder at a closing window ended with {started[1]}")


def interrupt(soak: Soak) -> None:
    """The main thread waits for a pause on a loop held in a forward step and gets a real SIGINT."""
    release = soak.hold_step()
    if release is None:
        return
    try:
        soak.tally.add("pause_calls")
        requested = soak.requested()
        with soak.wd.op("interrupted pause"):
            interrupted = call_interrupted(
                lambda: enter_and_leave(soak.manager.pause(timeout=soak.args.bound)), requested, soak.args.bound
            )
        if interrupted:
            soak.tally.add("interrupts")
            soak.tally.add("pause_raised")
        else:
            soak.tally.wrong("entered a pause on a loop held in a forward step")
    finally:
        release.set()
    if soak.status.metrics().holders_waiting:
        soak.tally.wrong("an interrupted request was not withdrawn")


def timeout(soak: Soak) -> None:
    """A pause with a short timeout on a loop held in a forward step: it must time out."""
    release = soak.hold_step()
    if release is None:
        return
    try:
        outcome = soak.pause_once(timeout=soak.rng.choice([0.0, 0.005, 0.02]))
    finally:
        release.set()
    if outcome == "TimeoutError":
        soak.tally.add("timeouts")
    else:
        soak.tally.wrong(f"a pause on a held loop gave {outcome}, not TimeoutError")


def stop(soak: Soak) -> None:
    """A flush or hard stop, blocking, then a restart."""
    hard = soak.rng.random() < 0.5
    soak.wd.requests_expected.clear()
    with soak.wd.op("hard stop" if hard else "flush stop"):
        soak.manager.stop(block=True, timeout=soak.args.bound, hard_stop=hard, keep_for_next_session=True)
    if soak.manager.is_running():
        soak.wd.hang("stop(block=True) returned with the loop still running")
    soak.tally.add("stops")
    soak.restart()


def handover(soak: Soak) -> None:
    """A pause entered on one thread and left on another (an asyncio executor's __enter__ and __exit__)."""
    cm = soak.manager.pause(timeout=soak.args.bound)
    box: list = []
    enter = threading.Thread(target=lambda: box.append(_try(cm.__enter__)), name="soak-enters")
    enter.start()
    enter.join(soak.args.bound)
    if box != [None]:
        return  # the loop refused the pause (stopping): nothing held
    left: list = []
    leave = threading.Thread(target=lambda: left.append(_try(lambda: cm.__exit__(None, None, None))),
                             name="soak-leaves")  # fmt: skip
    leave.start()
    leave.join(soak.args.bound)
    if left != [None] or soak.status.state.inside:
        soak.tally.wrong(f"a pause left from another thread: {left}, {soak.status.state}")
    soak.tally.add("handovers")


def stop_timeout(soak: Soak) -> None:
    """A stop that returns before the loop ended: blocking with a timeout while a holder is inside, or not
    blocking on a busy loop; the loop tears itself down, and no request fails for it."""
    inside, leave = threading.Event(), threading.Event()
    holder = None
    if soak.rng.random() < 0.5:

        def hold() -> None:
            with soak.manager.pause(timeout=soak.args.bound):
                inside.set()
                leave.wait(soak.args.bound)

        holder = threading.Thread(target=hold, name="soak-holder-at-stop")
        holder.start()
        inside.wait(soak.args.bound)
    soak.wd.requests_expected.clear()
    thread = soak.manager._generation_thread
    with soak.wd.op("stop that does not wait"):
        if holder is not None:
            soak.manager.stop(block=True, timeout=0.05, hard_stop=soak.rng.random() < 0.5)
        else:
            soak.manager.stop(block=False, hard_stop=soak.rng.random() < 0.5)
    leave.set()
    if holder is not None:
        holder.join(soak.args.bound)
    with soak.wd.op("the loop's own exit after a stop that returned"):
        if thread is not None:
            thread.join(soak.args.bound)
    soak.tally.add("stops_with_timeout")
    soak.restart()


def _try(fn) -> BaseException | None:
    try:
        fn()
    except (RuntimeError, TimeoutError) as error:
        return error
    return None


# The episodes of this kind, by the name Soak.ACTIONS weighs them with.
EPISODES = {
    "holders": holders, "chain": chain, "interrupt": interrupt, "timeout": timeout, "stop": stop, "handover": handover,
    "stop_timeout": stop_timeout,
}  # fmt: skip
