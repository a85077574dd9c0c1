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

__all__ = ["free_port", "serve_process", "wait_healthy"]


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
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        if log is not None:
            out.close()
