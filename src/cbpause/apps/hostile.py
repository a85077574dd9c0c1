"""``python -m cbpause.apps.hostile`` (``nox -s hostile``): the hostile users' probes, each in its own process with a
deadline, classified and printed as a table.

Each probe is a hostile use of cbpause on transformers' real loop (tiny random Llama, CPU) that once hung, crashed,
answered with the wrong error, went wrong silently or lost a request (issues 13, 26, 27, 28).  A probe returns when
the library did the right thing; otherwise it raises one of :class:`Wrong`, :class:`Silent` or :class:`Lost`, and a
probe that outlives its deadline is killed and reported ``HANG``.  Any other exception is ``WRONG ERROR``.  The run
exits 0 only when every probe printed ``OK``.  Keep it growing: every hostile case found later joins :data:`PROBES`.

``--only NAME`` (repeatable) runs some; ``--deadline S`` changes the per-probe deadline (default ``HANG_S``, 300 s).
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..testing import HANG_S

WAIT = HANG_S  # the bound on what must happen (an output, a pause, a thread's end): a hang, not slowness


class Wrong(AssertionError):
    """The library answered, but not as it must (WRONG ERROR)."""


class Silent(AssertionError):
    """The library accepted something and went wrong without a word (SILENT)."""


class Lost(AssertionError):
    """A request got no terminal output, or two (LOST)."""


VERDICTS = {Wrong: "WRONG ERROR", Silent: "SILENT", Lost: "LOST"}


# ------------------------------------------------------------------------------------------------ helpers


def _manager(max_new: int = 8, **options):
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    config = {k: options.pop(k) for k in list(options) if k in ("max_queue_size", "num_blocks")}
    manager = cbt.init_continuous_batching(tiny_llama(), greedy_config(max_new), batching_config(**config), **options)
    manager.start()
    return manager


def _outputs(manager, ids: list[str]) -> dict:
    """One terminal output per id, or Lost."""
    outs: dict = {}
    while len(outs) < len(ids):
        out = manager.get_result(timeout=WAIT)
        if out is None:
            raise Lost(f"no output within {WAIT} s; have {len(outs)} of {len(ids)}")
        if out.is_finished():
            if out.request_id in outs:
                raise Lost(f"two terminal outputs for {out.request_id}")
            outs[out.request_id] = out
    if sorted(outs) != sorted(ids):
        raise Lost(f"outputs for {sorted(set(outs) - set(ids))}, none for {sorted(set(ids) - set(outs))}")
    return outs


def _serves(manager, n: int = 2) -> None:
    outs = _outputs(manager, [manager.add_request([1, 2, 3]) for _ in range(n)])
    if any(o.error for o in outs.values()):
        raise Wrong(f"the loop no longer serves: {[o.error for o in outs.values()]}")


def _expect(error: type[BaseException], call: Callable[[], object], match: str = "") -> BaseException:
    try:
        call()
    except error as caught:
        if match not in str(caught):
            raise Wrong(f"{error.__name__} without {match!r}: {caught}") from caught
        return caught
    except BaseException as other:
        raise Wrong(f"{type(other).__name__} instead of {error.__name__}: {other}") from other
    raise Silent(f"no {error.__name__}")


def _nothing_held(manager) -> None:
    s = manager.background_thread_status.state
    if s.count or not manager.is_running():
        raise Wrong(f"after the probe: {s.count} holds, loop running: {manager.is_running()}")


def _thread(target: Callable[[], object], name: str) -> tuple[threading.Thread, dict]:
    from cbpause.testing import run_thread

    return run_thread(target, name=name)


# ------------------------------------------------------------------------------------------------ issue 26


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


def iterators_inside_ones_pause() -> None:
    """5: request_id_iter and iter(manager) inside one's own pause raise instead of waiting for ever."""
    manager = _manager()
    rid = manager.add_request([1, 2, 3])
    for make in (lambda: manager.request_id_iter(rid), lambda: iter(manager)):
        with manager.pause(timeout=WAIT):
            try:
                for out in make():
                    if out.is_finished() and out.request_id == rid:
                        break
            except RuntimeError as error:
                if "inside a pause" not in str(error):
                    raise Wrong(str(error)) from error


