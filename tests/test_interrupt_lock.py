"""A Ctrl-C never breaks the protocol's lock (issue 26, point 1).

``threading.Condition.wait`` on a plain lock can leave its caller without the lock when a ``KeyboardInterrupt``
lands between its release and its re-acquisition (both Python methods), and the caller's ``with lock:`` then releases
the loop's lock under the loop.  :class:`cbpause.core.condition.SafeCondition` replaces it.  Checked here:

* instruction by instruction: an exception raised at every instruction of ``SafeCondition.wait`` (the trace's opcode
  events, a superset of where CPython runs a signal handler, less the NOP of a ``try:`` line: see
  ``tests/test_holds.py``'s ``undeliverable``), on a wait that is notified and one that times out,
  on the main thread and a worker: the exception propagates and the waiter owns the lock;
* line by line on the real loop, CPython's own lines included: a ``KeyboardInterrupt`` at every line event of a pause
  that waits for its window, through ``pause()``, the protocol, the condition and ``threading`` (whose
  ``current_thread`` and friends the protocol calls): nothing held, the loop serves;
* the issue's reproduction: real SIGINTs at random moments on a main-thread holder, with a short switch interval.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time

import pytest

from cbpause.core import condition as cond_module
from cbpause.core.condition import SafeCondition
from cbpause.testing import HANG_S, JOIN_TIMEOUT, run_thread

from .test_holds import undeliverable

pytestmark = pytest.mark.layer("loop")

WAIT_ALL = HANG_S  # a few hundred pauses in turn, or one pause: a hang, not slowness


class Planted(BaseException):
    """The exception the trace raises (a BaseException, as KeyboardInterrupt is)."""


def wait_interrupted_at(n: int, notified: bool) -> tuple[bool, bool, bool]:
    """One ``SafeCondition.wait`` with ``Planted`` raised at its ``n``-th opcode event (1-based).  Returns (whether it
    was raised, whether it propagated, whether the waiter owned the lock afterwards)."""
    condition = SafeCondition()
    seen = 0
    fired = False
    started = threading.Event()

    def local(frame, event, arg):
        nonlocal seen, fired
        if event == "opcode" and frame.f_lasti not in undeliverable(frame.f_code):
            seen += 1
            if seen == n:
                fired = True
                raise Planted
        return local

    def on_call(frame, event, arg):
        if frame.f_code is SafeCondition.wait.__code__:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return local
        return None

    def notifier():  # takes the lock only once the waiter released it, so it never blocks the waiter's first steps
        started.wait(JOIN_TIMEOUT)
        with condition.lock:
            condition.notify_all()

    helper = threading.Thread(target=notifier, daemon=True) if notified else None
    propagated = owned = False
    condition.lock.acquire()
    if helper is not None:
        helper.start()
    sys.settrace(on_call)
    try:
        started.set()
        condition.wait(JOIN_TIMEOUT if notified else 0.001)
    except Planted:
        propagated = True
    finally:
        sys.settrace(None)
        owned = condition.lock._is_owned()
        if owned:
            condition.lock.release()
    if helper is not None:
        helper.join(JOIN_TIMEOUT)
        assert not helper.is_alive(), "the notifier never got the lock: the waiter kept or lost it"
    # Nobody else holds the lock now: another thread takes it at once.
    taker, box = run_thread(lambda: condition.lock.acquire(timeout=JOIN_TIMEOUT), name="taker")
    taker.join(JOIN_TIMEOUT)
    assert box.get("result") is True, "the lock is held by nobody that could release it"
    return fired, propagated, owned


def each_instruction(notified: bool) -> int:
    points = 0
    for n in range(1, 500):
        fired, propagated, owned = wait_interrupted_at(n, notified)
        if not fired:
            return points
        points += 1
        assert propagated, f"the exception at opcode event {n} did not propagate"
        assert owned, f"an exception at opcode event {n} left the wait without the lock"
    pytest.fail("the traced wait never ended")


@pytest.mark.parametrize("notified", [True, False], ids=["notified", "timed-out"])
def test_an_exception_at_any_instruction_of_the_wait_leaves_the_lock_owned(notified):
    assert each_instruction(notified) > 30  # the trace did reach the wait's instructions


def test_the_same_on_a_worker_thread():
    thread, box = run_thread(lambda: (each_instruction(True), each_instruction(False)), name="interrupted-waiter")
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    assert min(box["result"]) > 30


def test_wait_without_the_lock_raises_and_notify_wakes_every_waiter():
    condition = SafeCondition()
    with pytest.raises(RuntimeError, match="without owning"):
        condition.wait(0)
    woken = []

    def waiter():
        with condition.lock:
            woken.append(condition.wait_for(lambda: len(woken) >= 0 and flag.is_set(), JOIN_TIMEOUT))

    flag = threading.Event()
    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    flag.set()
    for _ in range(50):  # until every waiter is blocked or done; each notify wakes those blocked
        with condition.lock:
            condition.notify_all()
        if len(woken) == 3:
            break
        threading.Event().wait(0.01)  # gives the waiters the CPU; the assertion below, not this, decides
    for thread in threads:
        thread.join(JOIN_TIMEOUT)
    assert woken == [True, True, True]
    with condition.lock:
        assert not condition.wait_for(lambda: False, 0.01)  # the timeout
        assert condition._waiters == []  # a wait that timed out forgets its waiter


def test_the_module_uses_no_python_level_lock_method():
    """The wait calls C functions only between release and re-acquisition: no ``threading`` helper whose Python lines
    an interrupt could land in (``Condition._release_save``/``_acquire_restore`` were the defect)."""
    names = set(SafeCondition.wait.__code__.co_names)
    assert {"release", "acquire", "_is_owned"} <= names
    assert not names & {"_release_save", "_acquire_restore", "Condition"}
    assert type(SafeCondition().lock).__module__ == "_thread"  # the C RLock


# ------------------------------------------------------------------------------------------ the real loop


@pytest.fixture
def manager(plain_manager):
    plain_manager.start()
    return plain_manager


def every_line_with_cpython_traced(manager) -> int:
    """The line-level test of ``tests/test_holds.py`` with ``threading`` and the condition traced too; returns how many
    line events it interrupted."""
    from . import test_holds

    traced = test_holds.TRACED_FILES | {threading.__file__, cond_module.__file__}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_holds, "TRACED_FILES", traced)
        points = 0
        for n in range(1, 3000):
            fired, propagated = test_holds.pause_interrupted_at(manager, n)
            if not fired:
                return points
            points += 1
            assert propagated, f"the KeyboardInterrupt at line event {n} did not propagate"
            test_holds.no_hold_left(manager)
            assert not manager.background_thread_status._lock._is_owned(), n
    pytest.fail("the traced pause never ended")


def test_an_interrupt_at_any_line_of_a_waiting_pause_cpython_lines_included(manager):
    from . import test_holds

    assert every_line_with_cpython_traced(manager) > 60
    test_holds.serves(manager)


def test_the_same_on_a_worker_thread_of_the_real_loop(manager):
    from . import test_holds

    thread, box = run_thread(lambda: every_line_with_cpython_traced(manager), name="interrupted-holder")
    thread.join(WAIT_ALL)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    assert box["result"] > 60
    test_holds.serves(manager)


def test_random_sigints_on_a_main_thread_holder_never_break_the_loop(manager):
    """The issue's reproduction: a thread sends SIGINT to the main thread at random moments while it pauses again and
    again, with a short switch interval, for three seconds and on until some pauses were interrupted and some
    entered (however slow the machine).  Afterwards nothing is held and the loop, which never died, serves."""
    from . import test_holds

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    stop = threading.Event()
    rng = random.Random(26)
    sent = 0
    armed = False

    def on_sigint(signum, frame):  # one KeyboardInterrupt per pause at most: the claim covers one interrupt at a time
        nonlocal armed
        if armed:
            armed = False
            raise KeyboardInterrupt

    def sender():
        nonlocal sent
        while not stop.wait(rng.uniform(0.0005, 0.005)):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            sent += 1

    old_handler = signal.signal(signal.SIGINT, on_sigint)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    interrupted = paused = 0
    thread = threading.Thread(target=sender, name="sigint-sender", daemon=True)
    began = time.monotonic()
    try:
        thread.start()
        while time.monotonic() - began < 3.0 or not (interrupted and paused):
            if time.monotonic() - began > WAIT_ALL:
                pytest.fail(f"{interrupted} pauses interrupted and {paused} entered in {WAIT_ALL} s")
            try:
                armed = True
                with manager.pause(timeout=WAIT_ALL):
                    paused += 1
                armed = False
            except KeyboardInterrupt:
                interrupted += 1
    finally:
        armed = False
        stop.set()
        thread.join(JOIN_TIMEOUT)
        sys.setswitchinterval(old_interval)
        signal.signal(signal.SIGINT, old_handler)
    assert not thread.is_alive()
    assert sent > 0 and interrupted > 0 and paused > 0
    assert manager.background_thread_status.fatal_error is None
    assert manager.is_running()
    test_holds.no_hold_left(manager)
    test_holds.serves(manager)
