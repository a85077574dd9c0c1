"""Probes of the holders: interrupts at the worst line, modes that escalate, holders that die, timeouts of every
type, pauses after every step, the drop-in's status and the explicit loop API under a deferred all-reduce."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time

from .support import WAIT, Wrong, _expect, _manager, _nothing_held, _outputs, _serves, _thread


def sigint_in_the_lock() -> None:
    """1: SIGINTs at random moments on a main-thread holder (short switch interval) never break the lock."""
    manager = _manager()
    armed, stop = [False], threading.Event()

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def sender():
        rng = random.Random(26)
        while not stop.wait(rng.uniform(0.0005, 0.005)):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    signal.signal(signal.SIGINT, on_sigint)
    sys.setswitchinterval(1e-5)
    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            armed[0] = True
            with manager.pause(timeout=WAIT):
                pass
            armed[0] = False
        except KeyboardInterrupt:
            pass
    armed[0] = False
    stop.set()
    thread.join(WAIT)
    sys.setswitchinterval(0.005)
    if manager.background_thread_status.fatal_error is not None:
        raise Wrong(f"the loop died: {manager.background_thread_status.fatal_error!r}")
    _nothing_held(manager)
    _serves(manager)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise Wrong(what)


def sigint_while_queued_at_a_closing_window() -> None:
    """1b (issue 40): SIGINTs at random moments on a main-thread pause that arrives at a closing window (queued,
    P-QUEUE-PAUSE), while the window closes and after: nothing is left held or queued, the loop serves."""
    from cbpause.testing import wait_for_queued

    manager = _manager()
    status = manager.background_thread_status
    armed = [False]

    def on_sigint(signum, frame):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    rng = random.Random(40)
    for _ in range(60):
        a_in, a_go, b_in, b_go = (threading.Event() for _ in range(4))

        def hold(inside: threading.Event, go: threading.Event) -> None:
            with manager.pause(timeout=WAIT):
                inside.set()
                go.wait(WAIT)

        a = _thread(lambda a_in=a_in, a_go=a_go: hold(a_in, a_go), "hostile-a")
        _check(a_in.wait(WAIT), "A never entered")
        b = _thread(lambda b_in=b_in, b_go=b_go: hold(b_in, b_go), "hostile-b")
        _check(b_in.wait(WAIT), "B never entered")
        a_go.set()
        a[0].join(WAIT)

        jitter = rng.uniform(0, 0.004)

        def closer(b_go: threading.Event = b_go, delay: float = jitter) -> None:
            wait_for_queued(status, WAIT)
            time.sleep(delay)  # a workload's jitter, not a synchronisation: where the close lands varies
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            b_go.set()

        c = _thread(closer, "hostile-closer")
        try:
            armed[0] = True
            with manager.pause(timeout=WAIT):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            armed[0] = False
            b_go.set()
        for thread, box in (b, c):
            thread.join(WAIT)
            _check(not thread.is_alive() and "error" not in box, f"a holder did not end cleanly: {box}")
        queued = status.metrics().holders_queued
        _check(queued == 0, f"{queued} holds left queued")
        _nothing_held(manager)
    _serves(manager)


def stronger_mode_behind_a_keep_chain() -> None:
    """2: two keep holders hand the window to each other; a drain pause still enters."""
    manager = _manager()
    stop = threading.Event()

    def chain():
        while not stop.is_set():
            with manager.pause(timeout=WAIT):
                stop.wait(0.01)

    threads = [_thread(chain, f"chain-{i}") for i in range(2)]
    ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
    with manager.pause(timeout=WAIT, mode="drain"):
        pass
    stop.set()
    for thread, _ in threads:
        thread.join(WAIT)
    _outputs(manager, ids)


def same_thread_escalation() -> None:
    """3: inside a keep pause the same thread asks for abort: RuntimeError at once, not a wait for ever."""
    manager = _manager()
    with manager.pause(timeout=WAIT):
        _expect(RuntimeError, lambda: manager.pause(mode="abort").__enter__(), "would wait")
    _nothing_held(manager)
    _serves(manager)


def dead_holder_in_a_drain() -> None:
    """4: a thread asks for a drain and ends while a long request runs: admission opens again during the drain."""
    manager = _manager(while_paused="reject", num_blocks=256)
    status = manager.background_thread_status
    long_id = manager.add_request([1, 2, 3], max_new_tokens=600, streaming=True)
    manager.get_result(long_id, timeout=WAIT)
    thread, _ = _thread(lambda: status.request_pause(manager._wake_up_loop, mode="drain"), "dies")
    thread.join(WAIT)
    with status._lock:
        if not status._condition.wait_for(lambda: status.state.count == 0, WAIT):
            raise Wrong("the dead holder was not released during the drain")
    short = manager.add_request([4, 5])
    while (out := manager.get_result(timeout=WAIT)) is not None and out.request_id != short:
        pass
    if out is None or long_id not in manager._live_ids:
        raise Wrong("the short request was not served while the drain's request ran")


def dead_holder_inside() -> None:
    """A holder thread that ends inside its pause: the loop releases it and serves."""
    manager = _manager()
    kept = []
    thread, _ = _thread(lambda: kept.append(manager.pause(timeout=WAIT).__enter__()), "dies-inside")
    thread.join(WAIT)
    _serves(manager)


def dead_holders_in_every_mode() -> None:
    """A holder thread that ends inside a pause of each mode: released, and the loop serves after each."""
    manager = _manager()
    kept = []
    for mode in ("keep", "retract", "drain", "abort"):
        thread, box = _thread(lambda m=mode: kept.append(manager.pause(timeout=WAIT, mode=m).__enter__()), mode)
        thread.join(WAIT)
        if "error" in box:
            raise Wrong(f"{mode}: {box['error']!r}")
        _serves(manager)


def numeric_timeouts() -> None:
    """Whatever a threading wait takes is a timeout: numpy scalars, Decimal, Fraction, inf."""
    import fractions
    from decimal import Decimal

    import numpy

    manager = _manager()
    for timeout in (numpy.float32(WAIT), Decimal(WAIT), fractions.Fraction(WAIT), float("inf")):
        with manager.pause(timeout=timeout):
            pass
    _nothing_held(manager)


def pause_after_every_step() -> None:
    """A thread pauses again the moment it leaves, for as long as 20 requests run: every request completes."""
    manager = _manager(max_new=16)
    ids = [manager.add_request([1 + i % 5, 2, 3]) for i in range(20)]
    stop, pauses = threading.Event(), [0]

    def pauser():
        while not stop.is_set():
            with manager.pause(timeout=WAIT):
                pauses[0] += 1

    thread, box = _thread(pauser, "pauser")
    try:
        _outputs(manager, ids)
    finally:
        stop.set()
        thread.join(WAIT)
    if "error" in box or pauses[0] < 5:  # about one pause per forward step (R-WINDOW-CLOSES)
        raise Wrong(f"{pauses[0]} pauses; {box.get('error')!r}")


def deferred_all_reduce_under_explicit_steps() -> None:
    """A loop that reports its all-reduce through the drop-in API, then steps explicitly (PauseProtocol's
    deferred state, apart from RankProtocol since issue 27): a step its guard refuses changes nothing, the
    deferred all-reduce included; a failure then ends a holder's wait at once."""
    from cbpause import PauseProtocol

    status = PauseProtocol(peer_park_timeout=WAIT)
    box: dict = {}

    def loop() -> None:
        status.is_pause_requested()  # Observe, from this thread: the loop's
        status.update_with_tp_status(PauseProtocol.DONT_STOP)  # deferred until a step shows the decision
        before = status.state
        try:
            status.open_window()  # no holder: refused
        except RuntimeError:
            box["refused"] = status.state is before and status.tp_status == PauseProtocol.DONT_STOP
        status.no_pause()  # the deferred AllReduce (no pause), then NoPause
        box["body"] = status.state.phase
        status.fail_loop(RuntimeError("injected"))

    thread, ended = _thread(loop, "mixed-loop")
    thread.join(WAIT)
    if "error" in ended or thread.is_alive() or box != {"refused": True, "body": "body"}:
        raise Wrong(f"the mixed loop: {box}, {ended}")
    _expect(RuntimeError, lambda: status.acquire_pause(timeout=WAIT), "Cannot pause")


def dropin_status_before_mark_as_stopped() -> None:
    """14: after a hard stop and a fatal error, local_status reads STOPPED only once the loop says so."""
    from cbpause import PauseProtocol

    status = PauseProtocol()
    status.request_stop(PauseProtocol.HARD_STOP)
    status.record_fatal_error(RuntimeError("boom"))
    if status.local_status != PauseProtocol.HARD_STOP:
        raise Wrong(f"local_status {status.local_status} before mark_as_stopped")
    status.mark_as_stopped()
    if status.local_status != PauseProtocol.STOPPED:
        raise Wrong(f"local_status {status.local_status} after mark_as_stopped")
