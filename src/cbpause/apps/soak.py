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
``max_staleness=2`` (R-STALENESS), and every output's ``weight_versions`` and ``kv_versions`` are checked.

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

from __future__ import annotations

import argparse
import itertools
import logging
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..testing import HANG_S, Traffic, Watchdog, call_interrupted, enter_and_leave

__all__ = ["Soak", "main", "run"]

# The kinds of event (figures of the last line) that ``--each`` goes on for until each has happened.
EACH = "pauses interrupts timeouts stops errors_injected misuse requests deaths collected handovers stops_with_timeout"


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n

    def wrong(self, what: str) -> None:
        with self.lock:
            self.unexpected.append(what)


# ------------------------------------------------------------------------------------------------- soak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.soak", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None, help="how long (default 10)")
    g.add_argument("--seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="replays the sequence of actions (printed); thread "
                   "timing is the machine's")  # fmt: skip
    p.add_argument("--bound", type=float, default=HANG_S, help="watchdog bound in seconds: a hang (default 300)")
    p.add_argument("--each", action="store_true", help="go on past the duration until every kind of event happened")
    p.add_argument("--trace-sample", type=int, default=0, metavar="K", help="record the run and have TLC "
                   "validate K of its traces (default 0)")  # fmt: skip
    p.add_argument("--tla-dir", type=Path, default=None, help="the spec's folder (default: ./tla)")
    args = p.parse_args(argv)
    if args.trace_sample < 0:
        p.error("--trace-sample must be >= 0")
    args.duration = args.seconds if args.seconds is not None else 60 * (10 if args.minutes is None else args.minutes)
    if not args.duration > 0 or not args.bound > 0:
        p.error("the duration and --bound must be > 0")
    args.seed = random.randrange(2**32) if args.seed is None else args.seed
    return args


