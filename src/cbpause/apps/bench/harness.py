"""The benchmark's harness: rows and their table, the model, and managers of both implementations.

``ratio`` is always cbpause's cost over upstream's (a time over a time, or upstream's rate over cbpause's):
below 1.00 cbpause is cheaper.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ...testing import percentile

IMPLS = ("upstream", "cbpause")
WAIT = 120.0


def clock_calls(obj: object, name: str, starts: list[float], ends: list[float] | None = None) -> None:
    """Record when each call of ``obj.name`` starts (and ends) by wrapping it on the instance: the same wrapper on
    either implementation's objects."""
    fn = getattr(obj, name)

    def clocked(*args, **kwargs):
        starts.append(time.perf_counter())
        try:
            return fn(*args, **kwargs)
        finally:
            if ends is not None:
                ends.append(time.perf_counter())

    setattr(obj, name, clocked)


def order(rep: int) -> tuple[str, ...]:
    """The implementations in the order repetition ``rep`` runs them: upstream first in even repetitions, cbpause
    first in odd ones (ABBA), so that a drift of the machine within a repetition favours neither."""
    return IMPLS if rep % 2 == 0 else IMPLS[::-1]


@dataclass
class Row:
    """One line of the table.  ``reps`` holds one figure per repetition and implementation; ``samples``
    the pooled distribution where the case is one (latencies)."""

    case: str
    metric: str
    unit: str
    reps: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    higher_is_better: bool = False
    note: str = ""
    scale: tuple[str, int] | None = None  # case 10: the axis and the value this row is measured at

    def add(self, impl: str, samples: list[float]) -> None:
        """One repetition's samples of ``impl``: pooled into ``samples``, their median into ``reps``."""
        if samples:
            self.samples.setdefault(impl, []).extend(samples)
            self.reps.setdefault(impl, []).append(statistics.median(samples))

    def ratios(self) -> list[float]:
        up, ours = self.reps.get("upstream", []), self.reps.get("cbpause", [])
        pairs = [(u, o) for u, o in zip(up, ours, strict=False) if u > 0 and o > 0]
        return [u / o if self.higher_is_better else o / u for u, o in pairs]

    def summary(self) -> dict:
        out = {"case": self.case, "metric": self.metric, "unit": self.unit, "note": self.note}
        for impl in IMPLS:
            if impl in self.samples:
                xs = self.samples[impl]
                out[impl] = {"p50": percentile(xs, 50), "p99": percentile(xs, 99), "n": len(xs)}
            elif impl in self.reps:
                out[impl] = {"median": statistics.median(self.reps[impl]), "reps": self.reps[impl]}
        r = self.ratios()
        if r:
            out["ratio"] = {"median": statistics.median(r), "min": min(r), "max": max(r)}
        return out


def _fmt(x: float, unit: str) -> str:
    if x != x:
        return "-"
    if unit == "ms":
        return f"{x:.3f}"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def _cell(row: Row, impl: str) -> str:
    if impl in row.samples:
        xs = row.samples[impl]
        return f"{_fmt(percentile(xs, 50), row.unit)} / {_fmt(percentile(xs, 99), row.unit)}"
    if impl in row.reps:
        return _fmt(statistics.median(row.reps[impl]), row.unit)
    return "-"


HEAD = ("case", "metric", "unit", "upstream", "cbpause", "ratio (spread)")


def _cells(row: Row, p50_p99: str) -> tuple[str, ...]:
    """One row's cells under :data:`HEAD`; ``p50_p99`` follows the unit of a distribution."""
    r = row.ratios()
    ratio = f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})" if r else "-"
    unit = row.unit + (p50_p99 if row.samples else "")
    return (row.case, row.metric, unit, _cell(row, "upstream"), _cell(row, "cbpause"), ratio)