def add_requests_all_or_nothing() -> None:
    """6: a pause asked while add_requests enqueues (reject mode): the whole batch goes in, every output comes."""
    manager = _manager(while_paused="reject", num_blocks=512, max_new=4)
    status, enqueue, holds = manager.background_thread_status, manager.enqueue, []

    def enqueue_then_pause(*args, **kwargs):
        if len(manager._live_ids) == 100 and not holds:
            holds.append(status.request_pause(manager._wake_up_loop))
        return enqueue(*args, **kwargs)

    manager.enqueue = enqueue_then_pause
    ids = manager.add_requests([[1 + i % 7, 2, 3] for i in range(400)])
    status.interrupt(holds[0])
    _outputs(manager, ids)


def bad_weight_versions() -> None:
    """7: a tensor or NaN version is refused; the loop lives."""
    import torch

    manager = _manager()
    ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
    with manager.pause(timeout=WAIT):
        for version in (torch.tensor([1, 2]), float("nan")):
            _expect(TypeError, lambda v=version: manager.set_weight_version(v))
    _outputs(manager, ids)
    _serves(manager)


def weights_changed_not_a_bool() -> None:
    """8: pause(weights_changed=None) is refused, not read as "unchanged"."""
    manager = _manager()
    for value in (None, 0, "no"):
        _expect(TypeError, lambda v=value: manager.pause(weights_changed=v).__enter__(), "weights_changed")
    _nothing_held(manager)


def max_new_tokens_none() -> None:
    """9: max_new_tokens=None in the generation config: the request stops at EOS, as upstream."""
    from cbpause.integrations import transformers as cbt
    from cbpause.testing import batching_config, greedy_config, tiny_llama

    model = tiny_llama()
    first = cbt.init_continuous_batching(model, greedy_config(8), batching_config())
    first.start()
    eos = _outputs(first, [first.add_request([1, 2, 3])])
    first.stop(block=True, timeout=WAIT)
    config = greedy_config(8)
    config.max_new_tokens, config.eos_token_id = None, next(iter(eos.values())).generated_tokens[2]
    manager = cbt.init_continuous_batching(model, config, batching_config())
    manager.start()
    (out,) = _outputs(manager, [manager.add_request([1, 2, 3])]).values()
    if out.error:
        raise Wrong(out.error)


def retract_keeps_metadata() -> None:
    """10: a retracted request keeps its timestamps, created time and lifespan."""
    manager = _manager(max_new=24)
    ids = [manager.add_request([i, 2, 3], record_timestamps=True) for i in range(1, 4)]
    with manager.pause(timeout=WAIT, mode="retract"):
        pass
    for out in _outputs(manager, ids).values():
        if out.timestamps is None or len(out.timestamps) != len(out.generated_tokens):
            raise Silent(f"{len(out.timestamps or [])} timestamps for {len(out.generated_tokens)} tokens")


def full_queue_inside_ones_pause() -> None:
    """11: a bounded input queue full inside one's own pause: queue.Full at once, not after 10 s (its message says it
    is cbpause's refusal, made before any put: upstream's put waits 10 s under the submit lock, then raises an empty
    one)."""
    manager = _manager(max_queue_size=2)
    with manager.pause(timeout=WAIT):
        ids = [manager.add_request([1, 2, 3]) for _ in range(2)]
        _expect(queue.Full, lambda: manager.add_request([1, 2, 3]), "inside a pause")
    _outputs(manager, ids)


