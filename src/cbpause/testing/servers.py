"""``cbpause serve`` processes for tests, the soak and the bench (issue 29): started on a free local port, waited for
until ``/health`` answers, stopped (SIGTERM, then SIGKILL) on the way out.  Launches ``python -m cbpause.serve`` in a
subprocess, so that this module imports nothing of the server."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from .threads import HANG_S
from .tp import free_port

__all__ = ["free_port", "serve_process", "serve_tp_processes", "wait_healthy"]


def wait_healthy(url: str, process: subprocess.Popen | None = None, timeout: float = HANG_S) -> None:
    """Return once ``url/health`` answers 200; ``RuntimeError`` if ``process`` exits first or ``timeout`` runs out (a
    hang: the server imports torch and transformers, which a loaded machine may make take minutes).
    (Polling: the server is another process, with nothing to wait on but its port.)"""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer /health within {timeout} s")


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@contextlib.contextmanager
def serve_tp_processes(checkpoint: Path, size: int, *args: str, rank_args: list[tuple[str, ...]] | None = None,
                       logs: list[Path] | None = None) -> Iterator[list[tuple[str, subprocess.Popen]]]:  # fmt: skip
    """An engine of ``size`` tensor-parallel ranks, one ``python -m cbpause.serve checkpoint --tp-size size --tp-rank
    r *args *rank_args[r]`` each, meeting over gloo at a free port; yields ``[(base_url, process)]`` in rank order
    once every rank answers ``/health`` (all start at once: each rank waits for the others before it loads its
    shard).  ``logs``: a file per rank for its output."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    outs = [open(log, "w") if log is not None else subprocess.DEVNULL for log in (logs or [None] * size)]  # noqa: SIM115
    ranks = []
    try:
        for rank in range(size):
            port = free_port()
            command = [sys.executable, "-m", "cbpause.serve", str(checkpoint), "--port", str(port), "--tp-size",
                       str(size), "--tp-rank", str(rank), "--tp-init-method", init, *args,
                       *(rank_args[rank] if rank_args else ())]  # fmt: skip
            process = subprocess.Popen(command, stdout=outs[rank], stderr=subprocess.STDOUT, env=env)
            ranks.append((f"http://127.0.0.1:{port}", process))
        for url, process in ranks:
            wait_healthy(url, process)
        yield ranks
    finally:
        for _, process in ranks:
            _stop(process)
        for out in outs:
            if out is not subprocess.DEVNULL:
                out.close()


@contextlib.contextmanager
def serve_process(checkpoint: Path, *args: str, log: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m cbpause.serve checkpoint --port P *args``; yields ``(base_url, process)`` once healthy."""
    port = free_port()
    out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 -- closed below
    command = [sys.executable, "-m", "cbpause.serve", str(checkpoint), "--port", str(port), *args]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url, process
    finally:
        _stop(process)
        if log is not None:
            out.close()