def format_table(rows: list[Row]) -> str:
    body = [_cells(row, " p50/p99") for row in rows]
    widths = [max(len(str(x[i])) for x in [HEAD, *body]) for i in range(len(HEAD))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [HEAD, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  {row.case} {row.metric}: {row.note}" for row in rows if row.note]
    return "\n".join(lines + (["", "notes:", *notes] if notes else []))


def format_markdown(rows: list[Row]) -> str:
    """The table as Markdown, ready for ``docs/benchmarks.md`` (the same cells as :func:`format_table`)."""
    lines = ["| " + " | ".join(cells) + " |" for cells in [HEAD, ("---",) * len(HEAD)]]
    lines += ["| " + " | ".join(_cells(row, " p50 / p99")) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the model


class Bench:
    """The benchmark's model (a wider tiny Llama, so that a step costs more than the protocol), its forward
    probe (``clock``: when each forward step started), and managers of both implementations on it."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from transformers.utils import logging as hf_logging

        from ...testing import ForwardProbe, tiny_llama

        hf_logging.set_verbosity_error()
        self.args = args
        self.torch = torch
        self.model = tiny_llama(
            args.device, args.seed, vocab_size=256, hidden_size=128, intermediate_size=256, max_position_embeddings=4096
        )
        self.vocab_size = self.model.config.vocab_size
        self.clock = ForwardProbe()
        self.clock.attach(self.model)
        # When each forward step ended, and when each loop began its group step (where both implementations read
        # the pause requests): what lies between a request and the group step after it is the step in flight.
        self.forward_ends: list[float] = []
        self.model.register_forward_hook(lambda *_: self.forward_ends.append(time.perf_counter()))
        self.group_steps: list[float] = []
        self.rng = torch.Generator().manual_seed(args.seed)

    def prompt(self, n: int = 8) -> list[int]:
        return self.torch.randint(1, self.vocab_size, (n,), generator=self.rng).tolist()

    def manager(self, impl: str, max_new: int, in_flight: int):
        from ...integrations.transformers import init_continuous_batching
        from ...testing import batching_config, cache_blocks, greedy_config

        gen = greedy_config(max_new)
        cb = batching_config(num_blocks=cache_blocks(in_flight, 16 + max_new, spare=32), max_batch_tokens=512)
        if impl == "cbpause":
            return init_continuous_batching(self.model, gen, cb, peer_park_timeout=WAIT)
        return self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)

    @contextmanager
    def running(self, impl: str, *, busy: bool, max_new: int = 1024, in_flight: int = 4) -> Iterator:
        """A started manager; with ``busy``, a feeder keeps ``in_flight`` requests generating."""
        manager = self.manager(impl, max_new, in_flight)
        manager.start()
        stop = threading.Event()
        feeder = None
        if busy:

            def feed():
                for _ in range(in_flight):
                    manager.add_request(self.prompt(), max_new_tokens=max_new)
                while not stop.is_set():
                    if manager.get_result(timeout=0.2) is not None and not stop.is_set():
                        manager.add_request(self.prompt(), max_new_tokens=max_new)

            feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
            feeder.start()
            self.clock.wait_steps(3, WAIT)
        # One pause, not measured: the first one waits for the loop to build its cache and scheduler.  Inside it,
        # the batch processor exists: the start of each group step (``_update_tp_group_state``, which both loops
        # call first in every iteration) goes into ``group_steps``.
        with pause(manager, impl):
            clock_calls(manager.batch_processor, "_update_tp_group_state", self.group_steps)
        try:
            yield manager
        finally:
            stop.set()
            if feeder is not None:
                feeder.join(WAIT)
            manager.stop(block=True, timeout=WAIT, hard_stop=True)


    def beyond_the_step(self, asked: float, entered: float) -> tuple[float, float | None]:
        """For one pause asked at ``asked`` and entered at ``entered``: (what the protocol added beyond the step in
        flight, the rest of the forward step in flight or None), in seconds.  The step in flight is what the loop
        was doing when the request came (a forward step and its batch update, or the idle wait): it ends where the
        loop begins its next group step, the first point at which either implementation can see the request."""
        i = bisect.bisect_left(self.group_steps, asked)
        group = self.group_steps[i] if i < len(self.group_steps) and self.group_steps[i] <= entered else asked
        j = bisect.bisect_left(self.forward_ends, asked)
        forward = self.forward_ends[j] - asked if j < len(self.forward_ends) and self.forward_ends[j] <= group else None
        return entered - group, forward


def pause(manager, impl: str, mode: str = "keep"):
    """One pause of either implementation (upstream's ``pause()`` takes no timeout and has no modes)."""
    return manager.pause(timeout=WAIT, mode=mode) if impl == "cbpause" else manager.pause()
