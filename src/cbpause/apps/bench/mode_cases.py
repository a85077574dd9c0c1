"""Case 9 of the benchmark: the pause modes side by side (issue 14).

For each mode, on a busy loop (four requests of 64 tokens always in flight): the time from the request to the
holder inside, from the last release to the next forward step, and tokens/s over a run of 20 weight updates
(10 with ``--quick``) made inside pauses in that mode.  The comparison is TRL's pattern today, stop / update /
restart / resubmit (case 6's, on transformers' own manager), in the "upstream" column of the tokens/s rows;
upstream has no modes, so its entry and resume columns are its own (keep) pause.  The retract row's note gives
its recompute cost against keep.
"""

from __future__ import annotations

import statistics
import time

from ...core import transitions as t
from .cases import _generate, _perturb, _stop_restart
from .harness import WAIT, Bench, Row, order, pause

MODE_NAMES = tuple(t.MODE_NAMES.values())  # keep, retract, drain, abort


def _entries(bench: Bench, impl: str, mode: str, n: int) -> tuple[list[float], list[float]]:
    """``n`` pauses in ``mode`` on a busy loop: entry and resume times, in seconds."""
    entries, resumes = [], []
    with bench.running(impl, busy=True, max_new=64) as manager:
        for _ in range(n):
            bench.clock.wait_steps(2, WAIT)
            asked = time.perf_counter()
            with pause(manager, impl, mode):
                entries.append(time.perf_counter() - asked)
                left = time.perf_counter()
            resumes.append(bench.clock.first_after(left, WAIT) - left)
    return entries, resumes


def case_modes(bench: Bench, reps: int, quick: bool) -> list[Row]:
    """Case 9: entry, resume and tokens/s over weight updates, per pause mode."""
    n = 10 if quick else 40
    n_req, max_new = (8, 96) if quick else (16, 256)
    updates = 10 if quick else 20
    every = max(1, max_new // (updates + 1))
    rows = []
    restart = [_stop_restart(bench, n_req, max_new, every, updates)[0] for _ in range(reps)]
    rates: dict[str, list[float]] = {}
    for mode in MODE_NAMES:
        entry = Row("9", f"{mode}: pause entry, busy loop", "ms")
        resume = Row("9", f"{mode}: resume (last out to next step)", "ms")
        rate = Row("9", f"{mode}: tokens/s, {updates} updates", "tokens/s", higher_is_better=True,
                   note="upstream column: stop/update/restart/resubmit")  # fmt: skip
        for rep in range(reps):
            for impl in order(rep) if mode == "keep" else ("cbpause",):
                entries, resumes = _entries(bench, impl, mode, n)
                entry.add(impl, [1e3 * x for x in entries])
                resume.add(impl, [1e3 * x for x in resumes])
            tps, _ = _generate(bench, "cbpause", n_req, max_new, every, update=_perturb(bench), mode=mode)
            rate.reps.setdefault("cbpause", []).append(tps)
        rate.reps["upstream"] = restart
        rates[mode] = rate.reps["cbpause"]
        if mode != "keep":
            entry.note = resume.note = "upstream has no such mode (its keep pause is in the keep rows)"
        rows += [entry, resume, rate]
        if mode == "retract":
            cost = statistics.median(rates["keep"]) / statistics.median(rates["retract"])
            rate.note += f"; recompute cost of retract: keep/retract tokens/s = {cost:.2f}"
    return rows
