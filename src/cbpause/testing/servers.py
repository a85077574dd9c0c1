"""``cbpause serve`` processes for tests, the soak and the bench (issue 29): started on a free local port, waited for
until ``/health`` answers, stopped (SIGTERM, then SIGKILL) on the way out.  Each is ``python -m cbpause.serve``'s
``main`` in a child of a preloaded fork server (:mod:`cbpause.testing.forks`: torch and the server's stack imported
once, not once a server), so that this module imports nothing of the server.  ``cbpause serve`` as a command of its
own is tests/test_serve.py's (the console script)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from . import forks
from .threads import HANG_S
from .tp import free_port

__all__ = ["child_processes", "free_port", "serve_process", "serve_tp_processes", "wait_healthy"]


def wait_healthy(url: str, process: forks.ForkedProcess | subprocess.Popen | None = None,
                 timeout: float = HANG_S, *, peers: Sequence[tuple[str, Any]] = ()) -> None:  # fmt: skip
    """Return once ``url/health`` answers 200; ``RuntimeError`` if ``process``, or one of the named ``peers`` (the
    other ranks of a TP engine, which this one waits for), exits first, or if ``timeout`` runs out (a hang: the
    server imports torch and transformers, which a loaded machine may make take minutes).
    (Polling: the server is another process, with nothing to wait on but its port.)"""
    import httpx

    watched = [*([("the server", process)] if process is not None else []), *peers]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, watched_process in watched:
            if watched_process.poll() is not None:
                raise RuntimeError(f"{name} exited with {watched_process.returncode} before {url} answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer /health within {timeout} s")


def _stop(process: forks.ForkedProcess) -> None:
    try:
        process.terminate()
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:  # also when an interrupt lands in the wait
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


@contextlib.contextmanager
def serve_tp_processes(checkpoint: Path, size: int, *args: str, rank_args: list[tuple[str, ...]] | None = None,
                       logs: list[Path] | None = None) -> Iterator[list[tuple[str, forks.ForkedProcess]]]:  # fmt: skip
    """An engine of ``size`` tensor-parallel ranks, one ``python -m cbpause.serve checkpoint --tp-size size --tp-rank
    r *args *rank_args[r]`` each, meeting over gloo at a free port; yields ``[(base_url, process)]`` in rank order
    once every rank answers ``/health`` (all start at once: each rank waits for the others before it loads its
    shard).  ``logs``: a file per rank for its output."""
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    ranks = []
    try:
        for rank in range(size):
            port = free_port()
            argv = [str(checkpoint), "--port", str(port), "--tp-size", str(size), "--tp-rank", str(rank),
                    "--tp-init-method", init, *args, *(rank_args[rank] if rank_args else ())]  # fmt: skip
            ranks.append((f"http://127.0.0.1:{port}", _start(argv, env, logs[rank] if logs else None)))
        # A rank waits for its peers before it answers: one that exited (a bad option, say) fails the wait at once,
        # named, instead of its peers' health waits running out (hostile review).
        named = [(f"TP rank {rank}", process) for rank, (_, process) in enumerate(ranks)]
        for url, _ in ranks:
            wait_healthy(url, peers=named)
        yield ranks
    finally:
        for _, process in ranks:
            _stop(process)


@contextlib.contextmanager
def serve_process(checkpoint: Path, *args: str, log: Path | None = None) -> Iterator[tuple[str, forks.ForkedProcess]]:
    """``python -m cbpause.serve checkpoint --port P *args``; yields ``(base_url, process)`` once healthy."""
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    process = _start([str(checkpoint), "--port", str(port), *args], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url, process
    finally:
        _stop(process)


def _start(argv: list[str], env: dict[str, str], log: Path | None) -> forks.ForkedProcess:
    if log is not None:
        Path(log).write_text("")  # the log of this server alone, as a file opened for writing had
    return forks.start("cbpause.serve.__main__", argv, env, str(log) if log is not None else os.devnull)


def child_processes(pid: int, command: bytes = b"") -> list[int]:
    """The live processes whose parent is ``pid`` and whose command line holds ``command`` (a server's receiving
    processes: ``b"cbpause.serve.receiver"``).  Read from each ``/proc/N/stat``: ``/proc/PID/task/TID/children``
    lists only the children the thread TID started, and a server starts them from its worker threads."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and command in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(found)
