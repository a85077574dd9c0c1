"""``python -m cbpause.soak``: a bounded soak of the protocol on transformers' real loop, with faults.

For ``--minutes`` (or ``--seconds``), with a printed seed that reproduces the choice of actions, the main
thread picks at random among: 1 to 8 holder threads pausing (some updating the weights inside), a real
SIGINT delivered to the main thread while it waits for a pause, pause timeouts, flush and hard stops
followed by restarts, fatal errors injected into the forward pass (some while a pause is pending), and
misuse that must raise (stray and double releases, ``stop()`` inside a pause, ``pause()`` from the loop
thread, bad arguments, ``clear()`` while running).  A feeder keeps requests coming and cancels some.

A watchdog fails the run when a pause, a stop or a request makes no progress within ``--bound`` seconds,
after dumping every thread's stack (``faulthandler``).  At the end every submitted request must have had
exactly one terminal output and every ``pause()`` call must have entered or raised.  The last line::

    soak: seconds=… pauses=… interrupts=… timeouts=… stops=… errors_injected=… misuse=… requests=…
          lost=0 duplicated=0 hangs=0        (on one line)

and the exit status is 1 when lost, duplicated or hangs is not 0 (or a misuse did not raise as it must).
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Interrupter", "main", "run"]


class Interrupter:
    """Delivers exactly one ``KeyboardInterrupt`` to the main thread, with real SIGINTs.

    CPython can leave a SIGINT unhandled: when it lands after the main thread released the GIL to block on
    a lock and before the block starts, the block is not interrupted, and the handler only runs when
    something else wakes the thread.  An untimed wait (upstream's) then waits for ever.  So ``fire`` sends
    SIGINT again until the handler has run, and the handler raises only the first time; the signals that
    follow it are absorbed, also after ``__exit__`` (which sends nothing more and waits for the last one).
    """

    RESEND = 0.2  # seconds between SIGINTs while the first one has not been handled

    def __init__(self):
        self.handled = threading.Event()
        self._sending = threading.Lock()
        self._previous = None

    def _handler(self, signum, frame):
        if not self.handled.is_set():
            self.handled.set()
            raise KeyboardInterrupt

    def __enter__(self) -> Interrupter:
        assert threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def fire(self, timeout: float = 10.0) -> bool:
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


# ------------------------------------------------------------------------------------------- bookkeeping


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


class Ledger:
    """Every accepted request and the terminal outputs it received."""

    def __init__(self):
        self.lock = threading.Lock()
        self.outputs: dict[str, int] = {}
        self.waiting: set[str] = set()  # accepted, no output yet: read every few ms, so kept, not scanned
        self.progress = time.monotonic()

    def submitted(self, rid: str) -> None:
        with self.lock:
            self.outputs[rid] = 0
            self.waiting.add(rid)

    def delivered(self, rid: str) -> None:
        with self.lock:
            self.outputs[rid] = self.outputs.get(rid, 0) + 1
            self.waiting.discard(rid)
            self.progress = time.monotonic()

    def open(self) -> int:
        """How many accepted requests have had no output yet."""
        with self.lock:
            return len(self.waiting)

    def lost_and_duplicated(self) -> tuple[int, int]:
        with self.lock:
            return sum(n == 0 for n in self.outputs.values()), sum(n > 1 for n in self.outputs.values())


class Watchdog:
    """Fails the run when an operation outlives its bound; dumps every thread's stack first."""

    def __init__(self, bound: float, ledger: Ledger):
        self.bound, self.ledger = bound, ledger
        self.ops: dict[int, tuple[str, float]] = {}
        self.lock = threading.Lock()
        self.hangs: list[str] = []
        self.failed = threading.Event()
        self.stopped = threading.Event()
        self.requests_expected = threading.Event()  # set while the loop should be making progress
        self.thread = threading.Thread(target=self._run, name="soak-watchdog", daemon=True)
        self._next = 0

    @contextmanager
    def op(self, name: str):
        with self.lock:
            key = self._next
            self._next += 1
            self.ops[key] = (name, time.monotonic() + self.bound)
        try:
            yield
        finally:
            with self.lock:
                self.ops.pop(key, None)

    def _hang(self, what: str) -> None:
        self.hangs.append(what)
        print(f"soak: HANG: {what}; every thread's stack follows", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        self.failed.set()

    def _run(self) -> None:
        while not self.stopped.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [name for name, deadline in self.ops.values() if deadline < now]
            if late:
                self._hang(f"{late[0]} made no progress within {self.bound} s")
                return
            if self.requests_expected.is_set() and self.ledger.open() and now - self.ledger.progress > self.bound:
                self._hang(f"no request finished within {self.bound} s while {self.ledger.open()} were open")
                return


# ------------------------------------------------------------------------------------------------- soak


class Faults:
    """Forward pre-hook: inject a fatal error, hold a forward step, or call ``pause()`` from the loop."""

    def __init__(self):
        self.fail_next = False
        self.hold: tuple[threading.Event, threading.Event] | None = None
        self.self_pause = None  # callable run once on the loop thread (D4 misuse)

    def __call__(self, module, args):
        if self.self_pause is not None:
            fn, self.self_pause = self.self_pause, None
            fn()
        if self.hold is not None:
            reached, release = self.hold
            self.hold = None
            reached.set()
            release.wait(60)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected fault in the forward pass (soak)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.soak", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float, default=None, help="how long (default 10)")
    g.add_argument("--seconds", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="replays the sequence of actions (printed); thread "
                   "timing is the machine's")  # fmt: skip
    p.add_argument("--bound", type=float, default=30.0, help="watchdog bound in seconds (default 30)")
    args = p.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else 60 * (args.minutes if args.minutes is not None else 10)
    if not seconds > 0 or not args.bound > 0:
        p.error("the duration and --bound must be > 0")
    args.duration = seconds
    if args.seed is None:
        args.seed = random.randrange(2**32)
    return args


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from .integrations.transformers import init_continuous_batching

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import logging

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # injected faults are expected
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    max_new, in_flight = 16, 8
    gen = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        use_cuda_graph=False, use_async_batching=False, num_blocks=4 * in_flight * 2 + 16, page_size=16,
        max_batch_tokens=256,
    )  # fmt: skip
    faults = Faults()
    model.register_forward_pre_hook(faults)
    manager = init_continuous_batching(model, gen, cb)
    status = manager.background_thread_status
    tally, ledger = Tally(), Ledger()
    wd = Watchdog(args.bound, ledger)
    done = threading.Event()  # no more actions and requests
    finished = threading.Event()  # the final stop has returned
    feeder_rng = random.Random(args.seed + 1)

    def consume():
        while True:
            out = manager.get_result(timeout=0.05)
            if out is not None:
                ledger.delivered(out.request_id)
            elif finished.is_set():
                return  # the final stop has returned: every output is already in the queue
            else:
                finished.wait(0.01)  # get_result returns at once while the loop is down

    def feed():
        while not done.is_set():
            if ledger.open() < in_flight:
                prompt = [feeder_rng.randrange(1, config.vocab_size) for _ in range(feeder_rng.randrange(3, 12))]
                rid = manager.add_request(prompt, max_new_tokens=feeder_rng.randrange(4, max_new + 1))
                if rid is not None:  # None: refused while stopping or stopped (upstream's contract)
                    ledger.submitted(rid)
                    tally.add("requests")
                if rid is not None and feeder_rng.random() < 0.1:
                    manager.cancel_request(rid)
                    tally.add("cancelled")
            done.wait(0.002)

    def restart():
        nonlocal manager
        wd.requests_expected.clear()
        with wd.op("stop before restart"):
            manager.stop(block=True, timeout=args.bound, keep_for_next_session=True)
        manager = init_continuous_batching(model, gen, cb)  # the cached manager, attention switched back
        with wd.op("restart"):
            manager.start()
        tally.add("restarts")
        wd.requests_expected.set()

    def pause_once(timeout: float | None = None, update: bool = False) -> str:
        """One pause() call: 'entered' or the exception's type name."""
        tally.add("pause_calls")
        try:
            with wd.op("pause"), manager.pause(timeout=timeout if timeout is not None else args.bound):
                tally.add("pauses")
                if update:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(1.0)  # an in-place write of every weight; keeps generation meaningful
            return "entered"
        except (RuntimeError, TimeoutError) as error:
            tally.add("pause_raised")
            return type(error).__name__

    def hold_step() -> threading.Event | None:
        """Hold the loop inside its next forward step; the release event, or None if the loop is idle."""
        reached, release = threading.Event(), threading.Event()
        faults.hold = (reached, release)
        if reached.wait(1.0):
            return release
        faults.hold = None
        if reached.is_set():
            return release
        return None

    # ---------------------------------------------------------------------------------------- actions

    def holders():
        updates = [rng.random() < 0.5 for _ in range(rng.randint(1, 8))]  # drawn here: the seed replays them
        results: list[str] = []
        threads = [threading.Thread(target=lambda u=u: results.append(pause_once(update=u))) for u in updates]
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.bound)
        if any(t.is_alive() for t in threads):
            wd._hang("a holder thread did not end")
        for r in results:
            if r != "entered":
                tally.wrong(f"a holder on a running loop raised {r}")

    def interrupt():
        release = hold_step()
        if release is None:
            return
        try:
            with Interrupter() as interrupter:

                def fire():
                    deadline = time.monotonic() + args.bound
                    while status.metrics().requests_waiting == 0 and time.monotonic() < deadline:
                        time.sleep(0.001)  # the main thread is about to wait: poll for its request
                    interrupter.fire(args.bound)

                sender = threading.Thread(target=fire, daemon=True)
                sender.start()
                tally.add("pause_calls")
                try:
                    with wd.op("interrupted pause"), manager.pause(timeout=args.bound):
                        tally.wrong("entered a pause on a loop held in a forward step")
                except KeyboardInterrupt:
                    tally.add("interrupts")
                    tally.add("pause_raised")
                sender.join(args.bound)
        finally:
            release.set()
        if status.metrics().requests_waiting:
            tally.wrong("an interrupted request was not withdrawn")

    def timeout():
        release = hold_step()
        if release is None:
            return
        try:
            outcome = pause_once(timeout=rng.choice([0.0, 0.005, 0.02]))
        finally:
            release.set()
        if outcome == "TimeoutError":
            tally.add("timeouts")
        else:
            tally.wrong(f"a pause on a held loop gave {outcome}, not TimeoutError")

    def stop():
        hard = rng.random() < 0.5
        wd.requests_expected.clear()
        with wd.op("hard stop" if hard else "flush stop"):
            manager.stop(block=True, timeout=args.bound, hard_stop=hard, keep_for_next_session=True)
        if manager.is_running():
            wd._hang("stop(block=True) returned with the loop still running")
        tally.add("stops")
        restart()

    def fatal():
        pending = None
        release = hold_step() if rng.random() < 0.5 else None
        if release is not None:
            outcome: list[str] = []
            pending = threading.Thread(target=lambda: outcome.append(pause_once()))
            pending.start()
            deadline = time.monotonic() + args.bound
            while status.metrics().requests_waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        faults.fail_next = True
        if release is not None:
            release.set()
        thread = manager._generation_thread
        if thread is not None:
            thread.join(min(args.bound, 5.0))  # an idle loop runs no forward step: then nothing happens
        if faults.fail_next:  # no forward step ran (idle loop): nothing was injected
            faults.fail_next = False
        else:
            tally.add("errors_injected")
        if pending is not None:
            pending.join(args.bound)
            if outcome != ["RuntimeError"]:
                tally.wrong(f"a pause pending at a fatal error gave {outcome}")
        restart()

    def misuse():
        kind = rng.choice(["stray release", "double release", "stop inside", "bad timeout", "self pause",
                           "bad stop status", "clear while running"])  # fmt: skip
        expected = ValueError if kind in ("bad timeout", "bad stop status") else RuntimeError
        try:
            if kind == "stray release":
                status.release_pause()
            elif kind == "double release":
                with manager.pause(timeout=args.bound):
                    status.release_pause()  # the context's own release is then the second one
            elif kind == "stop inside":
                with manager.pause(timeout=args.bound):
                    manager.stop(block=True)
            elif kind == "bad timeout":
                with manager.pause(timeout=rng.choice([-1.0, float("nan")])):
                    pass
            elif kind == "self pause":
                raised: list[BaseException] = []
                got = threading.Event()

                def from_loop():
                    try:
                        with manager.pause(timeout=args.bound):
                            pass
                    except BaseException as error:  # noqa: BLE001 - checked below
                        raised.append(error)
                    got.set()

                faults.self_pause = from_loop
                if got.wait(1.0):
                    if raised:
                        raise raised[0]
                    tally.wrong("pause() from the loop thread entered")
                else:
                    faults.self_pause = None
                    return  # idle loop: nothing was tried
            elif kind == "bad stop status":
                status.request_stop(7, 0)
            elif kind == "clear while running":
                status.clear()
            tally.wrong(f"misuse '{kind}' did not raise")
        except expected:
            tally.add("misuse")
        except BaseException as error:  # noqa: BLE001 - recorded as a wrong outcome
            tally.wrong(f"misuse '{kind}' raised {type(error).__name__}: {error}")

    actions = {holders: 6, interrupt: 2, timeout: 2, stop: 1, fatal: 1, misuse: 3}
    started = time.monotonic()
    consumer = threading.Thread(target=consume, name="soak-consumer", daemon=True)
    feeder = threading.Thread(target=feed, name="soak-feeder", daemon=True)
    wd.thread.start()
    manager.start()
    wd.requests_expected.set()
    consumer.start()
    feeder.start()
    try:
        while time.monotonic() - started < args.duration and not wd.failed.is_set():
            action = rng.choices(list(actions), weights=list(actions.values()))[0]
            action()
    finally:
        done.set()
        feeder.join(args.bound)
        wd.requests_expected.clear()
        with wd.op("final flush stop"):
            manager.stop(block=True, timeout=args.bound)
        finished.set()
        consumer.join(args.bound)
        wd.stopped.set()
        model.destroy_cached_continuous_batching_manager()
    lost, duplicated = ledger.lost_and_duplicated()
    c = tally.counts
    if c["pause_calls"] != c["pauses"] + c["pause_raised"]:
        tally.wrong(f"pause() calls {c['pause_calls']} != entered {c['pauses']} + raised {c['pause_raised']}")
    return {
        "seed": args.seed, "seconds": round(time.monotonic() - started, 1), "pauses": c["pauses"],
        "interrupts": c["interrupts"], "timeouts": c["timeouts"], "stops": c["stops"],
        "errors_injected": c["errors_injected"], "misuse": c["misuse"], "requests": c["requests"],
        "lost": lost, "duplicated": duplicated, "hangs": len(wd.hangs), "cancelled": c["cancelled"],
        "restarts": c["restarts"], "unexpected": list(tally.unexpected),
    }  # fmt: skip


def summary_line(r: dict) -> str:
    keys = ("seconds", "pauses", "interrupts", "timeouts", "stops", "errors_injected", "misuse", "requests", "lost",
            "duplicated", "hangs")  # fmt: skip
    return "soak: " + " ".join(f"{k}={r[k]}" for k in keys)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"soak: seed {args.seed} for {args.duration:g} s (reproduce with --seed {args.seed})", flush=True)
    result = run(args)
    print(f"soak: {result['cancelled']} requests cancelled, {result['restarts']} restarts")
    for what in result["unexpected"]:
        print(f"soak: UNEXPECTED: {what}")
    print(summary_line(result))
    bad = result["lost"] or result["duplicated"] or result["hangs"] or result["unexpected"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