class Soak:
    """One soak run: the real loop, a feeder and a consumer of requests, and the actions the main thread takes
    at random (one method each: :meth:`holders`, :meth:`interrupt`, :meth:`timeout`, :meth:`stop`,
    :meth:`fatal`, :meth:`misuse`), weighted by ``ACTIONS``."""

    ACTIONS = {
        "holders": 6, "interrupt": 2, "timeout": 2, "stop": 1, "fatal": 1, "misuse": 3, "death": 2, "collected": 1,
        "handover": 1, "stop_timeout": 1, "collective": 1, "chain": 2,
    }  # fmt: skip
    MODE_CHOICES = ("keep", "keep", "retract", "drain", "abort")  # keep is what most trainers ask
    MAX_NEW, IN_FLIGHT, MAX_STALENESS = 16, 8, 2  # R-STALENESS: a request 3 updates behind restarts

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers.utils import logging as hf_logging

        from ..integrations.transformers import init_continuous_batching
        from ..testing import ForwardProbe, batching_config, greedy_config, tiny_llama

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # Injected faults and holders that die are expected: quiet for the run, restored after it (run()).
        self._log_levels = {name: logging.getLogger(name).level for name in ("ContinuousBatchingLogger", "cbpause")}
        for name in self._log_levels:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.args, self.torch = args, torch
        self.rng = random.Random(args.seed)
        self.model = tiny_llama("cpu", args.seed)
        self.gen = greedy_config(self.MAX_NEW)
        self.cb = batching_config(num_blocks=4 * self.IN_FLIGHT * 2 + 16)
        self.probe = ForwardProbe()
        self.probe.attach(self.model)
        self._init = init_continuous_batching
        self.recorder = None
        if args.trace_sample:
            from ..core.recorder import TraceRecorder

            self.recorder = TraceRecorder()  # the cached manager keeps it across restarts
        self.manager = init_continuous_batching(self.model, self.gen, self.cb, trace=self.recorder,
                                                max_staleness=self.MAX_STALENESS)  # fmt: skip
        self.status = self.manager.background_thread_status
        self.tally = Tally()
        self.traffic = Traffic(
            self.manager, self.model.config.vocab_size, self.MAX_NEW, in_flight=self.IN_FLIGHT, seed=args.seed + 1,
            join_timeout=args.bound,
        )  # fmt: skip
        self.wd = Watchdog(args.bound, self.traffic.ledger)
        self._versions = itertools.count(1)  # the weight versions updates declare
        self.resume_after_death = 0.0  # the longest time from a holder's death to the release of its hold

    def restart(self) -> None:
        self.wd.requests_expected.clear()
        with self.wd.op("stop before restart"):
            self.manager.stop(block=True, timeout=self.args.bound, keep_for_next_session=True)
        self.manager = self._init(self.model, self.gen, self.cb)  # the cached manager, attention switched back
        with self.wd.op("restart"):
            self.manager.start()
        self.tally.add("restarts")
        self.wd.requests_expected.set()

    def pause_once(self, timeout: float | None = None, update: bool = False, mode: str = "keep") -> str:
        """One pause() call in ``mode``: 'entered' or the exception's type name; an update declares a new version."""
        self.tally.add("pause_calls")
        try:
            pause = self.manager.pause(timeout=timeout if timeout is not None else self.args.bound, mode=mode)
            with self.wd.op("pause"), pause:
                self.tally.add("pauses")
                self.tally.add(f"pauses_{mode}")
                if update:
                    with self.torch.no_grad():
                        for p in self.model.parameters():
                            p.mul_(1.0)  # an in-place write of every weight; keeps generation meaningful
                    self.manager.set_weight_version(next(self._versions))  # R-VERSIONS: a new version each time
                    self.tally.add("versions_set")
            return "entered"
        except (RuntimeError, TimeoutError) as error:
            self.tally.add("pause_raised")
            return type(error).__name__

    def hold_step(self) -> threading.Event | None:
        """Hold the loop inside its next forward step; the release event, or None if the loop is idle."""
        reached, release = self.probe.hold_next()
        if reached.wait(1.0):
            return release
        self.probe.hold = None
        if reached.is_set():
            return release
        release.set()  # should the loop have taken the hold just now, it goes on at once (it would wait for HANG_S)
        return None

    def requested(self) -> threading.Event:
        """An event that the next pause() sets once its request is in (the loop is held: it clears nothing)."""
        event = self.manager._wake_up_loop
        event.clear()
        return event

    # ------------------------------------------------------------------------------------- actions

    def holders(self) -> None:
        """1 to 8 threads pause at once, each in a mode, half updating the weights inside: every one must enter."""
        plans = [(self.rng.random() < 0.5, self.rng.choice(self.MODE_CHOICES)) for _ in range(self.rng.randint(1, 8))]
        results: list[str] = []
        self._run_all([lambda p=p: results.append(self.pause_once(update=p[0], mode=p[1])) for p in plans],
                      self.args.bound, "a holder thread did not end")  # fmt: skip
        for r in results:
            if r != "entered":
                self.tally.wrong(f"a holder on a running loop raised {r}")

    def _run_all(self, targets: list, bound: float, hang: str) -> None:
        """Run each of ``targets`` on a thread of its own and join them, each within ``bound`` seconds."""
        threads = [threading.Thread(target=target) for target in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(bound)
        if any(t.is_alive() for t in threads):
            self.wd.hang(hang)

    def chain(self) -> None:
        """2 or 3 threads pause in keep, each asking again the moment it leaves, so that their pauses overlap
        (R-WINDOW-CLOSES): every pause enters, and one thread's pauses take as many windows as it has pauses (a
        window admits no newcomer once a holder has left it; the chain never holds one window open)."""
        per_thread, results = 4, []
        before = self.manager.background_thread_status.metrics().windows_opened

        def run() -> None:
            results.extend(self.pause_once(mode="keep") for _ in range(per_thread))

        self._run_all([run] * self.rng.randint(2, 3), self.args.bound * per_thread, "a chaining holder did not end")
        if any(r != "entered" for r in results):
            self.tally.wrong(f"a chaining holder on a running loop raised {sorted(set(results) - {'entered'})}")
        elif self.manager.background_thread_status.metrics().windows_opened - before < per_thread:
            self.tally.wrong("a chain of pauses held one window open (R-WINDOW-CLOSES)")
        self.tally.add("chains")

    def interrupt(self) -> None:
        """The main thread waits for a pause on a loop held in a forward step and gets a real SIGINT."""
        release = self.hold_step()
        if release is None:
            return
        try:
            self.tally.add("pause_calls")
            requested = self.requested()
            with self.wd.op("interrupted pause"):
                interrupted = call_interrupted(
                    lambda: enter_and_leave(self.manager.pause(timeout=self.args.bound)), requested, self.args.bound
                )
            if interrupted:
                self.tally.add("interrupts")
                self.tally.add("pause_raised")
            else:
                self.tally.wrong("entered a pause on a loop held in a forward step")
        finally:
            release.set()
        if self.status.metrics().holders_waiting:
            self.tally.wrong("an interrupted request was not withdrawn")

    def timeout(self) -> None:
        """A pause with a short timeout on a loop held in a forward step: it must time out."""
        release = self.hold_step()
        if release is None:
            return
        try:
            outcome = self.pause_once(timeout=self.rng.choice([0.0, 0.005, 0.02]))
        finally:
            release.set()
        if outcome == "TimeoutError":
            self.tally.add("timeouts")
        else:
            self.tally.wrong(f"a pause on a held loop gave {outcome}, not TimeoutError")

    def stop(self) -> None:
        """A flush or hard stop, blocking, then a restart."""
        hard = self.rng.random() < 0.5
        self.wd.requests_expected.clear()
        with self.wd.op("hard stop" if hard else "flush stop"):
            self.manager.stop(block=True, timeout=self.args.bound, hard_stop=hard, keep_for_next_session=True)
        if self.manager.is_running():
            self.wd.hang("stop(block=True) returned with the loop still running")
        self.tally.add("stops")
        self.restart()

    def fatal(self) -> None:
        """A fatal error injected into a forward step, sometimes while a pause is pending; then a restart."""
        pending, outcome = None, []
        release = self.hold_step() if self.rng.random() < 0.5 else None
        if release is not None:
            requested = self.requested()
            pending = threading.Thread(target=lambda: outcome.append(self.pause_once()))
            pending.start()
            requested.wait(self.args.bound)
        self.probe.fail_with = RuntimeError("injected fault in the forward pass (soak)")
        if release is not None:
            release.set()
        thread = self.manager._generation_thread
        if thread is not None:
            thread.join(min(self.args.bound, 5.0))  # an idle loop runs no forward step: then nothing happens
        if self.probe.fail_with is not None:  # no forward step ran (idle loop): nothing was injected
            self.probe.fail_with = None
        else:
            self.tally.add("errors_injected")
        if pending is not None:
            pending.join(self.args.bound)
            if outcome != ["RuntimeError"]:
                self.tally.wrong(f"a pause pending at a fatal error gave {outcome}")
        self.restart()

    def collective(self) -> None:
        """The payload broadcast fails (as when a peer died) with requests in hand: each still gets its output; then a
        restart.  Not the all-reduce: on one rank that is a timeout with no peer to wait for, in no spec behaviour."""
        helper, fired = self.manager.distributed_helper, threading.Event()
        original = helper.tp_broadcast_object_from_rank_0

        def failing(payload):
            if fired.is_set():
                return original(payload)
            fired.set()
            raise RuntimeError("injected fault in the payload broadcast (soak)")

        helper.tp_broadcast_object_from_rank_0 = failing
        try:  # an iteration that drained no request fires nothing: the wait for one is bounded
            if (thread := self.manager._generation_thread) is not None:
                thread.join(min(self.args.bound, 5.0))
                thread.join(self.args.bound if fired.is_set() else 0)  # it fired: the loop must end
        finally:
            helper.tp_broadcast_object_from_rank_0 = original
        if fired.is_set():
            self.tally.add("collective_faults")
            if self.manager.is_running():
                self.wd.hang("the loop still runs after its payload broadcast failed")
        self.restart()

    def death(self) -> None:
        """A holder thread ends inside a pause (its context manager kept) or while waiting (an explicit request, or
        a drop-in acquire_pause() never released): the loop must release it, log it, and resume."""
        kind = self.rng.choice(["inside", "waiting", "drop-in"])
        kept: list = []

        def dies() -> None:
            if kind == "inside":
                cm = self.manager.pause(timeout=self.args.bound)
                cm.__enter__()
                kept.append(cm)  # referenced: neither __exit__ nor the collector will release it
            elif kind == "waiting":
                kept.append(self.status.request_pause(self.manager._wake_up_loop))
            else:
                kept.append(self.status.acquire_pause(self.manager._wake_up_loop, timeout=self.args.bound))

        try:
            thread = threading.Thread(target=dies, name=f"soak-holder-dies-{kind}")
            thread.start()
            thread.join(self.args.bound)
        except RuntimeError:  # the loop is stopping or failed: pause() refuses, nothing to release
            return
        died = time.monotonic()
        with self.wd.op(f"release of a holder that died {kind}"):
            while self.status.state.count and not self.wd.failed.is_set():
                time.sleep(0.01)  # polling a figure, not synchronising: the release is the loop's, on its clock
        self.resume_after_death = max(self.resume_after_death, time.monotonic() - died)
        if kept and getattr(kept[0], "state", "idle") != "idle":
            self.tally.wrong(f"the hold of a holder that died {kind} was not released")
        self.tally.add("deaths")

    def collected(self) -> None:
        """A pause's context manager in a reference cycle, entered by a thread that stays alive; the collector
        runs on this thread and must release the hold."""
        import gc

        entered, done = threading.Event(), threading.Event()
        outcome: list[str] = []

        def holder() -> None:
            try:
                cycle: dict = {"cm": self.manager.pause(timeout=self.args.bound)}
                cycle["self"] = cycle
                cycle["cm"].__enter__()
                del cycle  # only the collector can reach it now
                outcome.append("entered")
            except (RuntimeError, TimeoutError) as error:
                outcome.append(type(error).__name__)
            finally:
                entered.set()
            done.wait(self.args.bound)

        gc.disable()
        thread = threading.Thread(target=holder, name="soak-holder-of-a-cycle")
        try:
            thread.start()
            entered.wait(self.args.bound)
            gc.collect()
        finally:
            gc.enable()
            done.set()
            thread.join(self.args.bound)
        if outcome == ["entered"]:
            if self.status.state.inside:
                self.tally.wrong("a collected pause kept its hold")
            self.tally.add("collected")

    def handover(self) -> None:
        """A pause entered on one thread and left on another (an asyncio executor's __enter__ and __exit__)."""
        cm = self.manager.pause(timeout=self.args.bound)
        box: list = []
        enter = threading.Thread(target=lambda: box.append(self._try(cm.__enter__)), name="soak-enters")
        enter.start()
        enter.join(self.args.bound)
        if box != [None]:
            return  # the loop refused the pause (stopping): nothing held
        left: list = []
        leave = threading.Thread(target=lambda: left.append(self._try(lambda: cm.__exit__(None, None, None))),
                                 name="soak-leaves")  # fmt: skip
        leave.start()
        leave.join(self.args.bound)
        if left != [None] or self.status.state.inside:
            self.tally.wrong(f"a pause left from another thread: {left}, {self.status.state}")
        self.tally.add("handovers")

    @staticmethod
    def _try(fn) -> BaseException | None:
        try:
            fn()
        except (RuntimeError, TimeoutError) as error:
            return error
        return None

    def stop_timeout(self) -> None:
        """A stop that returns before the loop ended: blocking with a timeout while a holder is inside, or not
        blocking on a busy loop; the loop tears itself down, and no request fails for it."""
        inside, leave = threading.Event(), threading.Event()
        holder = None
        if self.rng.random() < 0.5:

            def hold() -> None:
                with self.manager.pause(timeout=self.args.bound):
                    inside.set()
                    leave.wait(self.args.bound)

            holder = threading.Thread(target=hold, name="soak-holder-at-stop")
            holder.start()
            inside.wait(self.args.bound)
        self.wd.requests_expected.clear()
        thread = self.manager._generation_thread
        with self.wd.op("stop that does not wait"):
            if holder is not None:
                self.manager.stop(block=True, timeout=0.05, hard_stop=self.rng.random() < 0.5)
            else:
                self.manager.stop(block=False, hard_stop=self.rng.random() < 0.5)
        leave.set()
        if holder is not None:
            holder.join(self.args.bound)
        with self.wd.op("the loop's own exit after a stop that returned"):
            if thread is not None:
                thread.join(self.args.bound)
        self.tally.add("stops_with_timeout")
        self.restart()

    def misuse(self) -> None:
        """One misuse of the API, drawn at random: it must raise its documented error (and change nothing)."""
        kinds = {
            "stray release": (RuntimeError, self.status.release_pause),
            "double release": (RuntimeError, self._double_release),
            "stop inside": (RuntimeError, self._stop_inside),
            "bad timeout": (ValueError, self._bad_timeout),
            "self pause": (RuntimeError, self._self_pause),
            "bad stop status": (ValueError, lambda: self.status.request_stop(7, 0)),
            "clear while running": (RuntimeError, self.status.clear),
        }
        kind = self.rng.choice(list(kinds))
        expected, act = kinds[kind]
        try:
            if act() is not False:
                self.tally.wrong(f"misuse '{kind}' did not raise")
        except expected:
            self.tally.add("misuse")
        except BaseException as error:  # noqa: BLE001 - recorded as a wrong outcome
            self.tally.wrong(f"misuse '{kind}' raised {type(error).__name__}: {error}")

    def _double_release(self) -> None:
        with self.manager.pause(timeout=self.args.bound):
            self.status.release_pause()  # the context's own release is then the second one

    def _stop_inside(self) -> None:
        with self.manager.pause(timeout=self.args.bound):
            self.manager.stop(block=True)

    def _bad_timeout(self) -> None:
        enter_and_leave(self.manager.pause(timeout=self.rng.choice([-1.0, float("nan")])))

    def _self_pause(self) -> bool | None:
        """pause() from the loop's own thread; False when the loop was idle and nothing was tried."""
        raised: list[BaseException] = []
        got = threading.Event()

        def from_loop() -> None:
            try:
                enter_and_leave(self.manager.pause(timeout=self.args.bound))
            except BaseException as error:  # noqa: BLE001 - re-raised below, on the soak's thread
                raised.append(error)
            got.set()

        self.probe.call_next = from_loop
        if not got.wait(1.0):
            self.probe.call_next = None
            return False
        if raised:
            raise raised[0]
        self.tally.wrong("pause() from the loop thread entered")
        return False

    def run(self) -> dict:
        args, wd, tally = self.args, self.wd, self.tally
        actions = [getattr(self, name) for name in self.ACTIONS]
        restarts_at_cut = 0
        started = time.monotonic()
        end = started + args.duration  # and on, however long the actions take, until the cuts (and --each) are done
        # With --trace-sample K, at least one restart in each K+1-th of the run, so that there are K+1 traces.
        cuts = [started + args.duration * (j + 1) / (args.trace_sample + 1) for j in range(args.trace_sample)]
        wd.thread.start()
        self.manager.start()
        wd.requests_expected.set()
        self.traffic.start()
        try:
            while not wd.failed.is_set() and (time.monotonic() < end or cuts or self.unseen(end + args.bound)):
                if cuts and time.monotonic() >= cuts[0]:
                    cuts.pop(0)
                    if tally.counts["restarts"] == restarts_at_cut:
                        self.stop()
                    restarts_at_cut = tally.counts["restarts"]
                    continue
                self.rng.choices(actions, weights=list(self.ACTIONS.values()))[0]()
        finally:
            self.traffic.stop_feeding()
            wd.requests_expected.clear()
            with wd.op("final flush stop"):
                self.manager.stop(block=True, timeout=args.bound)
            lost, duplicated = self.traffic.finish()
            wd.stopped.set()
            self.model.destroy_cached_continuous_batching_manager()
            for name, level in self._log_levels.items():
                logging.getLogger(name).setLevel(level)
        c = tally.counts
        torn = [e for e in self.traffic.ledger.errors if "batch processor" in e]
        if torn:
            tally.wrong(f"{len(torn)} requests failed with a torn-down batch processor: {torn[0]}")
        for fault in self.traffic.ledger.label_faults[:3]:
            tally.wrong(f"version labels: {fault}")
        if c["pause_calls"] != c["pauses"] + c["pause_raised"]:
            tally.wrong(f"pause() calls {c['pause_calls']} != entered {c['pauses']} + raised {c['pause_raised']}")
        traced = self.validate_sample() if self.recorder is not None else {}
        return traced | {
            "seed": args.seed, "seconds": round(time.monotonic() - started, 1), "pauses": c["pauses"],
            "interrupts": c["interrupts"], "timeouts": c["timeouts"], "stops": c["stops"],
            "errors_injected": c["errors_injected"], "misuse": c["misuse"], "requests": self.traffic.requests,
            "lost": lost, "duplicated": duplicated, "hangs": len(wd.hangs), "cancelled": self.traffic.ledger.cancelled,
            "restarts": c["restarts"], "unexpected": list(tally.unexpected), "deaths": c["deaths"],
            "collected": c["collected"], "handovers": c["handovers"], "stops_with_timeout": c["stops_with_timeout"],
            "resume_after_death_s": round(self.resume_after_death, 3), "collective_faults": c["collective_faults"],
            "versions": c["versions_set"], "chains": c["chains"], "stale": self.manager.versions.stale,
            "modes": "/".join(str(c[f"pauses_{m}"]) for m in self.MODE_CHOICES[1:]),
        }  # fmt: skip

    def unseen(self, deadline: float) -> list[str]:
        """With ``--each``: the kinds of event of ``EACH`` that have not happened yet (past ``deadline``, a hang)."""
        counts = dict(self.tally.counts, requests=self.traffic.requests)
        missing = [kind for kind in EACH.split() if self.args.each and not counts.get(kind)]
        if missing and time.monotonic() > deadline:
            self.wd.hang(f"--each: no {', '.join(missing)} by the end of the run and the bound after it")
            return []
        return missing

    def validate_sample(self) -> dict:
        """TLC validates ``--trace-sample`` of the run's traces (cut at its restarts), drawn with the seed."""
        from ..tlc import default_tla_dir
        from ..tlc.traces import validate_sample

        figures, problems = validate_sample(
            self.recorder, self.args.trace_sample, self.args.seed + 2, self.args.tla_dir or default_tla_dir()
        )
        for problem in problems:
            if problem.startswith("REJECTED"):
                print("soak: " + problem)
            else:
                self.tally.wrong(problem)
        return figures


def run(args: argparse.Namespace) -> dict:
    """One soak run (see :class:`Soak`); its figures as a dict."""
    return Soak(args).run()


def summary_line(r: dict) -> str:
    keys = ("seconds pauses modes versions stale chains interrupts timeouts stops errors_injected collective_faults "
            "misuse deaths collected handovers stops_with_timeout resume_after_death_s requests lost duplicated hangs"
            ).split()  # fmt: skip
    keys += ("traced", "rejected") if "traced" in r else ()
    return "soak: " + " ".join(f"{k}={r[k]}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trace_sample:
        from ..tlc import TLCError, default_tla_dir, find_jar, find_java

        try:  # before the soak, not after it: a run without TLC at the end would be wasted
            find_java(), find_jar()
            args.tla_dir = args.tla_dir or default_tla_dir()
            for needed in ("PauseProtocol.tla", "TracePauseProtocol.tla"):
                if not (args.tla_dir / needed).is_file():
                    raise TLCError(f"no {needed} in {args.tla_dir}")
        except TLCError as error:
            print(f"soak: --trace-sample needs TLC: {error}", file=sys.stderr)
            return 2
    print(f"soak: seed {args.seed} for {args.duration:g} s (reproduce with --seed {args.seed})", flush=True)
    result = run(args)
    print(f"soak: {result['cancelled']} requests cancelled, {result['restarts']} restarts")
    if "traced" in result:
        print(f"soak: {result['traced']} of {result['traces']} traces validated by TLC, {result['trace_steps']} steps, "
              f"actions: {' '.join(result['trace_actions'])}")  # fmt: skip
    for what in result["unexpected"]:
        print(f"soak: UNEXPECTED: {what}")
    print(summary_line(result))
    bad = result["lost"] or result["duplicated"] or result["hangs"] or result["unexpected"] or result.get("rejected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
