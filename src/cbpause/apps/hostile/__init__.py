"""``python -m cbpause.apps.hostile`` (``nox -s hostile``): the hostile users' probes, each in its own process with a
deadline, classified and printed as a table.

Each probe is a hostile use of cbpause on transformers' real loop (tiny random Llama, CPU) that once hung, crashed,
answered with the wrong error, went wrong silently or lost a request (issues 13, 26-29, 39).  A probe returns when
the library did the right thing; otherwise it raises one of :class:`Wrong`, :class:`Silent` or :class:`Lost`, and a
probe that outlives its deadline is killed and reported ``HANG``.  Any other exception is ``WRONG ERROR``.  The run
exits 0 only when every probe printed ``OK``.  Keep it growing: every hostile case found later joins :data:`PROBES`.

``--only NAME`` (repeatable) runs some; ``--deadline S`` changes the per-probe deadline (default ``HANG_S``, 300 s).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

from ...testing import HANG_S
from . import holders, requests, serve_cases, serving, weights
from .support import VERDICTS, Lost, Silent, Wrong

# Every probe, by kind (holders, requests, weights, serving), in the order the suite runs them.
PROBES: dict[str, Callable[[], None]] = {
    name: getattr(kind, name)
    for kind, names in (
        (holders, [
            'sigint_in_the_lock', 'sigint_while_queued_at_a_closing_window', 'stronger_mode_behind_a_keep_chain',
            'same_thread_escalation',
            'dead_holder_in_a_drain', 'dead_holder_inside', 'dead_holders_in_every_mode', 'numeric_timeouts',
            'pause_after_every_step', 'deferred_all_reduce_under_explicit_steps',
            'dropin_status_before_mark_as_stopped',
        ]),
        (requests, [
            'iterators_inside_ones_pause', 'add_requests_all_or_nothing', 'max_new_tokens_none',
            'full_queue_inside_ones_pause', 'exit_without_stop', 'stop_without_blocking_keeps_requests',
            'bad_requests_at_the_door', 'many_holders_many_requests', 'start_stop_cycles',
        ]),
        (weights, [
            'bad_weight_versions', 'weights_changed_not_a_bool', 'retract_keeps_metadata', 'float64_lm_head',
            'model_change_the_step_survives', 'model_change_between_kept_sessions',
            'weight_sync_misuse', 'stale_requests_in_every_mode',
        ]),
        (serving, [
            'leases_under_races',
        ]),
        (serve_cases, [
            'serve_hostile_clients',
        ]),
    )
    for name in names
}


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


