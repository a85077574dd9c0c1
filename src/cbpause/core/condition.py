"""``SafeCondition``: the protocol's lock and its waits, whose lock ownership survives an interrupt anywhere.

``threading.Condition.wait`` on a plain ``Lock`` releases the lock before its ``try:`` and takes it back in its
``finally`` through Python methods (``_release_save``, ``_acquire_restore``): a ``KeyboardInterrupt`` delivered
between those points leaves the wait without the lock, and the caller's ``with lock:`` then releases a lock this
thread does not own, the loop's, while the loop is inside (issue 26, point 1).  This condition differs in three
ways, each needed:

* its lock is a C ``RLock``, which knows its owner: releasing it from another thread raises instead of breaking
  the owner's mutual exclusion, and ``_is_owned()`` says, in one C call, whether the wait still has to take it back;
* its wait calls C functions only (no line of the standard library's Python between the release and the
  re-acquisition), and the release sits inside the ``try`` whose ``finally`` takes the lock back;
* that ``finally`` takes it back even when the exception lands in the ``finally`` itself.

The claim, tested instruction by instruction (``tests/test_interrupt_lock.py``): one asynchronous exception
(a ``KeyboardInterrupt`` from a signal handler, an exception from ``PyThreadState_SetAsyncExc``) at any instruction
of :meth:`SafeCondition.wait` leaves the wait with the lock owned by the waiter, and propagates.  A second one within
the same handful of instructions is not covered (two Ctrl-C within microseconds).  The lock is never held twice by
one thread: no method of the protocol re-enters it, and the wait releases it once.
"""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from collections.abc import Callable

__all__ = ["SafeCondition", "SafeEvent", "thread_alive"]


class SafeCondition:
    """A condition variable whose :meth:`wait` returns, or raises, with the lock owned (see the module's docstring).

    ``lock`` is the lock the protocol takes with ``with``; :meth:`wait` and :meth:`notify_all` need it owned."""

    __slots__ = ("_waiters", "lock")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._waiters: list = []

    def wait(self, timeout: float | None) -> None:
        """Release the lock, block until :meth:`notify_all` or ``timeout`` seconds (None: no limit), take the lock
        back.  Raises ``RuntimeError`` if the caller does not own the lock."""
        lock = self.lock
        if not lock._is_owned():
            raise RuntimeError("SafeCondition.wait() without owning its lock")
        waiter = allocate_lock()
        waiter.acquire()
        try:
            self._waiters.append(waiter)
            lock.release()
            waiter.acquire(True, -1 if timeout is None else timeout)
        finally:
            try:
                if not lock._is_owned():
                    lock.acquire()
            except BaseException:  # an interrupt in the finally itself: take the lock, then let it propagate
                if not lock._is_owned():
                    lock.acquire()
                raise
            finally:  # a wait that timed out or was interrupted was not notified: nobody else forgets its waiter
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``predicate()`` holds (checked under the lock); False after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.wait(remaining)
        return True

    def notify_all(self) -> None:
        """Wake every waiter (the caller owns the lock).  Each woken waiter forgets itself, under the lock, once it has
        it back; a waiter released already and not yet gone is skipped.  So an interrupt in this loop leaves the
        waiters it did not reach in the list, for the next notification or their timeout, never a waiter forgotten
        while it waits (the protocol's long waits are re-notified: ``LoopSteps.pause_window``)."""
        for waiter in self._waiters:
            if waiter.locked():  # only notifiers release, under the lock: no release of an unlocked lock
                waiter.release()


class SafeEvent:
    """``threading.Event``'s calls on a :class:`SafeCondition`: the manager's wake-up event, which holders and
    submitters set from the main thread, where ``Event.set``'s ``with self._cond:`` (Python ``__enter__`` and
    ``__exit__``) can be left by a Ctrl-C with the event's lock held, and every later ``set`` or ``wait`` (the loop's)
    then blocks for ever."""

    __slots__ = ("_condition", "_flag")

    def __init__(self) -> None:
        self._condition = SafeCondition()
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._condition.lock:
            self._flag = True
            self._condition.notify_all()

    def clear(self) -> None:
        with self._condition.lock:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        with self._condition.lock:
            return self._condition.wait_for(self.is_set, timeout)



def thread_alive(thread: threading.Thread) -> bool:
    """``thread.is_alive()`` without its hazard: on CPython 3.11 an exception that lands inside
    ``Thread._wait_for_tstate_lock`` (a Ctrl-C on the thread that asks, just after its non-blocking ``acquire``)
    runs its ``except:`` clause, which finds the lock locked -- by the live thread -- releases it and marks that live
    thread stopped for good.  This reads the same lock's state with one C call and changes nothing.  Falls back to
    ``is_alive()`` on a ``threading`` without those attributes."""
    lock = getattr(thread, "_tstate_lock", _MISSING)
    stopped = getattr(thread, "_is_stopped", None)
    if lock is _MISSING or stopped is None:
        return thread.is_alive()
    return thread._started.is_set() and not stopped and lock is not None and lock.locked()


_MISSING = object()
