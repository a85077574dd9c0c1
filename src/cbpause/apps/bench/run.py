"""``python -m cbpause.apps.bench``: the command line, the machine's description, and the report."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import __doc__ as _package_doc
from .cases import case_contention, case_entry_and_resume, case_overhead, case_throughput, case_tlc, case_weight_update
from .harness import Bench, Row, format_markdown, format_table
from .mode_cases import case_modes
from .plot import plot, plot_scaling
from .scaling import case_scaling
from .tp import case_tp


def machine() -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    return (
        f"{platform.system()} {platform.machine()} {cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


CASES = {
    "overhead": case_overhead,
    "entry": case_entry_and_resume,
    "contention": case_contention,
    "throughput": case_throughput,
    "update": case_weight_update,
    "tp": case_tp,
    "modes": case_modes,
    "scaling": case_scaling,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.bench", description=_package_doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and samples: under 3 minutes")
    p.add_argument("--repeats", type=int, default=None, help="repetitions per case (default 2 quick, 5 full)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (case 7 always runs on the CPU over gloo)")
    p.add_argument("--cases", default=",".join([*CASES, "tlc"]), help="comma-separated subset of: "
                   + ", ".join([*CASES, "tlc"]))  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="where bench.json and bench.png go")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trl", action="store_true", help="instead of the cases: TRL's async GRPO on cbpause against its "
                   "synchronous GRPO with generate_batch (cbpause.apps.bench.trl_side; the trl extra)")
    p.add_argument("--trl-steps", type=int, default=None, help="optimizer steps per trainer (default 12 quick, 30)")
    p.add_argument("--trl-modes", default="keep,retract", help="pause modes of the async runs (default keep,retract)")
    p.add_argument("--http", action="store_true", help="instead of the cases: pause-entry latency over HTTP (cbpause "
                   "serve) next to the in-process one (cbpause.apps.bench.http_side; the serve extra)")  # fmt: skip
    p.add_argument("--pauses", type=int, default=None, help="pauses per side with --http (default 10 quick, 40)")
    p.add_argument("--weights", action="store_true", help="instead of the cases: a full weight update by broadcast "
                   "(gloo) against one from disk, to two cbpause serve processes (cbpause.apps.bench.weights_side)")
    p.add_argument("--weights-hidden", type=int, default=None, help="the width of the model --weights sends (default "
                   "256 quick, 1024: about 8 M and 80 M parameters)")  # fmt: skip
    args = p.parse_args(argv)
    unknown = set(args.cases.split(",")) - {*CASES, "tlc"}
    if unknown:
        p.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.weights_hidden is not None and not 64 <= args.weights_hidden <= 8192:
        p.error("--weights-hidden must be between 64 and 8192")
    if args.device.startswith("cuda") and not _cuda():
        p.error("--device cuda: no CUDA device here")
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.http:
        from .http_side import main as http_main

        rounds = {"rounds": 2, "requests": 24} if args.quick else {}
        return http_main(args.out, args.pauses or (10 if args.quick else 40), **rounds)
    if args.weights:
        from .weights_side import main as weights_main

        return weights_main(args.out, args.weights_hidden or (256 if args.quick else 1024), args.repeats or 3)
    if args.trl:
        from .trl_side import main as trl_main

        steps = args.trl_steps or (12 if args.quick else 30)
        return trl_main(args.out, steps, [m.strip() for m in args.trl_modes.split(",") if m.strip()], args.seed)
    reps = args.repeats or (2 if args.quick else 5)
    selected = args.cases.split(",")
    started = time.perf_counter()
    bench = Bench(args)
    rows: list[Row] = []
    for name, fn in CASES.items():
        if name in selected:
            t0 = time.perf_counter()
            rows.extend(fn(bench, reps, args.quick))
            print(f"bench: case {name} done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    tlc_rows = case_tlc(args.quick) if "tlc" in selected else []
    print(f"machine: {machine()}; device {args.device}; {reps} interleaved repetitions")
    print(format_table(rows))
    if tlc_rows:
        print("\n8 TLC (through the runner)")
        for r in tlc_rows:
            if "error" in r:
                print(f"  {r['error']}")
            else:
                depth = "-" if r["depth"] is None else r["depth"]
                print(f"  {r['model']:<27} {r['result']:<36} distinct {r['distinct'] or 0:>9,}  depth {depth:>3}  "
                      f"{r['seconds']:>6} s  {r['states_per_min']:>9,} states/min")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(), "device": args.device, "repetitions": reps, "quick": args.quick,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [r.summary() for r in rows], "raw": [asdict(r) for r in rows], "tlc": tlc_rows,
    }  # fmt: skip
    (args.out / "bench.json").write_text(json.dumps(report, indent=1))
    (args.out / "bench.md").write_text(f"{machine()}; device {args.device}; {reps} interleaved repetitions\n\n"
                                       + format_markdown(rows) + "\n")  # fmt: skip
    drew = plot([r for r in rows if r.scale is None], args.out / "bench.png")
    plotted = f" and {args.out / 'bench.png'}" if drew else " (no plot: no latency case, or no matplotlib)"
    if plot_scaling(rows, args.out / "scaling.png"):
        plotted += f" and {args.out / 'scaling.png'}"
    print(f"\nwrote {args.out / 'bench.json'}, {args.out / 'bench.md'}{plotted}")
    print(f"bench: {report['seconds']} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
