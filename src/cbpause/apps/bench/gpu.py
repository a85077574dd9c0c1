"""``python -m cbpause.apps.bench.gpu``: the GPU check, one command (``nox -s gpu`` or ``scripts/gpu-check.sh``).

On a machine with a CUDA device it runs, in under 8 minutes on one device:

1. the CUDA tests (``pytest -m cuda``: the real-loop tests of ``tests/test_integration_transformers.py`` on
   ``cuda``, with a tiny random model built from a config; no download);
2. ``python -m cbpause.apps.bench --device cuda --quick``, every case but TLC's (case 7's and case 10's TP groups stay
   on the CPU over gloo: one device cannot hold two NCCL ranks);
3. the weight update of ``nox -s bench -- --weights`` (issue 42) with the two servers on CUDA: over NCCL where three
   devices hold the trainer and the servers, one each, else over gloo (the tensors through the host: NCCL takes no two
   ranks on one device), which the report says;

and writes ``gpu.json`` (the device, the versions, the tests' outcome, the bench's rows) and ``gpu.md`` (the same
as Markdown, ready for ``docs/benchmarks.md``) into ``--out``, with the bench's own ``bench.json``, ``bench.md``
and plots beside them.

Without a CUDA device the CUDA parts are skipped, each saying so, and the rest runs as on a GPU: the CUDA tests are
collected and skipped, and the bench runs its overhead case on the CPU as a stand-in, through the same report.  So
the day a GPU is there, the command has already run end to end.  The exit status is 0 unless a test failed or
the bench raised (pytest's 5, no CUDA test collected, counts as a failure).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = "tests/test_integration_transformers.py tests/test_versions.py"
STAND_IN_CASES = "overhead"  # the bench's cases on the CPU when there is no CUDA device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m cbpause.apps.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-results"), help="where gpu.json, gpu.md and the bench go")
    p.add_argument("--tests", default=TESTS, help=f"the test files to run with -m cuda (default {TESTS})")
    p.add_argument("--cases", default=None, help="the bench's cases (default: all on CUDA, "
                   f"{STAND_IN_CASES!r} on the CPU stand-in)")  # fmt: skip
    return p.parse_args(argv)


def device() -> dict:
    """The CUDA device and the versions, or why there is none."""
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available()}  # fmt: skip
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1), cuda_version=torch.version.cuda,
                    devices=torch.cuda.device_count())  # fmt: skip
    else:
        info["why"] = "no CUDA device (torch.cuda.is_available() is False)"
    return info


def run_tests(files: str, out: Path) -> dict:
    """``pytest -m cuda`` on ``files``: the counts from its JUnit report, and its exit status."""
    xml = out / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
           *files.split()]  # fmt: skip
    started = time.perf_counter()
    rc = subprocess.run(cmd, check=False).returncode
    result = {"command": " ".join(cmd[1:]), "exit": rc, "seconds": round(time.perf_counter() - started, 1)}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        result.update(counts)
    return result


def run_bench(cuda: bool, cases: str | None, out: Path) -> dict:
    """The bench on CUDA (``--quick``, every case) or, without a device, its stand-in on the CPU."""
    from . import run

    bench_out = out / "bench"
    argv = ["--quick", "--out", str(bench_out), "--device", "cuda" if cuda else "cpu"]
    chosen = cases or (",".join(run.CASES) if cuda else STAND_IN_CASES)  # every case but TLC's (java may be missing)
    if chosen:
        argv += ["--cases", chosen]
    started = time.perf_counter()
    run.main(argv)
    report = json.loads((bench_out / "bench.json").read_text())
    return {"argv": argv, "stand_in": not cuda, "seconds": round(time.perf_counter() - started, 1),
            "rows": report["rows"], "markdown": (bench_out / "bench.md").read_text()}  # fmt: skip


def run_weights(info: dict) -> dict:
    """Step 3: a full weight update to two servers on CUDA, by broadcast and from disk (``weights_side.measure``)."""
    if not info["cuda"]:
        return {"skipped": "no CUDA device (the CPU figure: nox -s bench -- --weights)"}
    from .weights_side import measure, report

    nccl = info.get("devices", 1) >= 3
    devices = ("cuda:0", "cuda:1", "cuda:2") if nccl else ("cpu", "cuda:0", f"cuda:{min(1, info['devices'] - 1)}")
    started = time.perf_counter()
    result = measure(1024, 3, devices=devices, backend="nccl" if nccl else "gloo")
    return {**result, "seconds": round(time.perf_counter() - started, 1), "markdown": report(result)}


def markdown(info: dict, tests: dict, bench: dict, weights: dict | None = None) -> str:
    if info["cuda"]:
        head = (f"GPU check: {info['name']} ({info['memory_gib']} GiB, CUDA {info['cuda_version']}), torch "
                f"{info['torch']}, transformers {info['transformers']}, Python {info['python']}")
    else:
        head = (f"GPU check without a GPU: {info['why']}; torch {info['torch']}, transformers "
                f"{info['transformers']}, Python {info['python']}. The CUDA parts were skipped.")
    counts = ", ".join(f"{tests.get(k, '?')} {k}" for k in ("passed", "failures", "errors", "skipped"))
    lines = [head, "", f"CUDA tests (`{tests['command']}`): {counts}, exit {tests['exit']}, {tests['seconds']} s.", ""]
    what = "CPU stand-in (the bench's overhead case)" if bench["stand_in"] else "`python -m cbpause.apps.bench`"
    lines += [f"Bench, {what} (`{' '.join(bench['argv'])}`), {bench['seconds']} s:", "", bench["markdown"]]
    if weights is not None:
        if "skipped" in weights:
            lines += ["", f"Weight update: skipped, {weights['skipped']}."]
        else:
            lines += ["", f"Weight update, trainer and servers on {', '.join(weights['devices'])} "
                      f"({weights['seconds']} s):", "", weights["markdown"]]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    info = device()
    print(f"gpu-check: {info.get('name') or info['why']}", flush=True)
    tests = run_tests(args.tests, args.out)
    bench = run_bench(info["cuda"], args.cases, args.out)
    weights = run_weights(info)
    (args.out / "gpu.json").write_text(json.dumps({"device": info, "tests": tests, "bench": bench, "weights": weights},
                                                  indent=1))  # fmt: skip
    (args.out / "gpu.md").write_text(markdown(info, tests, bench, weights))
    print(f"gpu-check: wrote {args.out / 'gpu.json'} and {args.out / 'gpu.md'}")
    return 0 if tests["exit"] == 0 else 1  # 5, no test collected, is a broken check too


if __name__ == "__main__":
    sys.exit(main())
