"""``python -m cbpause.apps.soak``: a bounded soak of the protocol on transformers' real loop, with faults.

For ``--minutes`` (or ``--seconds``), with a printed seed that reproduces the choice of actions, the main
thread picks at random among: 1 to 8 holder threads pausing in any mode (some updating the weights), 2 or 3
threads chaining keep pauses (each window must close, R-WINDOW-CLOSES), a real SIGINT delivered to the main
thread while it waits for a pause, pause timeouts, flush and hard stops followed by restarts, fatal errors
in the forward pass (some with a pause pending), failed broadcasts, holder threads that die inside a pause
or while waiting (the loop must release them and resume), pauses whose context manager the garbage collector
closes on another thread, pauses entered on one thread and left on another, stops whose wait times out while
a holder is inside or that do not block (no request may fail with "batch processor was not initialized"),
and misuse that must raise (stray and double releases, ``stop()`` inside a pause, ``pause()`` from the loop
thread, bad arguments, ``clear()`` while running).  A feeder keeps requests coming and cancels some; the manager has
``max_staleness=1`` and ``max_stale_restarts=1`` (R-STALENESS: ``stale`` counts the requests the bound restarted or
ended, ``stale_ended`` those it ended once their restart was spent), and every output's ``weight_versions`` and
``kv_versions`` are checked.

With ``--trace-sample K`` the run is recorded (a :class:`~cbpause.TraceRecorder`), cut at its restarts into
traces that each start from ``Init`` (:func:`~cbpause.tlc.traces.cut_at_restarts`; the soak stops and
restarts the loop at least K times for that), and K of them, drawn with the seed, are validated by TLC
against ``tla/PauseProtocol.tla``: the faults above are then checked by the spec, not only by the ledger.

With ``--each`` the run goes on past its duration until every kind of event of ``EACH`` has happened (a loaded
machine takes fewer actions in a minute).  A watchdog fails the run when a pause, a stop or a request makes no
progress within ``--bound`` seconds (a hang: 300 by default), after dumping every thread's stack
(``faulthandler``).  At the end every submitted request must have had exactly one terminal output and every
``pause()`` call must have entered or raised.  The last line::

    soak: seconds=… pauses=… modes=keep/retract/drain/abort versions=… … collective_faults=… requests=…
          lost=0 duplicated=0 hangs=0 [traced=K rejected=0]        (on one line)

and the exit status is 1 when lost, duplicated, hangs or rejected is not 0 (or a misuse did not raise as it
must, or fewer than K traces could be validated).
"""

from .run import EACH, Soak, Tally, main, parse_args, run, summary_line

__all__ = ["EACH", "Soak", "Tally", "main", "parse_args", "run", "summary_line"]