def float64_lm_head() -> None:
    """13: a float64 lm_head swapped in inside a pause: a clear error naming it, the request failed, not lost."""
    import torch

    manager = _manager()
    model = manager.model
    head = model.lm_head
    with manager.pause(timeout=WAIT):
        model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.float64)
    rid = manager.add_request([1, 2, 3])
    manager._generation_thread.join(WAIT)
    _outputs(manager, [rid])
    error = manager.background_thread_status.fatal_error
    if error is None or "lm_head.weight" not in str(error):
        raise Wrong(f"the loop's error does not name the parameter: {error!r}")


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


# ------------------------------------------------------------------------------------------------ issue 13


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


def exit_without_stop() -> None:
    """A script that ends without stop(), requests in flight: the interpreter exits (atexit hard stop)."""
    script = (
        "from cbpause.integrations import transformers as cbt\n"
        "from cbpause.testing import batching_config, greedy_config, tiny_llama\n"
        "m = cbt.init_continuous_batching(tiny_llama(), greedy_config(400), batching_config(num_blocks=256))\n"
        "m.start()\n"
        "ids = [m.add_request([1, 2, 3]) for _ in range(3)]\n"
        "print('submitted', len(ids), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT)
    if "submitted 3" not in done.stdout:
        raise Wrong(f"the script failed: {done.stderr[-300:]}")


def stop_without_blocking_keeps_requests() -> None:
    """stop(block=False) while requests run: they finish; nothing is torn down under the loop."""
    manager = _manager(max_new=24)
    ids = [manager.add_request([1, 2, 3]) for _ in range(4)]
    manager.stop(block=False)
    for out in _outputs(manager, ids).values():
        if out.error:
            raise Wrong(f"a flush stop failed a request: {out.error}")


def bad_requests_at_the_door() -> None:
    """Bad prompts and a duplicate id are refused at the door; the others are served."""
    manager = _manager()
    for prompt, error in (([], ValueError), ([10**9], ValueError), ("abc", TypeError), ([1.5], TypeError)):
        _expect(error, lambda p=prompt: manager.add_request(p))
    with manager.pause(timeout=WAIT):
        manager.add_request([1, 2], request_id="mine")
        _expect(ValueError, lambda: manager.add_request([1, 2], request_id="mine"), "in use")
    _outputs(manager, ["mine"])
    _serves(manager)


def many_holders_many_requests() -> None:
    """50 holder threads pausing while 200 requests run: nothing lost."""
    manager = _manager()
    ids = [manager.add_request([1 + i % 9, 2]) for i in range(200)]

    def hold():
        for _ in range(3):
            with manager.pause(timeout=WAIT):
                pass

    threads = [_thread(hold, f"holder-{i}") for i in range(50)]
    for thread, box in threads:
        thread.join(WAIT)
        if "error" in box:
            raise Wrong(repr(box["error"]))
    _outputs(manager, ids)


def start_stop_cycles() -> None:
    """20 start/stop cycles with a request each: every one answered."""
    manager = _manager()
    for _ in range(20):
        _outputs(manager, [manager.add_request([1, 2, 3])])
        manager.stop(block=True, timeout=WAIT)
        manager.start()


# ------------------------------------------------------------------------------------------------ issue 27


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


# ------------------------------------------------------------------------------------------------ issue 28


def weight_sync_misuse() -> None:
    """TRL's weight transfer misused: a second pause, a copy or a resume outside one, a bad name after a good one, a
    KeyboardInterrupt in the middle of a copy, destroy twice, a pause of a stopped loop.  Each raises at once and
    holds nothing; a half-done copy labels the weights ``PartialSync``, never a policy's number."""
    from cbpause.integrations.trl import PartialSync, PauseWeightSync

    manager = _manager()
    params = dict(manager.model.named_parameters())
    names = list(params)
    sync = PauseWeightSync(manager, timeout=WAIT)
    _expect(RuntimeError, lambda: sync.send_weights([]), "outside pause()")
    _expect(RuntimeError, sync.resume, "without pause()")
    sync.pause()
    _expect(RuntimeError, sync.pause, "holds a pause already")
    _expect(KeyError, lambda: sync.send_weights([(names[0], params[names[0]]), ("ghost", params[names[1]])]), "ghost")
    if manager.weight_version != PartialSync(1):
        raise Silent(f"a half-done copy left the version {manager.weight_version!r}")

    def interrupted():
        yield names[0], params[names[0]].detach().clone()
        raise KeyboardInterrupt

    _expect(KeyboardInterrupt, lambda: sync.send_weights(interrupted()))
    sync.destroy()
    sync.destroy()  # nothing held: a no-op
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)
    _expect(RuntimeError, PauseWeightSync(manager, timeout=WAIT).pause, "no generation loop")


