"""Real SIGINTs for a thread waiting on the main thread: :class:`Interrupter` and :func:`call_interrupted`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

from .threads import HANG_S

__all__ = ["Interrupter", "call_interrupted"]


class Interrupter:
    """Delivers exactly one ``KeyboardInterrupt`` to the main thread, with real SIGINTs.

    CPython can leave a SIGINT unhandled: when it lands after the main thread released the GIL to block on
    a lock and before the block starts, the block is not interrupted, and the handler only runs when
    something else wakes the thread.  An untimed wait (upstream's) then waits for ever.  So :meth:`fire`
    sends SIGINT again until the handler has raised, and the handler raises only the first time, and only
    while ``armed`` (:func:`call_interrupted` arms it around the call it interrupts: a signal that lands
    before is ignored, and the next one is sent); the signals that follow are absorbed, also after
    ``__exit__`` (which sends nothing more and waits for the last one).  Use it on the main thread, as a
    context manager.
    """

    RESEND = 0.2  # seconds between SIGINTs while the first one has not been handled

    def __init__(self) -> None:
        self.armed = True
        self.handled = threading.Event()
        self._sending = threading.Lock()
        self._previous = None

    def _handler(self, signum, frame):
        if self.armed and not self.handled.is_set():
            self.handled.set()
            raise KeyboardInterrupt

    def __enter__(self) -> Interrupter:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Interrupter works on the main thread only (signals go to it)")
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def fire(self, timeout: float = HANG_S) -> bool:
        """From another thread: SIGINT the main thread until its handler ran; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._sending:
            while not self.handled.is_set():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                if self.handled.wait(self.RESEND) or time.monotonic() > deadline:
                    break
        return self.handled.is_set()

    def __exit__(self, *exc) -> None:
        self.handled.set()  # from now on the handler absorbs
        with self._sending:  # no SIGINT is sent after this
            pass
        signal.signal(signal.SIGINT, self._handler)  # a pending one lands here, absorbed
        signal.signal(signal.SIGINT, self._previous)


def call_interrupted(call: Callable[[], object], ready: threading.Event, timeout: float = HANG_S) -> bool:
    """Call ``call()`` on the main thread and interrupt it with a real SIGINT once ``ready`` is set (by
    ``call()`` itself, typically: a pause sets its ``wake_up_loop`` event once its request is in).

    Returns True if a ``KeyboardInterrupt`` ended ``call()`` (or landed just as it returned: a caller that
    must know asks the protocol, e.g. ``is_pause_requested(local=True)``), False if it returned before the
    signal came (the signal is then absorbed, never raised later).  Any other exception of ``call()``
    propagates.  The sending thread is joined within ``timeout``.
    """
    finished = threading.Event()
    with Interrupter() as interrupter:
        interrupter.armed = False

        def send() -> None:
            deadline = time.monotonic() + timeout
            while not finished.is_set() and time.monotonic() < deadline:
                if ready.wait(0.05):  # wakes to see `finished` too: call() may end without setting `ready`
                    interrupter.fire(timeout)
                    return

        sender = threading.Thread(target=send, name="interrupter", daemon=True)
        sender.start()
        try:
            interrupter.armed = True
            call()
        except KeyboardInterrupt:
            return True
        finally:
            interrupter.handled.set()  # a signal still on its way is absorbed
            finished.set()
            sender.join(timeout)
    return False
