"""Processes forked from a preloaded fork server: the TP ranks (:func:`~cbpause.testing.tp.spawn_ranks`) and the
``cbpause serve`` processes (:mod:`cbpause.testing.servers`) of the tests, the campaign, the soak and the bench.

A fresh interpreter imports torch, transformers and the server's stack before it does anything: 3.5-4.5 s of CPU,
and one CI run started about fifty of them (2026-12-07).  multiprocessing's ``forkserver`` imports them once per
process (:data:`PRELOAD`, at the first start) and forks each child from there: a process of one Python thread that
has touched no device, so a child gets CUDA, gloo and its ports fresh, as a spawned one does.

What a child differs in, and how it is made the same:

* its environment is the fork server's (taken at its start): :func:`_enter` installs the one it is given;
* its output: :func:`_enter` points its file descriptors 1 and 2 at the log it is given;
* the interpreter's exit: a multiprocessing child ends in ``os._exit`` and runs no ``atexit`` handler, and
  ``cbpause`` registers one (the manager's hard stop at exit): :func:`_run_module` runs them, as an interpreter does.

Where the platform has no fork server, children are spawned (a fresh interpreter each).
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["ForkedProcess", "context", "start"]

# Imported once by the fork server; one that fails to import (an environment without the serve extra) is skipped.
PRELOAD = (
    "torch", "torch.distributed", "transformers", "transformers.generation.continuous_batching", "uvicorn", "fastapi",
    "cbpause.integrations.transformers", "cbpause.integrations.serving", "cbpause.serve.__main__",
)  # fmt: skip


def context() -> Any:
    """multiprocessing's context for the children: the fork server, preloaded (:data:`PRELOAD`), else spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once this process's fork server runs: it has them
    return ctx


def _enter(env: Mapping[str, str], log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:  # torch read the variable when the fork server imported it
        sys.modules["torch"].set_num_threads(int(threads))
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _run_module(module: str, argv: list[str], env: Mapping[str, str], log: str) -> None:
    _enter(env, log)
    sys.argv = [module, *argv]
    try:
        importlib.import_module(module).main(argv)
    finally:
        atexit._run_exitfuncs()  # what the interpreter's exit runs, and a multiprocessing child does not


class ForkedProcess:
    """The part of :class:`subprocess.Popen` the harness uses, for a child of the fork server (not of this process:
    the fork server reaps it and reports its exit status, a signal's as ``-signum`` as Popen does)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(module: str, argv: list[str], env: Mapping[str, str], log: str) -> ForkedProcess:
    """``python -m module *argv`` as a child of the fork server: ``module.main(argv)``, with environment ``env`` and
    its output appended to ``log`` (``os.devnull`` for none).  A daemon: it dies with this process at the latest."""
    process = context().Process(target=_run_module, args=(module, list(argv), dict(env), log), daemon=True)
    process.start()
    return ForkedProcess(process)