def stale_requests_in_every_mode() -> None:
    """``max_staleness=0``: every window that sets a new version makes every request in flight stale, in every mode,
    while requests keep coming.  Each gets one terminal output; a finished one carries one version on all its tokens
    (it restarted at the last), and all its tokens."""
    manager = _manager(max_new=12, max_staleness=0)
    ids = [manager.add_request([1, 2, 3 + i % 5]) for i in range(12)]
    for version, mode in enumerate(("keep", "retract", "drain", "abort", "keep", "retract"), 1):
        with manager.pause(timeout=WAIT, mode=mode):
            manager.set_weight_version(version)
        ids.append(manager.add_request([4, 5, 6]))
    for request_id, out in _outputs(manager, ids).items():
        if out.error:
            if "aborted by a pause" not in out.error:
                raise Wrong(f"{request_id}: {out.error}")
            continue
        if len(out.generated_tokens) != 12 or len({v for _, v in out.weight_versions + out.kv_versions}) != 1:
            raise Silent(f"{request_id}: {len(out.generated_tokens)} tokens, {out.weight_versions}, {out.kv_versions}")
    if manager.versions.stale == 0:
        raise Wrong("no request was ever stale: the probe did not reach the bound")
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)


def leases_under_races() -> None:
    """Leases over HTTP (issue 29): 40 threads resume one lease at once (exactly one resumes it); resumes and writes
    racing a lease's expiry (honoured before, refused after, never both; a write under way keeps its lease); a
    lease_id of the wrong type; 30 leases taken and ended at once.  At the end nothing is held and the loop serves."""
    from fastapi.testclient import TestClient

    from ..serve import control
    from ..serve.leases import LeaseGone, LeaseTable

    manager = _manager()
    table = LeaseTable(manager, default_ttl=WAIT)  # no lease but the racing ones may expire, however slow the machine
    lease, answers = table.pause_lease(holder="racer"), []
    threads = [_thread(lambda: answers.append(table.resume_lease(lease.id)), f"resumer-{i}")[0] for i in range(40)]
    for thread in threads:
        thread.join(timeout=WAIT)
    if sorted(answers) != [False] * 39 + [True]:
        raise Wrong(f"40 resumes of one lease answered {sorted(answers)}")
    for attempt in range(30):  # a resume or a write racing the expiry: honoured before, refused after, never both
        ttl = 0.005 + 0.001 * attempt
        lease = table.pause_lease(ttl=ttl, holder="racer")
        try:
            if attempt % 2:
                with table.write_weights(lease.id):
                    time.sleep(2 * ttl)  # past the deadline: a write under way keeps its lease
                    if lease.state != "held":
                        raise Silent(f"the lease ended ({lease.state}) during a write under it")
            elif table.resume_lease(lease.id) and lease.state != "resumed":
                raise Silent(f"a resume answered True, the lease is {lease.state}")
        except LeaseGone:
            if lease.state != "expired":
                raise Wrong(f"LeaseGone for a lease that is {lease.state}") from None
        table.resume_lease(lease.id) if lease.state == "held" else None
    app = __import__("fastapi").FastAPI()
    control._weight_routes(app, manager, table, None)
    with TestClient(app) as http:
        for bad in (123, ["x"], None):
            status = http.post("/update_weight_version", json={"lease_id": bad, "weight_version": 1}).status_code
            if status not in (404, 409):
                raise Wrong(f"lease_id={bad!r} got {status}")
    many = [_thread(lambda: table.resume_lease(table.pause_lease(holder="many").id), f"many-{i}")[0] for i in range(30)]
    for thread in many:
        thread.join(timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while manager.background_thread_status.state.count and time.monotonic() < deadline:
        time.sleep(0.05)  # the expired leases' holds are released by the loop (HOLDER_CHECK_S)
    _nothing_held(manager)
    _serves(manager)
    manager.stop(block=True, timeout=WAIT)


PROBES: dict[str, Callable[[], None]] = {
    f.__name__: f
    for f in (
        sigint_in_the_lock, stronger_mode_behind_a_keep_chain, same_thread_escalation, dead_holder_in_a_drain,
        iterators_inside_ones_pause, add_requests_all_or_nothing, bad_weight_versions, weights_changed_not_a_bool,
        max_new_tokens_none, retract_keeps_metadata, full_queue_inside_ones_pause, float64_lm_head,
        dropin_status_before_mark_as_stopped, dead_holder_inside, stop_without_blocking_keeps_requests,
        bad_requests_at_the_door, many_holders_many_requests, start_stop_cycles, dead_holders_in_every_mode,
        numeric_timeouts, pause_after_every_step, exit_without_stop, deferred_all_reduce_under_explicit_steps,
        weight_sync_misuse, stale_requests_in_every_mode, leases_under_races,
    )
}  # fmt: skip


def run_probe(name: str) -> int:
    """In the probe's own process: run it, print its verdict on the last line."""
    import logging

    for noisy in ("cbpause", "ContinuousBatchingLogger", "transformers"):  # expected faults are not news
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    try:
        PROBES[name]()
        verdict, why = "OK", ""
    except (Wrong, Silent, Lost) as error:
        verdict, why = VERDICTS[type(error)], str(error)
    except BaseException as error:  # noqa: BLE001 - the verdict says what it was
        verdict, why = "WRONG ERROR", f"{type(error).__name__}: {error}"
    print(f"verdict: {verdict}\t{why[:200]}", flush=True)
    os._exit(0)  # a loop thread left running must not keep the process alive


def run_all(names: list[str], deadline: float) -> int:
    rows = []
    for name in names:
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "cbpause.apps.hostile", "--probe", name], capture_output=True,
                                  text=True, timeout=deadline)  # fmt: skip
            lines = [x for x in done.stdout.splitlines() if x.startswith("verdict: ")]
            verdict, _, why = (lines[-1][len("verdict: ") :] if lines else "WRONG ERROR\tno verdict").partition("\t")
            if not lines:
                why = done.stderr.strip().splitlines()[-1:] and done.stderr.strip().splitlines()[-1]
        except subprocess.TimeoutExpired:
            verdict, why = "HANG", f"no verdict within {deadline:.0f} s"
        rows.append((name, verdict, time.monotonic() - started, why))
        print(f"  {name}: {verdict} ({rows[-1][2]:.1f} s) {why}", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'probe':<{width}}  verdict      seconds")
    print(f"{'-' * width}  -----------  -------")
    for name, verdict, seconds, _ in rows:
        print(f"{name:<{width}}  {verdict:<11}  {seconds:7.1f}")
    bad = [r for r in rows if r[1] != "OK"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} probes OK")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cbpause.apps.hostile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(PROBES), help="run this probe (repeatable)")
    parser.add_argument("--deadline", type=float, default=HANG_S, help="seconds per probe before it is a HANG")
    parser.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return run_probe(args.probe)
    return run_all(args.only or list(PROBES), args.deadline)


if __name__ == "__main__":
    sys.exit(main())
